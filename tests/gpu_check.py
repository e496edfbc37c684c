"""The GPU self-check (`./run.sh gpu-check`): proves the colocated GPU path of docs/gpu.md on this
machine in minutes, one line per check and a verdict. Needs CUDA; tests/test_gpu.py runs the same checks
under pytest.

    1. memory   bench/memory.py's estimate of one update step against torch.cuda.max_memory_allocated
    2. fsdp2    one FSDP2 update on 2 GPUs equals one process (tests/dist_update.py; needs 2 GPUs)
    3. sync     bf16 engine vs trainer through the streamed push: equal within bf16 rounding before an
                update, different after an update without a push, equal again after rollout.push
    4. sleep    sleep (level 2) frees the engine's share; an update; rollout.push wakes weights, pushes,
                wakes the KV cache; the engine generates with the new weights
    5. visual   a tiny Qwen2.5-VL in vLLM on image Sokoban: multimodal prompts, engine vs trainer log-probs
                equal in float32 before and after a push of every weight, vision tower included (tests/vl_sync.py)

    .venv/bin/python tests/gpu_check.py [--model smollm2-135m] [--micro_batch 4 --prompt 1024 --response 256]
Exit status: 0 all checks that could run passed, 1 a check failed, 2 no CUDA.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import torch  # noqa: E402

BF16_FLOOR = 0.5   # max |engine - trainer| log-prob in bf16 (docs/gpu.md: measured floor 0.1-0.3)


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
    return engine, model, tok, prompt


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


def check_sync(state):
    import rollout
    engine, model, tok, prompt = state
    before = _max_diff(engine, model, tok, prompt)
    opt = _step(model, prompt)
    stale = _max_diff(engine, model, tok, prompt)
    rollout.push(engine, model, opt)
    after = _max_diff(engine, model, tok, prompt)
    ok = before <= BF16_FLOOR and after <= BF16_FLOOR and stale > max(1.0, 3 * after)
    return ok, f"max |diff| before {before:.3f}, after an update without push {stale:.3f}, after push {after:.3f}"


def check_sleep(state, util=0.3):
    import rollout
    engine, model, tok, prompt = state
    total = torch.cuda.mem_get_info()[1]
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    opt = _step(model, prompt)
    rollout.push(engine, model, opt)            # wake weights -> push -> wake KV cache
    diff = _max_diff(engine, model, tok, prompt)
    back = free_awake - torch.cuda.mem_get_info()[0]
    ok = freed >= 0.5 * util * total and diff <= BF16_FLOOR and not engine.asleep
    return ok, (f"sleep freed {freed / 2**30:.1f} GiB (share {util * total / 2**30:.1f}), awake again "
                f"(+{back / 2**30:.1f} GiB vs before), max |diff| after the push {diff:.3f}")


def check_visual():
    """tests/vl_sync.py in a child process (its own vLLM engine): a tiny Qwen2.5-VL on image Sokoban, float32,
    engine vs trainer log-probs before, stale without a push, equal again after rollout.push (vision tower too)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "vl.json")
        p = subprocess.run([sys.executable, "tests/vl_sync.py", out], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        if not os.path.exists(out):
            return False, f"tests/vl_sync.py wrote nothing: {p.stderr.strip().splitlines()[-1:]}"
        r = json.load(open(out))
    if "error" in r:
        return False, f"vLLM did not serve the tiny Qwen2.5-VL: {r['error'][:300]}"
    ok = r["before"] < 1e-3 and r["after"] < 1e-3 and r["stale"] > 1e-2
    return ok, f"max |diff| before {r['before']:.2g}, after a change without push {r['stale']:.2g}, after push {r['after']:.2g}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model the GPU can train in one process")
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=256)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to torch (torch.cuda.is_available() is False); "
              "this check needs an NVIDIA GPU and the GPU requirements (./run.sh setup on that machine)")
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
