"""Per-rank memory of a Stage-2 run (Section 3.3's training loop as seed.py runs it, docs/gpu.md),
predicted from a model's config.json before anyone rents GPUs, and checked against measured peaks.

Each rank holds: float32 master parameters, float32 gradients (DDP: views into its buckets, which stay
allocated; FSDP2: shards, reduce-scattered at every micro-batch and freed before the push; the code before
synced only the last micro-batch, and FSDP2 then keeps every parameter's full float32 gradient on every
rank from the first micro-batch on: the table's "update before"), AdamW's two float32 moments, the frozen reference in
the compute dtype, and while the engine is awake vLLM's share of the GPU (`--gpu_memory_utilization` of
the whole GPU: vLLM sizes its KV cache to fill exactly that, vllm/v1/worker/utils.py:724 and
gpu_worker.py:753 in vLLM 0.33). FSDP2 divides the first four by the world size and adds the gathered
parameters of the layers in flight plus the root's (embeddings, LM head), which stay gathered through
forward and backward. The update adds activations (per micro-batch of `micro_batch` rows of
`prompt + response` tokens: every decoder layer's input with gradient checkpointing plus one layer's
recompute, or every layer's saved tensors without) and one chunk of LM-head logits
(grpo.LOGITS_CHUNK_BYTES, about 5 float32 copies at its peak). The sleeping engine (level 2) holds nothing;
the push wakes its weights (the model in the engine dtype) while one gathered tensor is in flight.

    .venv/bin/python bench/memory.py                       # the table: Qwen x {DDP, FSDP2} on 8 x 80 GB
    .venv/bin/python bench/memory.py --config path/config.json --world 8 --fsdp --micro_batch 4
    .venv/bin/python bench/memory.py --validate .cache/bench/runs/memory-grpo   # against update_cost's peaks
    .venv/bin/python bench/memory.py --accumulation --micro_batch 2 --prompt 32 --response 16
        # FSDP2 on 2 gloo ranks: one update's peak with sync at every micro-batch vs only the last,
        # measured against fsdp_update_bytes, and the update's time
"""
import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1e9
# Published config.json values (Hugging Face model cards). Qwen2.5 has no 1.7B: its nearest is 1.5B.
MODELS = {
    "Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                  num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                  tie_word_embeddings=True),
    "Qwen2.5-3B-Instruct": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                                num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
                                tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                tie_word_embeddings=False),
    "Qwen2.5-14B-Instruct": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
                                 num_key_value_heads=8, intermediate_size=13824, vocab_size=152064,
                                 tie_word_embeddings=False),
    "Qwen3-1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True),
}
LOGIT_COPIES = 5     # float32 copies of one logits chunk alive at the chunk's peak (logits, z, softmax, product, grad)


def shapes(c):
    """-> (parameters, per-layer parameters, root parameters, widths) from config.json fields."""
    H, L, V, I = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H + q + 2 * kv      # attention, MLP, norms, qkv bias
    root = V * H * (1 if c.get("tie_word_embeddings") else 2) + H          # embeddings (+ LM head), final norm
    return L * layer + root, layer, root, dict(H=H, L=L, V=V, I=I, q=q, kv=kv, heads=c["num_attention_heads"])


def activations(w, tokens, row_len, act_bytes, checkpointing, math_attention, stream_bytes):
    """Saved activations of one micro-batch (tokens = rows x padded length). act_bytes: matmul outputs
    (the compute dtype); stream_bytes: the residual stream (float32 under autocast with float32 weights,
    DDP; the compute dtype when FSDP2 gathers bf16 parameters). Per token and layer: the two RMSNorms keep
    a float32 input and normalized copy plus their output (and its cast to the compute dtype); attention
    keeps q, k, v, the rotary copies and the output (plus the [heads, T, T] probabilities on the math
    path); the SwiGLU MLP keeps gate, its activation, up and their product."""
    H, I, q, kv = w["H"], w["I"], w["q"], w["kv"]
    cast = act_bytes * H if stream_bytes != act_bytes else 0
    per = 2 * (8 * H + stream_bytes * H + cast) + act_bytes * (3 * q + 2 * H + 6 * kv) + act_bytes * 4 * I
    if math_attention:
        per += 4 * w["heads"] * row_len                              # float32 softmax output, one row of T
    if checkpointing:
        return w["L"] * tokens * H * stream_bytes + tokens * per     # layer inputs + one layer's recompute
    return w["L"] * tokens * per


