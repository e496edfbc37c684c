"""The visual weight-sync check on the vLLM engine (Appendix C.3), run by tests/gpu_check.py in a child process
as `python tests/vl_sync.py OUT.json`: a tiny Qwen2.5-VL (tests/tiny_vl.py) in float32, vLLM collects on image
Sokoban (multimodal prompts: one placeholder per image plus the image), and its log-probs of the sampled tokens
are compared with the trainer's (pixel values and image grids in the forward) before a change of the weights,
after it without a push, and after rollout.push (vision tower included). Writes the three gaps to OUT.json. On
the CPU build here vLLM cannot load Qwen2.5-VL (no torchvision): the error is what OUT.json records."""
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import rollout  # noqa: E402
from test_vision import _collect, _max_gap  # noqa: E402
from tiny_vl import build  # noqa: E402


def main(out):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = build(os.path.join(tmp, "tiny-vl"))
        try:
            engine = rollout.make_engine("vllm", path, dtype="float32", seed=0, max_model_len=1024)
        except (Exception, SystemExit) as e:   # SystemExit: rollout.make_engine's start-up check
            json.dump({"error": f"{type(e).__name__}: {e}"[:2000]}, open(out, "w"))
            return 1
        model, tok, _ = rollout.load_model(path)
        model.to(device).eval()
        gaps = {"before": _max_gap(model, tok, [s for ep in _collect(engine, tok) for s in ep.steps])}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        gaps["stale"] = _max_gap(model, tok, [s for ep in _collect(engine, tok, seed=1) for s in ep.steps])
        rollout.push(engine, model)
        gaps["after"] = _max_gap(model, tok, [s for ep in _collect(engine, tok, seed=2) for s in ep.steps])
        engine.close()
    json.dump(gaps, open(out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
