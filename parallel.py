"""Distributed set-up and collectives for seed.py and sft.py (docs/gpu.md; Appendix B.4 trains on 8 GPUs):
torchrun -> one process group per run, DDP or FSDP2 (`fully_shard`) wrapping, collectives on python numbers
and objects, micro-batch gradient accumulation, bf16 autocast on GPU, and micro-batch chunking that keeps every
rank's forward count equal. Under plain python everything degrades to a world of one.
"""
import contextlib
import datetime
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist

_own_group = False   # setup_dist made the process group (not a vLLM engine of this process): ours to destroy


def setup_dist(seed):
    """torchrun -> one process group (nccl on GPU, gloo on CPU); plain python -> world of one.
    -> (rank, world, device). Seeds python/numpy/torch with seed + rank."""
    global _own_group
    rank, world = 0, 1
    device = torch.device("cpu")
    if "RANK" in os.environ and not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
        _own_group = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    return rank, world, device


def teardown_dist():
    """Destroy the process group setup_dist made; a group an engine made for itself is left alone."""
    global _own_group
    if _own_group and dist.is_initialized():
        dist.destroy_process_group()
    _own_group = False


def rank_world():
    """-> (rank, world) of the process group, (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def all_sum(x):
    """Sum a python number (or list of numbers) over ranks; float64 so counts stay exact."""
    t = torch.tensor(x, dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
    return t.cpu().tolist()


def all_max(x):
    t = torch.tensor(x, dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def gather(obj):
    """-> list of every rank's obj (a python object), on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def wrap(model, cfg, device, world, trainable=True):
    """DDP (gradients averaged over ranks) or FSDP2 (`fully_shard` per decoder layer, then the root).
    On GPU, FSDP2 gathers parameters in the compute dtype and reduces gradients in float32; DDP's
    gradients are views into its buckets (one gradient copy, not two)."""
    model.to(device)
    if cfg.fsdp and world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy()
        if device.type == "cuda":
            mp = MixedPrecisionPolicy(param_dtype=getattr(torch, resolved_dtype(cfg)), reduce_dtype=torch.float32)
        for layer in model.get_decoder().layers:   # a VL model's decoder is its language model
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    if trainable and world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        ddp.device = device   # grpo.response_logprobs reads `model.device`
        return ddp
    return model


def unwrap(model):
    return model.module if hasattr(model, "module") else model


@contextlib.contextmanager
def grad_sync(model, enabled):
    """Micro-batch gradient accumulation. DDP: accumulate locally (no_sync), reduce over ranks only on the
    last backward (`enabled`); its gradients are full-size on every rank either way. FSDP2: reduce-scatter
    at every backward, whatever `enabled` says: without the sync FSDP2 keeps each parameter's full
    unsharded float32 gradient on every rank until the last micro-batch (4 bytes per parameter, 30 GB at
    7B), with it only the shard stays (bench/memory.py --accumulation measures both on gloo)."""
    if hasattr(model, "no_sync"):                                   # DDP
        with (contextlib.nullcontext() if enabled else model.no_sync()):
            yield
    else:
        if hasattr(model, "set_requires_gradient_sync"):            # FSDP2
            model.set_requires_gradient_sync(True)
        yield


def reshard(model):
    """Free FSDP2's gathered parameters after a no-grad pass. Without a backward nothing reshards the
    root group (embeddings, final norm, LM head: torch keeps it gathered after the forward, expecting a
    backward), so a frozen reference would hold them gathered for the rest of the run. No-op otherwise."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def autocast(device, dtype):
    """bf16 compute over fp32 master weights where dtype asks for it: on GPU (the default, --dtype auto) and on a
    CPU only when asked (--dtype bfloat16: fast with avx512_bf16 / AMX, a slow path without; bench/RESULTS.md
    section 6); plain fp32 otherwise."""
    if dtype != "float32":
        return torch.autocast(device.type, dtype=getattr(torch, dtype))
    return contextlib.nullcontext()


def chunked(n, size, same_count):
    """Index chunks [0:size], [size:2 size], ... With same_count every rank gets the same number of chunks
    (the max over ranks; the missing ones are None and the caller runs a throw-away forward): FSDP
    all-gathers shards in every forward, and DDP reduces gradients in the last backward of a step."""
    count = math.ceil(n / size)
    if same_count:
        count = int(all_max(count))
    return [list(range(i * size, min(n, (i + 1) * size))) if i * size < n else None for i in range(count)]


def resolved_dtype(cfg):
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"