def estimate(c, world=8, fsdp=False, gpu_gb=80.0, util=0.3, micro_batch=8, prompt=2048, response=512,
             checkpointing=True, compute_bytes=2, engine_bytes=2, runtime_gb=1.5, math_attention=False,
             engine_gb=None, chunk_bytes=None, micro_batches=4, sync_every=True):
    """-> {component: bytes} and {phase: bytes} for one rank. engine_gb: the awake engine's footprint
    (default util * gpu_gb); runtime_gb: CUDA context, NCCL, allocator slack (or the measured CPU runtime).
    micro_batches: micro-batches per optimizer step on a rank (the recipe: 256 rows / 8 ranks / 8 = 4).
    sync_every: FSDP2 reduce-scatters at every micro-batch (parallel.grad_sync now); False: only on the
    last, as the code did before, when FSDP2 keeps each parameter's full float32 gradient on every rank
    from the first micro-batch on (torch's unsharded_accumulated_grad)."""
    import grpo
    N, layer, root, w = shapes(c)
    shard = world if fsdp else 1
    tokens = micro_batch * (prompt + response)
    chunk = (chunk_bytes or grpo.LOGITS_CHUNK_BYTES)
    part = {
        "runtime": runtime_gb * GB,
        "params fp32": 4 * N / shard,
        "adamw fp32": 8 * N / shard,
        "reference": compute_bytes * N / shard,
        # DDP: bucket views, always allocated; FSDP2 without sync over several micro-batches: unsharded
        "grads fp32": 4 * N / (1 if fsdp and not sync_every and micro_batches > 1 else shard),
        "fsdp gathered": (2 * layer + root) * compute_bytes + 4 * root if fsdp and world > 1 else 0.0,
        # autocast keeps a compute-dtype copy of each float32 weight it casts, for the whole forward
        "autocast copies": compute_bytes * N if compute_bytes < 4 and not (fsdp and world > 1) else 0.0,
        "activations": activations(w, tokens, prompt + response, compute_bytes, checkpointing, math_attention,
                                   compute_bytes if fsdp and world > 1 else 4),
        "logits chunk": LOGIT_COPIES * min(chunk, micro_batch * response * w["V"] * 4),
        "engine awake": (engine_gb if engine_gb is not None else util * gpu_gb) * GB,
        "engine weights + 1 tensor": engine_bytes * (N + w["V"] * w["H"]),
    }
    resident = part["runtime"] + part["params fp32"] + part["adamw fp32"] + part["reference"]
    grads_between = 0.0 if fsdp else part["grads fp32"]                 # FSDP2 frees them before the push
    phase = {
        "rollout": resident + grads_between + part["engine awake"],
        "update": resident + part["grads fp32"] + part["fsdp gathered"] + part["autocast copies"]
                  + part["activations"] + part["logits chunk"],
        "push": resident + grads_between + part["engine weights + 1 tensor"],
    }
    return part, phase, N


# ----------------------------------------------------------------------------- the table

RECIPES = [(name, fsdp) for name in MODELS for fsdp in (False, True)]


