"""The GPU self-check (`./run.sh gpu-check`): proves the colocated GPU path of docs/gpu.md on this
machine in minutes, one line per check and a verdict. tests/test_gpu.py runs the same checks under pytest.

One process (needs CUDA):
    1. memory   bench/memory.py's estimate of one update step against torch.cuda.max_memory_allocated
    2. fsdp2    one FSDP2 update on 2 GPUs equals one process (tests/dist_update.py; needs 2 GPUs)
    3. sync     bf16 engine vs trainer through the streamed push: within the bf16 floor before an update,
                different after an update without a push, within the floor again after rollout.push. The
                floor is BF16_MARGIN x the measured bf16 rounding of this model (a bf16 copy of the trainer
                against the float32 trainer on the same tokens)
    4. sleep    sleep (level 2) frees the engine's share; an update; rollout.push wakes weights, pushes,
                wakes the KV cache; the engine generates with the new weights
    5. visual   a tiny Qwen2.5-VL (bf16, head size 64) in vLLM on image Sokoban: multimodal prompts, engine
                vs trainer log-probs before and after a push of every weight, vision tower included

--ranks N: starts itself under torchrun on N ranks (gloo on the CPU, NCCL on GPUs) and checks, on every rank,
for the Llama-layout --model and a tiny random Qwen2-layout model (qkv bias, untied LM head):
    engines    one vLLM engine per rank (external_launcher, tensor parallel 1), the trainer's process group
               still answering an all-reduce after the engines joined it, ranks sampling differently
    push       FSDP2 trainer -> engine by rollout.push (full_tensor, one plain tensor at a time): engine vs
               trainer log-probs equal (float32 on the CPU; the bf16 floor on GPU) before an update, stale
               after one without a push, equal again after the push
    reference  the frozen FSDP2 reference is sharded again after its no-grad pass
    memory     (--model only) one FSDP2 update of several micro-batches: bench/memory.py's fsdp_update_bytes
               against the measured peak (VmHWM on the CPU, max_memory_allocated on GPU), within 25 %
    sleep      level-2 sleep and wake on every rank (CUDA only: skipped on the CPU with the reason)

    .venv/bin/python tests/gpu_check.py [--model smollm2-135m] [--micro_batch 4 --prompt 1024 --response 256]
    .venv/bin/python tests/gpu_check.py --ranks 2            # also on the CPU: everything but the CUDA-only parts
Exit status: 0 all checks that could run passed, 1 a check failed, 2 no CUDA (one-process mode).
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import torch  # noqa: E402

BF16_MARGIN = 3.0   # bf16 engine-vs-trainer floor = this x the trainer's own bf16 rounding (bf16_baseline)
FP32_FLOOR = 1e-3    # float32 engine vs trainer (measured 0.0 on the CPU build)


def bf16_baseline(model, prompts, responses, pad_id):
    """bf16's rounding on this model: max |log p| difference between a bf16 copy of the trainer and the
    float32 trainer on the same tokens (no autocast). An engine in bf16 holds bf16 weights too, so its gap
    to the trainer is of this size; a partly stale push is not."""
    import copy
    import grpo
    full = copy.deepcopy(model).float()
    half = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        a, mask, _ = grpo.response_logprobs(full, prompts, responses, pad_id)        # [rows, R]
        b, _, _ = grpo.response_logprobs(half, prompts, responses, pad_id)           # [rows, R]
    del full, half
    return float(((a - b.float()) * mask).abs().max())


def build_qwen2(out, head_dim=32, seed=0):
    """A tiny Qwen2-layout model with random weights (qkv bias, untied LM head: Qwen2.5-7B's layout) and
    the embedded model's tokenizer, saved as an HF folder that transformers and vLLM load. head_dim: 32 is
    the smallest vLLM's CPU attention serves, 64 for its GPU backends. -> out."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    import rollout
    tok = AutoTokenizer.from_pretrained(rollout.resolve_model(rollout.EMBEDDED))
    H = 4 * head_dim
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()
    assert model.model.layers[0].self_attn.q_proj.bias is not None and model.lm_head.weight is not model.model.embed_tokens.weight
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def check_memory(model_name="smollm2-135m", micro_batch=4, prompt=1024, response=256):
    """One micro-batch forward/backward + AdamW step in bf16 autocast with gradient checkpointing, nothing
    else on the GPU yet: the allocator's peak against the model's update phase (no runtime, no engine)."""
    import grpo
    import rollout
    from bench import memory
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model, tok, path = rollout.load_model(model_name)
    model.gradient_checkpointing_enable()
    model.cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (prompt,), generator=g).tolist() for _ in range(micro_batch)]
    responses = [torch.randint(10, 30000, (response,), generator=g).tolist() for _ in range(micro_batch)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, mask, ent = grpo.response_logprobs(model, prompts, responses, tok.pad_token_id, grad=True, entropy=True)
    (grpo.masked_mean(lp, mask) + 0.001 * grpo.masked_mean(ent, mask)).backward()
    opt.step()
    measured = torch.cuda.max_memory_allocated() - start
    c = json.load(open(os.path.join(path, "config.json")))
    part, _, _ = memory.estimate(c, world=1, micro_batch=micro_batch, prompt=prompt, response=response,
                                 checkpointing=True, compute_bytes=2, runtime_gb=0.0, engine_gb=0.0)
    # first step: gradients, then AdamW's moments at the step (the reference and engine are not here)
    pred = part["params fp32"] + part["grads fp32"] + max(part["autocast copies"] + part["activations"]
                                                          + part["logits chunk"], part["adamw fp32"])
    del model, opt, lp, mask, ent
    torch.cuda.empty_cache()
    ratio = pred / measured
    return abs(ratio - 1) <= 0.25, f"predicted {pred / 2**30:.2f} GiB, max_memory_allocated {measured / 2**30:.2f} GiB, ratio {ratio:.2f}"


def check_fsdp2():
    """tests/dist_update.py in one process and under torchrun on 2 GPUs with --fsdp: the same update."""
    if torch.cuda.device_count() < 2:
        return None, f"skipped: needs 2 GPUs, found {torch.cuda.device_count()}"
    from test_seed import assert_same_update
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    with tempfile.TemporaryDirectory() as tmp:
        one, two = os.path.join(tmp, "one.json"), os.path.join(tmp, "two", "ranks.json")
        os.makedirs(os.path.dirname(two))
        for cmd in ([sys.executable, "tests/dist_update.py", one],
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     "tests/dist_update.py", two, "--fsdp"]):
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if p.returncode:
                return False, f"{' '.join(cmd[-3:])} failed: {p.stderr.strip().splitlines()[-1:]}"
        a, b = json.load(open(one)), json.load(open(two))
    try:
        assert b["rank_max_diff"] == 0.0, "the two ranks hold different parameters"
        assert_same_update(a, b)
    except AssertionError as e:
        return False, f"differs from one process: {e}"
    return True, f"grad norms {a['grad_norms']} vs {b['grad_norms']}"


