"""Per-rank memory of a Stage-2 run (Section 3.3's training loop as seed.py runs it, docs/gpu.md),
predicted from a model's config.json before anyone rents GPUs, and checked against measured peaks.

Each rank holds: float32 master parameters, float32 gradients (DDP: views into its buckets, which stay
allocated; FSDP2: shards, freed before the push), AdamW's two float32 moments, the frozen reference in
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
"""
import argparse
import json
import os
import sys

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
             engine_gb=None, chunk_bytes=None):
    """-> {component: bytes} and {phase: bytes} for one rank. engine_gb: the awake engine's footprint
    (default util * gpu_gb); runtime_gb: CUDA context, NCCL, allocator slack (or the measured CPU runtime)."""
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
        "grads fp32": 4 * N / shard,                                # DDP: bucket views, always allocated
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
    print(f"per-rank memory on {args.world} x {args.gpu_gb:.0f} GB, micro-batch {args.micro_batch}, prompt "
          f"{args.prompt} + response {args.response} tokens (the longest rows), gradient checkpointing "
          f"{'on' if args.checkpointing else 'off'}, bf16 compute / reference / engine, vLLM share "
          f"{args.util:.2f} ({args.util * args.gpu_gb:.0f} GB awake, 0 asleep at level 2), runtime {args.runtime_gb} GB\n")
    print("| model | params | wrap (run.sh) | params+grads+AdamW | reference | gathered | activations | logits | "
          "rollout | update | push | peak | fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    configs = [(args.config, args.fsdp)] if args.config else RECIPES
    for name, fsdp in configs:
        c = json.load(open(name)) if args.config else MODELS[name]
        part, phase, N = estimate(c, args.world, fsdp, args.gpu_gb, args.util, args.micro_batch, args.prompt,
                                  args.response, args.checkpointing, runtime_gb=args.runtime_gb)
        peak = max(phase.values())
        g = lambda x: f"{x / GB:.1f}"
        recipe = fsdp == (N >= 2.5e9)                                  # run.sh shards 3B and larger
        print(f"| {os.path.basename(str(name))} | {N / 1e9:.2f}B | {'FSDP2' if fsdp else 'DDP'}{' (recipe)' * recipe} | "
              f"{g(part['params fp32'] + part['grads fp32'] + part['adamw fp32'])} | {g(part['reference'])} | "
              f"{g(part['fsdp gathered'])} | {g(part['activations'])} | {g(part['logits chunk'])} | "
              f"{g(phase['rollout'])} | {g(phase['update'])} | {g(phase['push'])} | **{g(peak)}** | "
              f"{'yes' if peak <= 0.95 * args.gpu_gb * GB else 'NO'} |")


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
    args = ap.parse_args(argv)
    if args.validate:
        return validate(args.validate)
    table(args)


if __name__ == "__main__":
    main()