def table(args):
    k = args.micro_batches
    print(f"per-rank memory on {args.world} x {args.gpu_gb:.0f} GB, micro-batch {args.micro_batch}, prompt "
          f"{args.prompt} + response {args.response} tokens (the longest rows), {k} micro-batches per optimizer "
          f"step, gradient checkpointing {'on' if args.checkpointing else 'off'}, bf16 compute / reference / "
          f"engine, vLLM share {args.util:.2f} ({args.util * args.gpu_gb:.0f} GB awake, 0 asleep at level 2), "
          f"runtime {args.runtime_gb} GB. FSDP2 update, before: gradients accumulated unsharded (sync only on the "
          f"last micro-batch: 4 bytes per parameter on every rank); now: reduce-scattered at every micro-batch\n")
    print("| model | params | wrap (run.sh) | params+grads+AdamW | reference | gathered | activations | logits | "
          "rollout | update before | update now | push | peak now | peak phase | fits |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    configs = [(args.config, args.fsdp)] if args.config else RECIPES
    phases = {}
    for name, fsdp in configs:
        c = json.load(open(name)) if args.config else MODELS[name]
        run = lambda sync: estimate(c, args.world, fsdp, args.gpu_gb, args.util, args.micro_batch, args.prompt,
                                    args.response, args.checkpointing, runtime_gb=args.runtime_gb,
                                    micro_batches=k, sync_every=sync)
        part, phase, N = run(True)
        _, before, _ = run(False)
        peak_phase = max(phase, key=phase.get)
        peak = phase[peak_phase]
        phases.setdefault(peak_phase, []).append(f"{os.path.basename(str(name))} {'FSDP2' if fsdp else 'DDP'}")
        g = lambda x: f"{x / GB:.1f}"
        recipe = fsdp == (N >= 2.5e9)                                  # run.sh shards 3B and larger
        print(f"| {os.path.basename(str(name))} | {N / 1e9:.2f}B | {'FSDP2' if fsdp else 'DDP'}{' (recipe)' * recipe} | "
              f"{g(part['params fp32'] + part['grads fp32'] + part['adamw fp32'])} | {g(part['reference'])} | "
              f"{g(part['fsdp gathered'])} | {g(part['activations'])} | {g(part['logits chunk'])} | "
              f"{g(phase['rollout'])} | {g(before['update'])} | {g(phase['update'])} | {g(phase['push'])} | "
              f"**{g(peak)}** | {peak_phase} | {'yes' if peak <= 0.95 * args.gpu_gb * GB else 'NO'} |")
    print("\nThe peak phase: " + "; ".join(f"{ph} for {', '.join(ns)}" for ph, ns in sorted(phases.items()))
          + " (rollout: the resident state plus vLLM's awake share; update: gradients, gathered layers, "
            "activations and logits on top of the resident state while the engine sleeps).")


# ----------------------------------------------------------------------------- validation on this CPU

def measured_runtime_mb(model_path, kv_gib):
    """Live resident memory of a process that imported everything seed.py imports, loaded the tokenizer
    and started the float32 vLLM engine of `model_path` (its weights and its KV cache included): the
    runtime plus engine the model adds to the trainer's parts. Measured in a child process, after
    `malloc_trim`: the heap the engine's start-up freed is reused by what comes next, so it is not counted."""
    import subprocess
    code = ("import os, rollout, seed, psutil; from transformers import AutoTokenizer; "
            f"AutoTokenizer.from_pretrained({model_path!r}); "
            f"rollout.make_engine('vllm', {model_path!r}, dtype='float32', max_model_len=2048); "
            "import ctypes, gc; gc.collect(); ctypes.CDLL('libc.so.6').malloc_trim(0); "
            "print('RSS', psutil.Process().memory_info().rss / 2**20)")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=kv_gib)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    found = [x for x in p.stdout.splitlines() if x.startswith("RSS")]
    if not found:
        sys.exit(f"measuring the runtime failed:\n{p.stderr[-3000:]}")
    return float(found[-1].split()[1])


def padded_tokens(rows, micro_batch):
    """The largest micro-batch as seed.py lays it out (rows sorted by (prompt, response) length, then
    [left-padded prompt | right-padded response]): -> (rows x padded width, response width, width)."""
    rows = sorted(rows, key=lambda r: (len(r["prompt"]), len(r["response"])))
    best = (0, 0, 0)
    for i in range(0, len(rows), micro_batch):
        mb = rows[i:i + micro_batch]
        P, R = max(len(r["prompt"]) for r in mb), max(len(r["response"]) for r in mb)
        best = max(best, (len(mb) * (P + R), R, P + R))
    return best


