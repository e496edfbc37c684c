"""Rollout overhead (Algorithm 1, "collect"; rollout.collect): how much of a rollout's wall time is spent
inside the engine's generate call, with 32 and 128 episodes in flight on generated ALFWorld games; the rest
broken down (prompt building + chat template, env.step, decoding the response, bookkeeping); vLLM against
the HF fallback in tokens/s on the same prompts; and peak memory (RSS) of each phase.

The engine and the envs are wrapped, not changed: `generate`, `env.prompt`, `env.step`, `env.reset`,
`rollout.chat_ids` and `tokenizer.decode` are timed with time.perf_counter around the real calls.

    .venv/bin/python bench/rollout.py                          # 32 and 128 episodes, 2 turns, 48 tokens
    .venv/bin/python bench/rollout.py --episodes 32 128 --max_steps 4 --max_tokens 128
"""
import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402

CLOCK = defaultdict(float)     # seconds per timed call site
COUNT = defaultdict(int)


def clocked(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            CLOCK[name] += time.perf_counter() - t
            COUNT[name] += 1
    return wrapper


class TimedEngine:
    """The engine with a stopwatch around generate (and token counts); everything else passes through."""

    def __init__(self, engine):
        self.engine, self.prompt_tokens, self.new_tokens = engine, 0, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        out = clocked("engine.generate", self.engine.generate)(prompt_ids_list, temperature, max_tokens, n)
        self.prompt_tokens += sum(len(p) for p in prompt_ids_list)
        self.new_tokens += sum(len(ids) for ids, _ in out)
        return out


class TimedEnv:
    def __init__(self, env):
        self.env = env
        self.reset = clocked("env.reset", env.reset)
        self.step = clocked("env.step", env.step)
        self.prompt = clocked("env.prompt", env.prompt)

    def __getattr__(self, name):
        return getattr(self.env, name)


class TimedTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.decode = clocked("tokenizer.decode", tok.decode)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *a, **k):
        return self.tok(*a, **k)


