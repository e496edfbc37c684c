"""The weight-sync check under FSDP2, launched by tests/test_rollout.py as
`torchrun --nproc_per_node=2 tests/push_ranks.py OUT.json`: two gloo ranks shard the embedded model with
fully_shard (parallel.wrap), each rank has its own float32 vLLM engine; the engine's log-probs of its own
sample are compared with the sharded trainer's before an optimizer step, after it without a push, and after
rollout.push (the streamed push: one gathered tensor at a time). Rank 0 writes every rank's numbers."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import parallel  # noqa: E402
import rollout  # noqa: E402
import seed  # noqa: E402


def main(out):
    rank, world, device = parallel.setup_dist(0)
    path = rollout.resolve_model(rollout.EMBEDDED)
    model, tok, _ = rollout.load_model(path)
    model = parallel.wrap(model, seed.Config(fsdp=True, dtype="float32"), device, world)
    sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
    engine = rollout.make_engine("vllm", path, dtype="float32", seed=0, max_model_len=1024)
    prompt = rollout.chat_ids(tok, "List the rooms of a house and what each one is for. " * 14)   # > 1 KV block

    def max_diff():   # every rank runs the same number of (collective) FSDP forwards
        [(ids, lps)] = engine.generate([prompt], 1.0, 12)
        lp, _, _ = grpo.response_logprobs(model, [prompt], [ids], tok.pad_token_id)     # [1, R]
        return float((lp[0, :len(ids)] - torch.tensor(lps)).abs().max())

    before = max_diff()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([prompt[:48]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    stale = max_diff()

    streamed, plain = [], rollout.stream_weights
    def recording(m, dtype):   # what reaches the engine: one full, plain tensor per name, lazily
        for name, t in plain(m, dtype):
            streamed.append([name, list(t.shape), type(t).__name__])
            yield name, t
    rollout.stream_weights = recording
    rollout.push(engine, model, opt)
    after = max_diff()
    mine = {"rank": rank, "before": before, "stale": stale, "after": after, "streamed": streamed,
            "sharded": sharded,
            "params": sum(1 for _ in model.parameters()),
            "full_shapes": {k: list(v.shape) for k, v in rollout.load_model(path)[0].state_dict().items()},
            "grads_freed": all(p.grad is None for p in model.parameters())}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    engine.close()          # vLLM's shutdown, then the trainer's group (already gone: vLLM destroyed it)
    parallel.teardown_dist()


if __name__ == "__main__":
    main(sys.argv[1])
