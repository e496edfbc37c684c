"""Two-rank rollout check, launched by tests/test_rollout.py as
`torchrun --nproc_per_node=2 tests/rollout_ranks.py OUT.json`: each rank makes its own in-process vLLM
engine after init_process_group (gloo) with the same base seed, plays the same tasks, and rank 0
writes every rank's response texts to OUT.json."""
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import ToyEnv  # noqa: E402  (tests/ is this script's folder)

import rollout  # noqa: E402


def main(out):
    dist.init_process_group("gloo")
    path = rollout.resolve_model(rollout.EMBEDDED)
    engine = rollout.make_engine("vllm", path, dtype="float32", seed=0, max_model_len=1024)
    _, tok, _ = rollout.load_model(path)
    envs = [ToyEnv(max_steps=2) for _ in range(4)]
    episodes = rollout.collect(engine, tok, envs, [0, 1], 2, temperature=1.0, max_tokens=16, progress=False)
    mine = {"rank": dist.get_rank(), "texts": [[s.response_text for s in ep.steps] for ep in episodes],
            "groups": [ep.group_id for ep in episodes],
            "lengths": [[len(s.response_ids) == len(s.engine_logprobs) for s in ep.steps] for ep in episodes]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