def rollout_share(engine, tok, envs_, n_episodes, group, max_tokens):
    """One rollout.collect of n_episodes (n_episodes / group tasks) -> wall, engine share, breakdown."""
    import rollout
    CLOCK.clear()
    COUNT.clear()
    timed = TimedEngine(engine)
    tasks = list(range(n_episodes // group))
    common.reset_peak_rss()
    t = time.perf_counter()
    eps = rollout.collect(timed, TimedTokenizer(tok), [TimedEnv(e) for e in envs_[:n_episodes]], tasks, group,
                          temperature=1.0, max_tokens=max_tokens, progress=False)
    wall = time.perf_counter() - t
    record(eps, n_episodes, envs_[0], max_tokens)
    parts = dict(CLOCK)
    parts["env.prompt + chat template"] = parts.pop("env.prompt", 0.0) + parts.pop("chat_ids", 0.0)
    parts["other (records, bookkeeping)"] = wall - sum(parts.values())
    return {"episodes": n_episodes, "wall": wall, "share": CLOCK["engine.generate"] / wall, "parts": parts,
            "turns": COUNT["engine.generate"], "steps": sum(e.length for e in eps),
            "prompt_tokens": timed.prompt_tokens, "new_tokens": timed.new_tokens, "peak_mb": common.peak_rss_mb()}


def record(eps, n, env, max_tokens):
    """Keep the episodes as a run folder in seed.py's format (config.json + episodes/update_0000.jsonl), so
    bench/train_step.py can replay their rows (realistic prompt and response lengths)."""
    import json
    import runfolder
    run = os.path.join(common.BENCH_CACHE, "runs", f"rollout-{n}")
    os.makedirs(os.path.join(run, "episodes"), exist_ok=True)
    cfg = {"env": "alfworld", "data_dir": common.games_dir(), "history_length": env.history_length,
           "max_steps": env.max_steps, "max_tokens": max_tokens, "max_prompt_tokens": 2048}
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(run, "episodes", "update_0000.jsonl"), "w") as f:
        f.writelines(json.dumps(runfolder.episode_record(ep)) + "\n" for ep in eps)


def engine_speed(engine, prompts, max_tokens):
    """Generated tokens per second (and prompt tokens per second) of one generate call over `prompts`."""
    engine.generate(prompts[:2], 1.0, 4)                       # warm-up
    common.reset_peak_rss()
    t = time.perf_counter()
    out = engine.generate(prompts, 1.0, max_tokens)
    sec = time.perf_counter() - t
    new = sum(len(ids) for ids, _ in out)
    return {"sec": sec, "new_tokens": new, "tok_s": new / sec, "prompt_tok_s": sum(map(len, prompts)) / sec,
            "peak_mb": common.peak_rss_mb()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, nargs="*", default=[32, 128], help="episodes in flight (one collect each; none: engine speed only)")
    ap.add_argument("--group_size", type=int, default=8, help="episodes per task (the paper's N)")
    ap.add_argument("--max_steps", type=int, default=2, help="turns per episode")
    ap.add_argument("--max_tokens", type=int, default=48, help="response tokens per turn")
    ap.add_argument("--history_length", type=int, default=5)
    ap.add_argument("--speed_prompts", type=int, default=16, help="prompts for the vLLM vs HF comparison")
    ap.add_argument("--speed_tokens", type=int, default=48, help="new tokens per prompt in that comparison")
    ap.add_argument("--skip_hf", action="store_true")
    ap.add_argument("--max_wait", type=int, default=180, help="seconds to wait for a quiet machine")
    args = ap.parse_args(argv)

    import envs
    import rollout
    rollout.chat_ids = clocked("chat_ids", rollout.chat_ids)   # prompt -> ids inside collect
    data = common.games_dir()
    path = rollout.resolve_model(rollout.EMBEDDED)
    _, tok, _ = rollout.load_model(rollout.EMBEDDED)
    load = common.wait_quiet(max_wait_s=args.max_wait)
    mem = {}
    common.reset_peak_rss()
    t = time.perf_counter()
    engine = rollout.make_engine("vllm", path, dtype="float32", seed=0, max_model_len=2048 + args.max_tokens)
    mem["vLLM engine start"] = (common.peak_rss_mb(), time.perf_counter() - t)
    n_env = max(args.episodes + [args.speed_prompts])
    env_list = [envs.make("alfworld", split="train", data_dir=data, history_length=args.history_length,
                          max_steps=args.max_steps) for _ in range(n_env)]
    shares = []
    for n in args.episodes:
        res = rollout_share(engine, tok, env_list, n, args.group_size, args.max_tokens)
        shares.append(res)
        mem[f"collect, {n} episodes"] = (res["peak_mb"], res["wall"])
        print(f"[bench] {n} episodes: wall {res['wall']:.1f} s, engine share {res['share']:.3f}", flush=True)

    # the same prompts for both engines: every train task's first prompt
    prompts = []
    for k in range(args.speed_prompts):
        e = env_list[k % len(env_list)]
        e.reset(seed=k)
        prompts.append(rollout.chat_ids(tok, e.prompt()))
    speed = {"vllm": engine_speed(engine, prompts, args.speed_tokens)}
    mem["vLLM generate (speed test)"] = (speed["vllm"]["peak_mb"], speed["vllm"]["sec"])
    if not args.skip_hf:
        common.reset_peak_rss()
        hf = rollout.make_engine("hf", path, dtype="float32", seed=0, batch_size=len(prompts))
        speed["hf"] = engine_speed(hf, prompts, args.speed_tokens)
        mem["HF generate (speed test)"] = (speed["hf"]["peak_mb"], speed["hf"]["sec"])
    report(args, load, shares, speed, mem, prompts)


def report(args, load, shares, speed, mem, prompts):
    m = common.machine()
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
          f"vllm {m['vllm']}, transformers {m['transformers']}; 1-min load at start {load}, now {m['load_1min']}")
    print(f"ALFWorld (generated games), group size {args.group_size}, {args.max_steps} turns, "
          f"{args.max_tokens} tokens per response, history {args.history_length}, float32\n")
    names = sorted({k for s in shares for k in s["parts"]}, key=lambda k: (k != "engine.generate", k))
    if shares:
        print("| episodes | wall s | engine share | " + " | ".join(f"{k} s" for k in names if k != "engine.generate")
              + " | turns | prompt tok | new tok |")
        print("|---" * (len(names) + 5) + "|")
    for s in shares:
        print(f"| {s['episodes']} | {s['wall']:.1f} | {s['share']:.3f} | "
              + " | ".join(f"{s['parts'].get(k, 0.0):.2f}" for k in names if k != "engine.generate")
              + f" | {s['turns']} | {s['prompt_tokens']} | {s['new_tokens']} |")
    print(f"\nengines on the same {len(prompts)} prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), "
          f"{args.speed_tokens} new tokens each, temperature 1.0:")
    print("| engine | seconds | new tokens | new tok/s | prompt tok/s |\n|---|---|---|---|---|")
    for k, v in speed.items():
        print(f"| {k} | {v['sec']:.1f} | {v['new_tokens']} | {v['tok_s']:.1f} | {v['prompt_tok_s']:.0f} |")
    if "hf" in speed:
        print(f"vLLM / HF tokens/s: {speed['vllm']['tok_s'] / speed['hf']['tok_s']:.2f}")
    print("\n| phase | peak RSS MiB | seconds |\n|---|---|---|")
    for k, (mb, sec) in mem.items():
        print(f"| {k} | {mb:.0f} | {sec:.1f} |")
    for s in shares:
        print(f"engine share of rollout time at {s['episodes']} episodes: {s['share']:.3f}")


if __name__ == "__main__":
    main()
