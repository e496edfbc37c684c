"""The GPU path (docs/gpu.md) on a machine with CUDA: tests/gpu_check.py (what `./run.sh gpu-check` runs) in
a child process, one test per check line, so its engine and process group never meet the test session's; with
2 GPUs also `gpu_check.py --ranks 2` (NCCL, one engine per rank, both layouts). Every test here needs CUDA and
skips without it; on CPU the same paths are covered by test_rollout.py (weight sync, FSDP2 streamed push),
test_seed.py (DDP / FSDP2 equal one process) and test_gpu_path.py."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HERE = os.path.dirname(os.path.abspath(__file__))


def _lines(*args):
    p = subprocess.run([sys.executable, os.path.join(HERE, "gpu_check.py"), *args], cwd=os.path.dirname(HERE),
                       capture_output=True, text=True, timeout=3600)
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("[") and "] " in line and ":" in line:
            status, rest = line[1:].split("] ", 1)
            out[rest.split(":", 1)[0]] = (status, line)
    assert out, p.stdout[-2000:] + p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def lines():
    return _lines()


@pytest.mark.parametrize("check", ["memory", "sync", "sleep", "visual"])
def test_gpu_check(lines, check):
    status, line = lines.get(check, ("MISSING", f"no line for {check}"))
    assert status == "PASS", line


def test_fsdp2_update_on_two_gpus_equals_one_process(lines):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    status, line = lines["fsdp2"]
    assert status == "PASS", line


def test_gpu_check_on_two_ranks():
    """external_launcher engines, the FSDP2 push, the reference reshard, sleep and the FSDP2 memory model on
    2 GPUs, for the Llama-layout embedded model and a tiny Qwen2-layout one: every line passes."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    got = _lines("--ranks", "2")
    for name, layout in [(n, l) for n in ("engines", "push", "reference", "sleep") for l in ("llama", "qwen2")]:
        for rank in (0, 1):
            key = f"{name} [{layout}, rank {rank}]"
            assert got.get(key, ("MISSING",))[0] == "PASS", got.get(key, key)
    assert got["memory [fsdp2]"][0] == "PASS", got["memory [fsdp2]"]