def validate(run_dir):
    """Predicted against measured peak RSS per phase of a seed.py run instrumented by bench/update_cost.py."""
    import rollout
    from bench import common
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    mem = json.load(open(os.path.join(run_dir, "bench_memory.json")))
    path = rollout.resolve_model(cfg["init"] or cfg["model"])
    c = json.load(open(os.path.join(path, "config.json")))
    tok = rollout.load_model(path)[1]
    rows = common.replay_rows(os.path.join(run_dir, "episodes", "update_0000.jsonl"), tok)   # update 0's rows
    tokens, R, width = padded_tokens(rows, cfg["micro_batch_size"])
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB, as vLLM reads it
    runtime = measured_runtime_mb(path, kv)
    rows_per_mb = tokens // width
    part, _, N = estimate(c, world=1, fsdp=False, micro_batch=rows_per_mb, prompt=width - R, response=R,
                          checkpointing=cfg["gradient_checkpointing"], compute_bytes=4, engine_bytes=4,
                          runtime_gb=runtime * 2 ** 20 / GB, math_attention=True, engine_gb=0.0)
    _, _, _, w = shapes(c)
    one_layer = activations(w, tokens, width, 4, False, True, 4) / w["L"]    # a no-grad pass keeps one layer's
    # Update 0 as the process holds it. transformers maps the safetensors file (copy on write), so a model's
    # weights enter RSS when first read: the reference in its pass, the policy in the update (where the
    # optimizer step also makes them private). The engine is inside the measured runtime.
    run_, ref, pol = part["runtime"], part["reference"], part["params fp32"]
    pred = {"collect": run_,                                            # neither model read yet
            "logprobs": run_ + ref + one_layer + part["logits chunk"],  # the reference pass
            # gradients from the first micro-batch on, AdamW's moments made at the step
            "update": run_ + ref + pol + part["grads fp32"]
                      + max(part["activations"] + part["logits chunk"], part["adamw fp32"]),
            "push": run_ + ref + pol + part["adamw fp32"]}                # gradients freed, moments kept
    print(f"run {run_dir}: {N / 1e6:.1f}M parameters, float32, one process, micro-batch {rows_per_mb} x {width} "
          f"padded tokens (response {R}), {len(rows)} rows; runtime + engine measured in a child process: "
          f"{runtime:.0f} MiB (imports, tokenizer, vLLM engine with its weights and {kv} GiB KV cache)\n")
    print("| phase (update 0) | predicted MiB | measured peak RSS MiB | predicted / measured |\n|---|---|---|---|")
    worst = 0.0
    for ph in ("collect", "logprobs", "update", "push"):
        seen = [m["peak_mb"] for m in mem if m["phase"] == ph]
        if not seen:
            continue
        p = pred[ph] / 2 ** 20
        if ph == "push":   # the heap the update freed is still resident (glibc keeps it): not the push's own
            print(f"| push | {p:.0f} live | {seen[0]:.0f} (the update's freed heap still resident) | - |")
            continue
        worst = max(worst, abs(p / seen[0] - 1))
        print(f"| {ph} | {p:.0f} | {seen[0]:.0f} | {p / seen[0]:.2f} |")
    print(f"\nlargest deviation {worst * 100:.0f} % ({'within' if worst <= 0.25 else 'OUTSIDE'} +-25 %)")
    return worst


# ----------------------------------------------------------------------------- FSDP2's gradient accumulation on gloo

def fsdp_update_bytes(c, world, micro_batch, prompt, response, sync_every, compute_bytes=4, math_attention=True):
    """What one FSDP2 update adds on a rank above its resident state (sharded parameters and AdamW moments),
    float32 on the CPU (compute_bytes 4), bf16-gathered on GPU (2): the gradients (sync at every micro-batch: the float32 shards,
    4 N / world; sync only on the last: every parameter's full float32 gradient, 4 N, kept from the first
    micro-batch on), the root group's own gradient of the backward in flight (the LM head's arrives first,
    the embeddings' last), the gathered root and two layers (the one computing and the one prefetched),
    one micro-batch's activations and one logits chunk. -> {term: bytes}."""
    import grpo
    N, layer, root, w = shapes(c)
    tokens = micro_batch * (prompt + response)
    return {"grads": 4 * N / world if sync_every else 4 * N,
            "root grad in flight": compute_bytes * root,   # in the gathered parameters' dtype
            "gathered": compute_bytes * (root + 2 * layer),
            "activations": activations(w, tokens, prompt + response, compute_bytes, False, math_attention,
                                       compute_bytes),
            "logits chunk": LOGIT_COPIES * min(grpo.LOGITS_CHUNK_BYTES, micro_batch * response * w["V"] * 4)}


