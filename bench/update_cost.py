"""SEED's cost over GRPO per update (Algorithm 1): seconds per phase, from seed.py's own timings
(`sec/*` in runs/<name>/metrics.jsonl), for `--algo seed` and `--algo grpo` on the same config and seed,
with the embedded model (SmolLM2-135M-Instruct) on generated ALFWorld games, and their ratio.

Each run is seed.py itself in a child process (`seed.main`), with its phase functions wrapped to also
record each phase's peak resident memory (Linux VmHWM, reset before the phase). Both runs play the same
tasks with the same sampling seed, so their first update collects the same episodes. The ratio counts the
timed updates (the first is a warm-up when --updates > 1) and excludes engine start-up and evaluation.

    .venv/bin/python bench/update_cost.py                              # base model, small config
    .venv/bin/python bench/update_cost.py --init runs/sft-alfworld --updates 2 -- --max_steps 8
Arguments after `--` go to both seed.py runs unchanged.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402

PHASES = [("collect", "rollout"), ("analyze", "analysis"), ("logprobs", "log-prob passes (old + ref)"),
          ("rescore", "log-prob pass (skill context)"), ("update", "update (fwd+bwd+AdamW)"), ("push", "weight push")]


# ----------------------------------------------------------------------------- the child: seed.py, instrumented

def child(run_dir, argv):
    """Run seed.main(argv) with per-phase peak-RSS probes; write <run_dir>/bench_memory.json."""
    import analyzer
    import rollout
    import seed
    mem = []

    def probe(name, fn):
        def wrapper(*a, **k):
            common.reset_peak_rss()
            t = time.perf_counter()
            out = fn(*a, **k)
            mem.append({"phase": name, "peak_mb": common.peak_rss_mb(), "sec": time.perf_counter() - t})
            return out
        return wrapper

    rollout.collect = probe("collect", rollout.collect)
    analyzer.analyze = probe("analyze", analyzer.analyze)
    seed.batch_logprobs = probe("logprobs", seed.batch_logprobs)
    seed.rescore_rows = probe("rescore", seed.rescore_rows)
    seed.update_policy = probe("update", seed.update_policy)
    seed.push = probe("push", seed.push)
    try:
        seed.main(argv)
    finally:
        with open(os.path.join(run_dir, "bench_memory.json"), "w") as f:
            json.dump(mem, f)


# ----------------------------------------------------------------------------- the parent

def run_algo(algo, args, extra):
    run_dir = os.path.join(common.BENCH_CACHE, "runs", f"{args.name}-{algo}")
    if os.path.exists(run_dir):
        import shutil
        shutil.rmtree(run_dir)
    argv = ["--env", "alfworld", "--data_dir", common.games_dir(), "--algo", algo, "--init", args.init,
            "--seed", str(args.seed), "--updates", str(args.updates), "--tasks_per_update", str(args.tasks),
            "--group_size", str(args.group_size), "--max_steps", str(args.max_steps),
            "--max_tokens", str(args.max_tokens), "--analyzer_max_tokens", str(args.analyzer_max_tokens),
            "--micro_batch_size", str(args.micro_batch), "--engine", args.engine, "--eval_every", "0",
            "--save_every", "1000", "--out", run_dir, *extra]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), PYTHONUNBUFFERED="1")
    print(f"[bench] seed.py {' '.join(argv)}", flush=True)
    t = time.perf_counter()
    p = subprocess.run([common.PY, os.path.abspath(__file__), "--child", run_dir, "--", *argv], cwd=common.ROOT, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t
    with open(os.path.join(run_dir, "bench_stdout.log"), "w") as f:
        f.write(p.stdout)
    if p.returncode != 0:
        sys.exit(f"seed.py --algo {algo} failed (exit {p.returncode}); last output:\n{p.stdout[-3000:]}")
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
    mem = json.load(open(os.path.join(run_dir, "bench_memory.json")))
    return {"lines": lines, "mem": mem, "wall": wall, "run_dir": run_dir}


def phase_seconds(lines, skip_first):
    """Mean seconds per phase over the timed updates (sec/* from seed.py's metrics.jsonl)."""
    timed = lines[1:] if skip_first and len(lines) > 1 else lines
    keys = [k for k, _ in PHASES] + ["total"]
    out = {k: sum(m.get(f"sec/{k}", 0.0) for m in timed) / len(timed) for k in keys}
    out["other"] = out["total"] - sum(out[k] for k, _ in PHASES)
    return out, len(timed)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1], argv[3:])
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", default="", help="Stage-1 checkpoint for both runs ('' = the base model)")
    ap.add_argument("--updates", type=int, default=1, help="updates per run (the first is skipped when > 1)")
    ap.add_argument("--tasks", type=int, default=2, help="tasks per update (B)")
    ap.add_argument("--group_size", type=int, default=4, help="episodes per task (N)")
    ap.add_argument("--max_steps", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=64, help="response tokens per turn")
    ap.add_argument("--analyzer_max_tokens", type=int, default=128)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="update_cost", help="run folders: .cache/bench/runs/<name>-<algo>")
    ap.add_argument("--seed_first", action="store_true", help="run seed before grpo (to see order effects)")
    ap.add_argument("--max_wait", type=int, default=180, help="seconds to wait for a quiet machine")
    args = ap.parse_args(argv)

    load = common.wait_quiet(max_wait_s=args.max_wait)
    res = {algo: run_algo(algo, args, extra) for algo in (("seed", "grpo") if args.seed_first else ("grpo", "seed"))}
    report(args, extra, load, res)


def report(args, extra, load, res):
    m = common.machine()
    sec = {a: phase_seconds(r["lines"], args.updates > 1) for a, r in res.items()}
    n_timed = sec["seed"][1]
    last = res["seed"]["lines"][-1]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, vllm {m['vllm']}, "
          f"transformers {m['transformers']}; 1-min load at start {load}, now {m['load_1min']}")
    print(f"config: alfworld (generated games), init {args.init or 'base model (no SFT)'}, B={args.tasks} x N={args.group_size}, "
          f"max_steps {args.max_steps}, max_tokens {args.max_tokens}, analyzer_max_tokens {args.analyzer_max_tokens}, "
          f"micro_batch {args.micro_batch}, engine {args.engine} {' '.join(extra)}; "
          f"{n_timed} timed update(s) of {args.updates}")
    for a, r in res.items():
        l = r["lines"][-1]
        skills = (f", skill rate {l.get('skill_rate', 0):.2f}, parse failures {l.get('parse_failure_rate', 0):.2f} "
                  f"({l.get('first_try_failure_rate', 0):.2f} before retries)") if a == "seed" else ""
        print(f"  {a}: rows {l.get('rows')}, tokens {l.get('tokens')}, mean length {l.get('length', 0):.2f}, "
              f"success {l.get('success', 0):.2f}{skills}")
    print("\n| phase | grpo s | seed s | seed - grpo s |\n|---|---|---|---|")
    for k, name in PHASES + [("other", "other (rows, advantages, records)"), ("total", "update total")]:
        g, s = sec["grpo"][0][k], sec["seed"][0][k]
        print(f"| {name} | {g:.1f} | {s:.1f} | {s - g:+.1f} |")
    print("\npeak RSS per phase (MiB, last update):\n| phase | grpo | seed |\n|---|---|---|")
    for k, name in PHASES:
        row = []
        for a in ("grpo", "seed"):
            seen = [x["peak_mb"] for x in res[a]["mem"] if x["phase"] == k]
            row.append(f"{seen[-1]:.0f}" if seen else "-")
        print(f"| {name} | {row[0]} | {row[1]} |")
    ratio = sec["seed"][0]["total"] / sec["grpo"][0]["total"]
    g, s = sec["grpo"][0], sec["seed"][0]
    extra = (g["total"] + s["analyze"] + s["rescore"]) / g["total"]
    print(f"\nload-robust estimate (grpo's run plus only the phases SEED adds: analysis and skill re-scoring): "
          f"{extra:.2f}")
    print(f"seed/grpo update time: {ratio:.2f}")
    return ratio, last


if __name__ == "__main__":
    main()