def _engine_and_model(model_name):
    import rollout
    model, tok, path = rollout.load_model(model_name)
    model.cuda()
    engine = rollout.make_engine("vllm", path, dtype="bfloat16", seed=0, max_model_len=2048)
    prompt = rollout.chat_ids(tok, "List the rooms of a house and what each one is for. " * 14)
    return [engine, model, tok, prompt]


def _max_diff(engine, model, tok, prompt):
    import grpo
    [(ids, lps)] = engine.generate([prompt], 1.0, 16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, _, _ = grpo.response_logprobs(model, [prompt], [ids], tok.pad_token_id)   # [1, R]
    return float((lp[0, :len(ids)].float().cpu() - torch.tensor(lps)).abs().max())


def _step(model, prompt):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([prompt[:64]], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return opt


def bf16_floor(engine, model, tok, prompt):
    """BF16_MARGIN x bf16_baseline on a sample of the engine's -> (floor, baseline)."""
    [(ids, _)] = engine.generate([prompt], 1.0, 16)
    base = bf16_baseline(model, [prompt], [ids], tok.pad_token_id)
    return BF16_MARGIN * base, base


def check_sync(state):
    import rollout
    engine, model, tok, prompt = state
    floor, base = bf16_floor(engine, model, tok, prompt)
    state.append(floor)                        # check_sleep uses the same floor
    before = _max_diff(engine, model, tok, prompt)
    opt = _step(model, prompt)
    stale = _max_diff(engine, model, tok, prompt)
    rollout.push(engine, model, opt)
    after = _max_diff(engine, model, tok, prompt)
    ok = before <= floor and after <= floor and stale > max(1.0, 3 * after)
    return ok, (f"max |diff| before {before:.3f}, after an update without push {stale:.3f}, after push {after:.3f} "
                f"(floor {floor:.3f} = {BF16_MARGIN:g} x the bf16-vs-float32 trainer gap {base:.3f})")


def check_sleep(state, util=0.3):
    import rollout
    engine, model, tok, prompt = state[:4]
    floor = state[4] if len(state) > 4 else bf16_floor(engine, model, tok, prompt)[0]
    total = torch.cuda.mem_get_info()[1]
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    opt = _step(model, prompt)
    rollout.push(engine, model, opt)            # wake weights -> push -> wake KV cache
    diff = _max_diff(engine, model, tok, prompt)
    back = free_awake - torch.cuda.mem_get_info()[0]
    ok = freed >= 0.5 * util * total and diff <= floor and not engine.asleep
    return ok, (f"sleep freed {freed / 2**30:.1f} GiB (share {util * total / 2**30:.1f}), awake again "
                f"(+{back / 2**30:.1f} GiB vs before), max |diff| after the push {diff:.3f} (floor {floor:.3f})")


def check_visual():
    """tests/vl_sync.py in a child process (its own vLLM engine): a tiny Qwen2.5-VL on image Sokoban, bf16 and
    head size 64 on GPU (FlashAttention / Triton serve it), engine vs trainer log-probs before, stale without a
    push, within the floor again after rollout.push (vision tower too)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "vl.json")
        p = subprocess.run([sys.executable, "tests/vl_sync.py", out], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        if not os.path.exists(out):
            return False, f"tests/vl_sync.py wrote nothing: {p.stderr.strip().splitlines()[-1:]}"
        r = json.load(open(out))
    if "error" in r:
        return False, f"vLLM did not serve the tiny Qwen2.5-VL: {r['error'][:300]}"
    floor = BF16_MARGIN * r["baseline"] if "baseline" in r else FP32_FLOOR
    ok = r["before"] <= floor and r["after"] <= floor and r["stale"] > max(1e-2, 3 * r["after"])
    return ok, (f"{r['dtype']}: max |diff| before {r['before']:.2g}, after a change without push {r['stale']:.2g}, "
                f"after push {r['after']:.2g} (floor {floor:.2g})")


# ----------------------------------------------------------------------------- --ranks N: every rank, under torchrun

def _rank_engines(engine, tok, world):
    """vLLM under external_launcher on every rank: its tensor-parallel group is this rank alone, the trainer's
    group still answers an all-reduce after the engine's start-up, and the ranks sample differently."""
    import parallel
    from vllm.distributed import parallel_state
    tp = parallel_state.get_tp_group().world_size
    total = parallel.all_sum(1.0)
    [(ids, _)] = engine.generate([rollout_prompt(tok)], 1.0, 12)
    texts = parallel.gather(ids)
    distinct = len({tuple(t) for t in texts})
    ok = tp == 1 and total == world and (world == 1 or distinct > 1)
    return ok, f"tensor-parallel group of {tp}, trainer all-reduce after start-up {total:.0f} (world {world}), {distinct} distinct samples over {world} ranks"


def rollout_prompt(tok):
    import rollout
    return rollout.chat_ids(tok, "List the rooms of a house and what each one is for. " * 14)   # > 1 KV block


def _rank_push(engine, model, tok, device, floor):
    """FSDP2 trainer -> engine: log-probs before, after an AdamW step without a push, after rollout.push, and
    what reached the engine (full plain tensors, one per name, every name)."""
    import grpo
    import rollout
    prompt = rollout_prompt(tok)
    ac = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext

    def max_diff():   # every rank runs the same number of (collective) FSDP forwards
        [(ids, lps)] = engine.generate([prompt], 1.0, 12)
        with torch.no_grad(), ac():
            lp, _, _ = grpo.response_logprobs(model, [prompt], [ids], tok.pad_token_id)   # [1, R]
        return float((lp[0, :len(ids)].float().cpu() - torch.tensor(lps)).abs().max())

    before = max_diff()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)   # large: a random tiny model must move visibly
    ids = torch.tensor([prompt[:48]], device=device)
    with ac():
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    stale = max_diff()
    streamed, plain = [], rollout.stream_weights
    def recording(m, dtype):
        for name, t in plain(m, dtype):
            streamed.append((name, type(t).__name__, tuple(t.shape)))
            yield name, t
    rollout.stream_weights = recording
    try:
        rollout.push(engine, model, opt)
    finally:
        rollout.stream_weights = plain
    after = max_diff()
    names = list(parallel_unwrap(model).state_dict())
    plain_full = all(kind == "Tensor" for _, kind, _ in streamed) and [n for n, _, _ in streamed] == names
    ok = before <= floor and after <= floor and stale > 3 * max(floor, after) and plain_full
    return ok, (f"max |diff| before {before:.2g}, after an update without push {stale:.2g}, after push {after:.2g} "
                f"(floor {floor:.2g}); {len(streamed)} of {len(names)} weights streamed as full plain tensors: {plain_full}")


def parallel_unwrap(model):
    import parallel
    return parallel.unwrap(model)


def _rank_reference(path, tok, cfg, device, world):
    """The frozen reference as rollout.load_policy wraps it, after grpo.batch_logprobs: every parameter a shard."""
    import grpo
    import parallel
    import rollout
    from torch.distributed.tensor import DTensor
    ref, _, _ = rollout.load_model(path, dtype=parallel.resolved_dtype(cfg))
    ref = parallel.wrap(ref.requires_grad_(False).eval(), cfg, device, world, trainable=False)
    prompt = rollout_prompt(tok)
    rows = grpo.Rows([prompt[:40], prompt[:30]], [prompt[40:52], prompt[30:36]], torch.zeros(2), torch.zeros(2))
    grpo.batch_logprobs(ref, rows, tok.pad_token_id, cfg.micro_batch_size, cfg.fsdp, parallel.resolved_dtype(cfg))
    gathered = [n for n, p in ref.named_parameters() if not isinstance(p, DTensor)]
    n = sum(1 for _ in ref.parameters())
    del ref
    return not gathered, f"{n - len(gathered)} of {n} parameters sharded DTensors after the pass" + (
        f" (gathered: {gathered[:3]})" if gathered else "")


def rank_job(out, path, layout):
    """One torchrun job of --ranks: set up the process group (NCCL on GPUs, gloo on the CPU), start the engine,
    run the per-rank checks, write every rank's lines to OUT (rank 0), then shut the engine down (vLLM's
    shutdown destroys the process group, so it comes last)."""
    import parallel
    import rollout
    import seed
    rank, world, device = parallel.setup_dist(0)
    gpu = device.type == "cuda"
    dtype = "bfloat16" if gpu else "float32"
    lines = []

    def record(name, fn, *a):
        try:
            ok, line = fn(*a)
        except Exception as e:   # a check that crashes is a failed check, with its reason
            ok, line = False, f"{type(e).__name__}: {e}"
        lines.append((ok, f"{name} [{layout}, rank {rank}]", line))

    model, tok, _ = rollout.load_model(path)
    floor, base = FP32_FLOOR, None
    engine = None
    try:
        engine = rollout.make_engine("vllm", path, dtype=dtype, seed=0, max_model_len=1024)
    except (Exception, SystemExit) as e:
        record("engines", lambda: (False, f"vLLM engine did not start: {type(e).__name__}: {e}"))
    if engine is not None:
        record("engines", _rank_engines, engine, tok, world)
        if gpu:   # the bf16 floor of this model, from a plain float32 copy on this rank's GPU
            plain = rollout.load_model(path)[0].to(device)
            [(ids, _)] = engine.generate([rollout_prompt(tok)], 1.0, 12)
            base = bf16_baseline(plain, [rollout_prompt(tok)], [ids], tok.pad_token_id)
            floor = BF16_MARGIN * base
            del plain
        cfg = seed.Config(fsdp=True, dtype="auto")
        wrapped = parallel.wrap(model, cfg, device, world)
        record("push", _rank_push, engine, wrapped, tok, device, floor)
        record("reference", _rank_reference, path, tok, cfg, device, world)
        if gpu:
            def sleep_wake():
                free = torch.cuda.mem_get_info()[0]
                engine.sleep()
                freed = torch.cuda.mem_get_info()[0] - free
                rollout.push(engine, wrapped)
                return freed > 0 and not engine.asleep, f"level-2 sleep freed {freed / 2**30:.2f} GiB, awake after the push"
            record("sleep", sleep_wake)
        else:
            lines.append((None, f"sleep [{layout}, rank {rank}]", "skipped: level-2 sleep needs CUDA (vLLM's CPU "
                          "backend has no sleep mode; rollout's sleep is a no-op there)"))
    got = parallel.gather(lines)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "device": device.type, "baseline": base, "lines": got}, f)
    parallel.gather(None)   # everyone past the write
    if engine is not None:
        engine.close()
    parallel.teardown_dist()