def _vm(key):
    """VmRSS / VmHWM of this process in bytes (/proc/self/status)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def accumulation_worker(out, sync, micro_batches, micro_batch, prompt, response, timed=True):
    """One rank of `--accumulation` (under torchrun): the embedded model (or $SEED_MEMORY_MODEL) under FSDP2,
    float32 on the CPU (bf16 compute on GPU), one warm-up update (AdamW's moments exist from then on, as in
    every update after the first), then one measured update of `micro_batches` micro-batches and one timed.
    GPU: torch.cuda.max_memory_allocated over the update minus the allocation at its start. CPU: the
    kernel's high-water mark (VmHWM, reset by writing 5 to /proc/self/clear_refs just before the update)
    minus the resident memory at the reset; the parent sets glibc's mmap threshold to 64 KiB
    (MALLOC_MMAP_THRESHOLD_), so every tensor is its own mapping, returned to the kernel when freed: RSS
    follows the live tensors, not glibc's retained heap. The time is taken on the update after it, with
    the threshold at 32 MiB (where glibc's default, dynamic threshold ends up): mapping every tensor
    afresh costs system time."""
    import contextlib
    import ctypes
    import gc
    import time
    import torch
    import torch.distributed as dist
    import grpo
    import parallel
    import rollout
    import seed
    rank, world, device = parallel.setup_dist(0)
    gpu = device.type == "cuda"
    model, tok, path = rollout.load_model(os.environ.get("SEED_MEMORY_MODEL", rollout.EMBEDDED))
    n = micro_batches * micro_batch
    cfg = seed.Config(algo="grpo", kl_coef=0.0, fsdp=True, dtype="auto", micro_batch_size=micro_batch,
                      mini_batch_size=world * n, grad_clip=1.0)
    model = parallel.wrap(model, cfg, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(rank)
    ids = lambda k: torch.randint(10, 40000, (k,), generator=g).tolist()
    rows = grpo.Rows([ids(prompt) for _ in range(n)], [ids(response) for _ in range(n)],
                     torch.randn(n, generator=g), torch.zeros(n))
    if sync == "last":   # the code before: FSDP2 reduce-scatters only in the last micro-batch's backward
        @contextlib.contextmanager
        def sync_last(m, enabled):
            m.set_requires_gradient_sync(enabled)
            yield
        seed.grad_sync = sync_last
    run = SimpleNamespace(cfg=cfg, model=model, opt=opt, tok=tok, world=world, device=device, rank=rank, skip_streak=0)
    update = lambda: seed.update_policy(run, rows)
    update()                                            # warm-up: AdamW's moments
    opt.zero_grad(set_to_none=True)
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    dist.barrier()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        libc.malloc_trim(0)
        base = _vm("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                # VmHWM := VmRSS
    update()
    peak = (torch.cuda.max_memory_allocated() if gpu else _vm("VmHWM")) - base
    sec = None
    if timed:
        if not gpu:
            libc.mallopt(-3, 32 * 2 ** 20)              # M_MMAP_THRESHOLD
        dist.barrier()
        t0 = time.perf_counter()
        update()
        if gpu:
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
    got = parallel.gather({"rank": rank, "base": base, "peak": peak, "seconds": sec})
    if rank == 0:
        c = json.load(open(os.path.join(path, "config.json")))
        json.dump({"sync": sync, "world": world, "device": device.type, "ranks": got, "config": c}, open(out, "w"))
    parallel.teardown_dist()


def measure_accumulation(sync, micro_batches, micro_batch, prompt, response, ranks=2, timeout=1200, timed=True):
    """accumulation_worker on `ranks` ranks under torchrun -> (predicted bytes, measured bytes (the larger
    rank), seconds of the update (the slower rank; None unless timed)), or a RuntimeError with the job's stderr."""
    import subprocess
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{sync}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               os.path.abspath(__file__), "--accumulation_worker", out, "--sync", sync, "--micro_batches",
               str(micro_batches), "--micro_batch", str(micro_batch), "--prompt", str(prompt), "--response", str(response),
               *([] if timed else ["--untimed"])]
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode or not os.path.exists(out):
            raise RuntimeError(f"the {sync} run failed:\n{p.stderr[-3000:]}")
        r = json.load(open(out))
    gpu = r["device"] == "cuda"
    pred = sum(fsdp_update_bytes(r["config"], r["world"], micro_batch, prompt, response, sync == "every",
                                 compute_bytes=2 if gpu else 4, math_attention=not gpu).values())
    return pred, max(x["peak"] for x in r["ranks"]), (max(x["seconds"] for x in r["ranks"]) if timed else None)


