"""One policy update (seed.update_policy) on fixed rows, for tests/test_seed.py.

    python tests/dist_update.py OUT.json                         one process, all 8 rows
    torchrun --nproc_per_node=2 tests/dist_update.py OUT.json    each rank rows rank::2 (DDP)
    torchrun --nproc_per_node=2 tests/dist_update.py OUT.json --fsdp
    torchrun --nproc_per_node=2 tests/dist_update.py OUT.json --reference   (the frozen reference's pass only)

The rows are synthetic token ids over the embedded model (prompt/response lengths differ, so the ranks
hold different token counts); old / reference / skill log-probs and advantages are fixed perturbations
of the model's own log-probs. The optimizer is SGD (AdamW's first step is invariant to the gradient's
scale, so it would hide a wrong token normalization). mini_batch_size 4 -> 2 optimizer steps, and the
interleaved split (rank r: rows r, r+2, ...; its first half, then its second half) makes every global
mini-batch the same set of rows in all three set-ups.
Writes a fingerprint of the parameter change (per tensor: sum, norm and every 997th element), the grad
norms, and the max difference of rank 1's parameters from rank 0's; under torchrun also the run
checkpoint (runfolder.save_checkpoint) next to OUT.json.
"""
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import grpo  # noqa: E402
import parallel  # noqa: E402
import rollout  # noqa: E402
import runfolder  # noqa: E402
import seed  # noqa: E402


def fixed_rows(model, n=8):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(10, 40000, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    adv = torch.randn(n, generator=g)
    has = (torch.arange(n) % 3 != 0).float()
    rows = grpo.Rows(prompts, responses, adv, has)
    cfg = seed.Config(micro_batch_size=3, dtype="float32")
    own = grpo.batch_logprobs(model, rows, 0, cfg.micro_batch_size)
    rows.old = [x + 0.05 * torch.randn(len(x), generator=g) for x in own]
    rows.ref = [x + 0.2 * torch.randn(len(x), generator=g) for x in own]
    rows.lp_skill = [x + 0.5 * torch.randn(len(x), generator=g) for x in own]
    return rows


def reference_pass(out, rank, world, device):
    """The frozen reference as rollout.load_policy wraps it (FSDP2, trainable=False) and its no-grad pass
    (grpo.batch_logprobs): which parameters are plain (gathered) tensors after a bare forward and after
    the pass. Writes {"after_forward": [...], "after_pass": [...], "dtensors": n, "params": n} per rank."""
    from torch.distributed.tensor import DTensor
    ref, tok, _ = rollout.load_model("smollm2-135m")
    rows = fixed_rows(ref, n=4)
    cfg = seed.Config(micro_batch_size=2, fsdp=True, dtype="float32")
    ref = parallel.wrap(ref.requires_grad_(False).eval(), cfg, device, world, trainable=False)
    gathered = lambda: [n for n, p in ref.named_parameters() if not isinstance(p, DTensor)]
    with torch.no_grad():
        ref(input_ids=torch.tensor([rows.prompts[0]]))            # a bare forward: nothing reshards the root
    after_forward = gathered()
    local = rows.take(list(range(rank, len(rows), world)))
    grpo.batch_logprobs(ref, local, tok.pad_token_id, cfg.micro_batch_size, cfg.fsdp)
    mine = {"after_forward": after_forward, "after_pass": gathered(),
            "dtensors": sum(isinstance(p, DTensor) for p in ref.parameters()),
            "params": sum(1 for _ in ref.parameters())}
    got = parallel.gather(mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()


def main():
    out, fsdp = sys.argv[1], "--fsdp" in sys.argv
    rank, world, device = parallel.setup_dist(0)
    if "--reference" in sys.argv:
        return reference_pass(out, rank, world, device)
    model, tok, _ = rollout.load_model("smollm2-135m")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = fixed_rows(model)
    local = rows.take(list(range(rank, len(rows), world)))
    cfg = seed.Config(algo="seed", micro_batch_size=2, mini_batch_size=4, grad_clip=1e9, fsdp=fsdp, dtype="float32")
    wrapped = parallel.wrap(model, cfg, device, world)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.02)
    run = SimpleNamespace(cfg=cfg, model=wrapped, opt=opt, tok=tok, world=world, device=device, rank=rank, skip_streak=0)
    sums, norms, _ = seed.update_policy(run, local)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    after = get_model_state_dict(parallel.unwrap(wrapped), options=StateDictOptions(full_state_dict=True))
    fp = {}
    for k, v in after.items():
        d = (v.detach().cpu().double() - before[k].double()).flatten()
        fp[k] = {"sum": float(d.sum()), "norm": float(d.norm()), "sample": d[::997].tolist()}
    rank_diff = 0.0
    if world > 1:   # rank 1's full parameters against rank 0's
        for k in sorted(after):
            mine = after[k].detach().to(device)                  # NCCL broadcasts device tensors only
            t = mine.contiguous().clone()
            dist.broadcast(t, src=0)
            rank_diff = max(rank_diff, float((t - mine).abs().max()))
        rank_diff = parallel.all_max(rank_diff)
    if world > 1:   # the run checkpoint (HF folder + trainer state) written from the wrapped model
        import numpy as np
        runfolder.save_checkpoint(os.path.dirname(out), 1, wrapped, opt, tok, np.random.default_rng(0))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "fsdp": fsdp, "grad_norms": norms, "sums": sums, "fingerprint": fp,
                       "rank_max_diff": rank_diff}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
