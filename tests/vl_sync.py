"""The visual weight-sync check on the vLLM engine (Appendix C.3), run by tests/gpu_check.py in a child process
as `python tests/vl_sync.py OUT.json`: a tiny Qwen2.5-VL (tests/tiny_vl.py; float32 and head size 16 on the CPU,
bf16 and head size 64 on GPU, which vLLM's GPU attention backends serve), vLLM collects on image
Sokoban (multimodal prompts: one placeholder per image plus the image), and its log-probs of the sampled tokens
are compared with the trainer's (pixel values and image grids in the forward) before a change of the weights,
after it without a push, and after rollout.push (vision tower included). Writes the three gaps to OUT.json. On
the CPU build here vLLM cannot load Qwen2.5-VL (no torchvision): the error is what OUT.json records."""
import contextlib
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import rollout  # noqa: E402
from test_vision import _collect, _max_gap  # noqa: E402
from gpu_check import bf16_baseline  # noqa: E402
from tiny_vl import build  # noqa: E402


def _gap(model, tok, steps, dtype):
    with torch.no_grad(), (torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bfloat16"
                           else contextlib.nullcontext()):
        return _max_gap(model, tok, steps)


def main(out):
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if gpu else ("cpu", "float32")   # vLLM's GPU kernels: bf16, head size 64
    with tempfile.TemporaryDirectory() as tmp:
        path = build(os.path.join(tmp, "tiny-vl"), head_dim=64 if gpu else 16)
        try:
            engine = rollout.make_engine("vllm", path, dtype=dtype, seed=0, max_model_len=1024)
        except (Exception, SystemExit) as e:   # SystemExit: rollout.make_engine's start-up check
            json.dump({"error": f"{type(e).__name__}: {e}"[:2000]}, open(out, "w"))
            return 1
        model, tok, _ = rollout.load_model(path)
        model.to(device).eval()
        steps = [s for ep in _collect(engine, tok) for s in ep.steps]
        gaps = {"dtype": dtype, "before": _gap(model, tok, steps, dtype)}
        if gpu:   # the bf16 rounding floor: the trainer in bf16 against itself in float32, same tokens
            gaps["baseline"] = bf16_baseline(model, [s.prompt_ids for s in steps], [s.response_ids for s in steps],
                                             tok.pad_token_id)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        gaps["stale"] = _gap(model, tok, [s for ep in _collect(engine, tok, seed=1) for s in ep.steps], dtype)
        rollout.push(engine, model)
        gaps["after"] = _gap(model, tok, [s for ep in _collect(engine, tok, seed=2) for s in ep.steps], dtype)
        engine.close()
    json.dump(gaps, open(out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