def accumulation(args):
    """Sync at every micro-batch against sync only on the last, 2 ranks (gloo here), the embedded model: the
    measured peak of one update against fsdp_update_bytes, and the update's time."""
    mb, P, R, k = args.micro_batch, args.prompt, args.response, args.micro_batches
    print(f"FSDP2, 2 ranks, the embedded model, {k} micro-batches of {mb} rows x ({P} + {R}) tokens per rank, one "
          f"AdamW step; peak = what the update adds (the larger rank; accumulation_worker says how it is measured)\n")
    print("| sync | predicted MiB | measured MiB | predicted / measured | update s |\n|---|---|---|---|---|")
    worst = 0.0
    for sync in ("every", "last"):
        try:
            pred, measured, sec = measure_accumulation(sync, k, mb, P, R)
        except RuntimeError as e:
            sys.exit(str(e))
        worst = max(worst, abs(pred / measured - 1))
        print(f"| {sync} micro-batch | {pred / 2**20:.0f} | {measured / 2**20:.0f} | {pred / measured:.2f} | {sec:.1f} |")
    print(f"\nlargest deviation {worst * 100:.0f} % ({'within' if worst <= 0.25 else 'OUTSIDE'} +-25 %)")
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="", help="a local config.json instead of the built-in Qwen table")
    ap.add_argument("--fsdp", action="store_true", help="with --config: FSDP2 instead of DDP")
    ap.add_argument("--world", type=int, default=8, help="ranks (GPUs)")
    ap.add_argument("--gpu_gb", type=float, default=80.0, help="memory of one GPU, GB")
    ap.add_argument("--util", type=float, default=0.3, help="seed.py --gpu_memory_utilization")
    ap.add_argument("--micro_batch", type=int, default=8, help="seed.py --micro_batch_size")
    ap.add_argument("--prompt", type=int, default=2048, help="longest prompt (seed.py --max_prompt_tokens)")
    ap.add_argument("--response", type=int, default=512, help="longest response (seed.py --max_tokens)")
    ap.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="seed.py --gradient_checkpointing")
    ap.add_argument("--runtime_gb", type=float, default=1.5, help="CUDA context, NCCL and allocator slack")
    ap.add_argument("--validate", default="", help="a run folder of bench/update_cost.py: predicted vs measured")
    ap.add_argument("--accumulation", action="store_true",
                    help="FSDP2 on 2 gloo ranks: the update's peak with sync at every micro-batch vs only the last")
    ap.add_argument("--micro_batches", type=int, default=4,
                    help="micro-batches per optimizer step on a rank (seed.py: mini_batch_size / ranks / micro_batch_size)")
    ap.add_argument("--accumulation_worker", default="", help=argparse.SUPPRESS)   # one rank, under torchrun
    ap.add_argument("--sync", default="every", choices=("every", "last"), help=argparse.SUPPRESS)
    ap.add_argument("--untimed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.accumulation_worker:
        return accumulation_worker(args.accumulation_worker, args.sync, args.micro_batches, args.micro_batch,
                                   args.prompt, args.response, timed=not args.untimed)
    if args.accumulation:
        return accumulation(args)
    if args.validate:
        return validate(args.validate)
    table(args)


if __name__ == "__main__":
    main()
