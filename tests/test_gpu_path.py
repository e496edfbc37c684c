"""The GPU path's CPU-checkable parts (Appendix B.4's 8-GPU training, run here on 2 gloo ranks): the frozen
reference reshards after its no-grad pass under FSDP2, FSDP2 reduce-scatters at every micro-batch, and
`./run.sh gpu-check` runs from an existing venv without installing anything."""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reference_is_sharded_again_after_its_pass(tmp_path):
    """2 gloo ranks: a bare no-grad forward leaves the root group (embeddings, final norm) gathered; after
    grpo.batch_logprobs (the reference pass) every parameter is a sharded DTensor again."""
    out = tmp_path / "ref.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
                        "tests/dist_update.py", str(out), "--reference"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert "model.embed_tokens.weight" in r["after_forward"], r   # what the pass must undo
        assert r["after_pass"] == [] and r["dtensors"] == r["params"] > 0, r


def test_fsdp2_grad_sync_reduces_at_every_micro_batch():
    """parallel.grad_sync: FSDP2 keeps its gradient sync on for every micro-batch (no unsharded float32
    accumulation); DDP still skips the all-reduce until the last one."""
    import contextlib
    import parallel

    class FSDPLike:
        calls = []
        def set_requires_gradient_sync(self, on):
            self.calls.append(on)

    m = FSDPLike()
    for last in (False, False, True):
        with parallel.grad_sync(m, last):
            pass
    assert m.calls == [True, True, True]

    class DDPLike:
        entered = 0
        @contextlib.contextmanager
        def no_sync(self):
            DDPLike.entered += 1
            yield

    d = DDPLike()
    for last in (False, False, True):
        with parallel.grad_sync(d, last):
            pass
    assert DDPLike.entered == 2


def test_gpu_check_uses_an_existing_venv_without_installing(tmp_path):
    """A venv whose requirements stamp is stale: `./run.sh gpu-check --help` says that set-up would have
    to install, never calls pip, and runs tests/gpu_check.py with that venv's python."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    (venv / ".seed-setup").write_text("0000000000000000\n")
    py = venv / "bin" / "python"   # records every call; `-m pip` fails loudly, the rest is the real python
    py.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                  f'case "$1 $2" in "-m pip") echo "pip called" >&2; exit 97;; esac\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    env = dict(ENV, SEED_VENV=str(venv))
    env.pop("SEED_SETUP", None)
    p = subprocess.run(["./run.sh", "gpu-check", "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    calls = log.read_text().splitlines()
    assert p.returncode == 0, p.stderr[-2000:]
    assert "would have to install" in p.stderr and "SEED_SETUP=1" in p.stderr, p.stderr
    assert "--ranks" in p.stdout                                   # gpu_check.py's own help
    assert calls and all("pip" not in c for c in calls), calls
    assert (venv / ".seed-setup").read_text() == "0000000000000000\n"


def test_tiny_qwen2_has_qwen2s_layout_and_a_bf16_floor(tmp_path):
    """gpu_check's Qwen2-layout model: qkv bias, an untied LM head, loadable from its folder; its bf16
    baseline (a bf16 copy against the float32 model on the same tokens) is positive and small."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import gpu_check
    import rollout
    path = gpu_check.build_qwen2(str(tmp_path / "q"))
    model, tok, _ = rollout.load_model(path)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert model.model.layers[0].self_attn.k_proj.bias is not None
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    prompt = rollout.chat_ids(tok, "hello there")
    base = gpu_check.bf16_baseline(model, [prompt], [prompt[:5]], tok.pad_token_id)
    assert 0.0 < base < 0.5, base