def launch_ranks(args):
    """--ranks N from plain python: build the tiny Qwen2-layout model, run rank_job under torchrun once per
    model (vLLM's shutdown ends a process group, so each model gets its own job), then the FSDP2 memory
    check (bench/memory.py's accumulation_worker, its own job); print every rank's lines and a verdict."""
    from bench import memory
    import rollout
    gpu = torch.cuda.is_available()
    where = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if gpu else "no CUDA device (gloo, float32)"
    print(f"gpu-check --ranks {args.ranks}: torch {torch.__version__}, {where}", flush=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = []

    def show(ok, name, line):
        results.append(ok)
        print(f"[{'PASS' if ok else 'SKIP' if ok is None else 'FAIL'}] {name}: {line}", flush=True)

    if not gpu:
        show(None, "cuda", "skipped on this machine (no CUDA): NCCL groups shared with vLLM, bf16 engines and their "
                           "floor, level-2 sleep, max_memory_allocated; everything else runs through gloo in float32")
    with tempfile.TemporaryDirectory() as tmp:
        qwen = build_qwen2(os.path.join(tmp, "tiny-qwen2"), head_dim=64 if gpu else 32)
        for layout, path in (("llama", rollout.resolve_model(args.model)), ("qwen2", qwen)):
            out = os.path.join(tmp, f"{layout}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                   os.path.abspath(__file__), "--rank_job", out, "--model", path, "--layout", layout]
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if not os.path.exists(out):
                show(False, f"ranks [{layout}]", f"torchrun exited {p.returncode}: {p.stderr.strip()[-1500:]}")
                continue
            r = json.load(open(out))
            for rank_lines in r["lines"]:
                for ok, name, line in rank_lines:
                    show(ok, name, line)
            if p.returncode:
                show(False, f"ranks [{layout}]", f"torchrun exited {p.returncode} after the checks: {p.stderr.strip()[-800:]}")
    mb, P, R, k = (args.micro_batch, args.prompt, args.response, 4) if gpu else (2, 32, 16, 4)
    try:
        os.environ["SEED_MEMORY_MODEL"] = args.model
        pred, seen, _ = memory.measure_accumulation("every", k, mb, P, R, ranks=args.ranks, timed=False)
        ratio = pred / seen
        show(abs(ratio - 1) <= 0.25, "memory [fsdp2]",
             f"{args.ranks} ranks, {k} micro-batches of {mb} x ({P} + {R}) tokens, gradients reduce-scattered at "
             f"every micro-batch: predicted {pred / 2**20:.0f} MiB, measured {seen / 2**20:.0f} MiB "
             f"({'max_memory_allocated' if gpu else 'VmHWM'}), ratio {ratio:.2f}")
    except Exception as e:
        show(False, "memory [fsdp2]", f"{type(e).__name__}: {str(e)[-1500:]}")
    failed, ran = results.count(False), sum(r is not None for r in results)
    print(f"verdict: {'FAIL' if failed else 'PASS'} ({ran - failed} of {ran} checks passed"
          f"{', ' + str(results.count(None)) + ' skipped' if None in results else ''})")
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model the GPU can train in one process")
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=0,
                    help="run the per-rank checks on N ranks under torchrun (also on the CPU, through gloo)")
    ap.add_argument("--rank_job", default="", help=argparse.SUPPRESS)      # one torchrun job of --ranks
    ap.add_argument("--layout", default="llama", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_job:
        return rank_job(args.rank_job, args.model, args.layout)
    if args.ranks:
        return launch_ranks(args)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to torch (torch.cuda.is_available() is False); "
              "this check needs an NVIDIA GPU and the GPU requirements (./run.sh setup on that machine); "
              "--ranks 2 runs the per-rank checks on the CPU through gloo")
        return 2
    print(f"gpu-check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
          flush=True)
    results = []

    def record(name, fn, *a):
        try:
            ok, line = fn(*a)
        except Exception as e:   # a check that crashes is a failed check, with its reason
            ok, line = False, f"{type(e).__name__}: {e}"
        results.append(ok)
        print(f"[{'PASS' if ok else 'SKIP' if ok is None else 'FAIL'}] {name}: {line}", flush=True)

    record("memory", check_memory, args.model, args.micro_batch, args.prompt, args.response)
    record("fsdp2", check_fsdp2)
    record("visual", check_visual)
    try:
        state = _engine_and_model(args.model)
    except Exception as e:
        state = None
        record("engine", lambda: (False, f"vLLM engine did not start: {type(e).__name__}: {e}"))
    if state is not None:
        record("sync", check_sync, state)
        record("sleep", check_sleep, state)
        state[0].close()
    failed, ran = results.count(False), sum(r is not None for r in results)
    print(f"verdict: {'FAIL' if failed else 'PASS'} ({ran - failed} of {ran} checks passed"
          f"{', ' + str(results.count(None)) + ' skipped' if None in results else ''})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
