"""The GPU path (DESIGN section 5) on a machine with CUDA: the checks of tests/gpu_check.py under pytest
(`./run.sh gpu-check` prints the same checks as one line each). Every test here needs CUDA and skips
without it; on CPU the same paths are covered by test_rollout.py (weight sync, FSDP2 streamed push) and
test_seed.py (DDP / FSDP2 equal one process)."""
import pytest
import torch

import gpu_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def engine_state():
    state = gpu_check._engine_and_model("smollm2-135m")
    yield state
    state[0].close()


def test_memory_model_matches_the_allocator_peak():
    ok, line = gpu_check.check_memory()
    assert ok, line


def test_fsdp2_update_on_two_gpus_equals_one_process():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ok, line = gpu_check.check_fsdp2()
    assert ok, line


def test_bf16_weight_sync_through_the_streamed_push(engine_state):
    ok, line = gpu_check.check_sync(engine_state)
    assert ok, line


def test_sleep_update_wake_in_two_steps(engine_state):
    ok, line = gpu_check.check_sleep(engine_state)
    assert ok, line
