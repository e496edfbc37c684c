"""SEED's cost over GRPO per update (Algorithm 1; Section 3.3's analysis and skill re-scoring are what SEED
adds): seconds per phase from seed.py's own timings (`sec/*` in metrics.jsonl) for `--algo seed` and
`--algo grpo`, with the embedded model (SmolLM2-135M-Instruct) on generated ALFWorld games, and their ratio.

A shared machine is noisy (a busier minute made one run's phases 2-4x slower than the other's on the same
work), so one pair of runs proves nothing. The two algorithms alternate instead, repeat after repeat in
ABBA order (grpo seed | seed grpo | grpo seed ...). Every child run is seed.py itself (`seed.main` in a
child process), one update from the same Stage-1 checkpoint with the same seed and tasks, so every run
collects the same episodes and trains on the same rows: every repeat measures identical work. Reported:
each phase's median over the repeats with its min-max, and three ratios of the medians:
    shared-phase check   seed / grpo on the phases both run on the same rows (rollout, log-prob passes,
                         update, weight push): 1 on a quiet machine
    like for like        (grpo's update + seed's analysis + seed's re-scoring) / grpo's update
    measured             seed's update / grpo's update
When a shared phase (one of at least a tenth of grpo's update) or their sum differs by more than 15 %,
the machine's noise is larger than what is measured: the run is noise-dominated and no ratio is headlined.

The checkpoint (`--init auto`): the bench's own ALFWorld Stage 1 (.cache/bench/demo-sft: sft.py with the
flags of the former ALFWorld demo, DEMO_SFT_FLAGS, and the scripted annotator, built once, a few minutes;
./run.sh's demo is now the EZPoints testbed). From the base model (`--init ''`) no analysis parses, so
SEED's re-scoring never runs and the ratio measures nothing of SEED.

Each child also records each phase's peak resident memory (Linux VmHWM, reset before the phase) into
<run>/bench_memory.json (bench/memory.py --validate reads it). Engine start-up is not in the update time.

    .venv/bin/python bench/update_cost.py            # 3 repeats of the ALFWorld config: 11 min on 2 idle cores
    .venv/bin/python bench/update_cost.py --repeats 5 --max_steps 8 -- --lr 1e-5
Arguments after `--` go to every seed.py run unchanged.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402

PHASES = [("collect", "rollout"), ("analyze", "analysis"), ("logprobs", "log-prob passes (old + ref)"),
          ("rescore", "log-prob pass (skill context)"), ("update", "update (fwd+bwd+AdamW)"), ("push", "weight push")]
SHARED = ("collect", "logprobs", "update", "push")   # the same work in both runs (same rows)
ADDED = ("analyze", "rescore")                        # SEED's own phases
NOISE_LIMIT = 0.15    # shared phases may differ by this share before a run is noise-dominated
MIN_SHARE = 0.10      # ... counting each shared phase that is at least this share of grpo's update
BENCH_SFT = os.path.join(common.BENCH_CACHE, "demo-sft")       # the ALFWorld Stage 1, built here when missing
DEMO_SFT_FLAGS = ["--tasks", "4", "--k0", "2", "--max_steps", "4", "--history_length", "1", "--max_tokens", "64",
                  "--analyzer_max_tokens", "192", "--epochs", "2", "--lr", "2e-4", "--batch_size", "2",
                  "--micro_batch_size", "1"]                   # the former ALFWorld demo's sft.py flags


# ----------------------------------------------------------------------------- the child: seed.py, instrumented

def child(run_dir, argv):
    """Run seed.main(argv) with per-phase peak-RSS probes; write <run_dir>/bench_memory.json."""
    import analyzer
    import grpo
    import opd
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
    grpo.batch_logprobs = probe("logprobs", grpo.batch_logprobs)
    opd.rescore_rows = probe("rescore", opd.rescore_rows)
    seed.update_policy = probe("update", seed.update_policy)
    rollout.push = probe("push", rollout.push)
    try:
        seed.main(argv)
    finally:
        with open(os.path.join(run_dir, "bench_memory.json"), "w") as f:
            json.dump(mem, f)


# ----------------------------------------------------------------------------- the parent

def stage1_checkpoint(init):
    """--init -> (checkpoint path or '', how it was chosen). 'auto': the bench's ALFWorld Stage 1, built now
    when missing (sft.py, DEMO_SFT_FLAGS, the scripted annotator)."""
    if init != "auto":
        if init and not os.path.isfile(os.path.join(init, "config.json")):
            sys.exit(f"--init {init} is not a checkpoint folder (no config.json); run sft.py (or ./run.sh) first, "
                     f"or pass --init auto")
        return init, ("given with --init" if init else
                      "the base model, no SFT: no analysis parses, so SEED's re-scoring never runs")
    how = "the bench's ALFWorld Stage 1"
    if os.path.isfile(os.path.join(BENCH_SFT, "stage1.json")):
        return BENCH_SFT, how
    print(f"[bench] no Stage-1 checkpoint in {BENCH_SFT}: building it with the former demo's Stage-1 flags "
          f"(a few minutes, once)", flush=True)
    os.makedirs(common.BENCH_CACHE, exist_ok=True)
    sec = common.run_py(["sft.py", "--env", "alfworld", "--model", "smollm2-135m", "--out", BENCH_SFT,
                         "--data_dir", common.games_dir(), *DEMO_SFT_FLAGS], BENCH_SFT + ".log")
    return BENCH_SFT, f"{how}, built now in {sec:.0f} s"


def seed_argv(algo, args, init, run_dir, extra):
    return ["--env", "alfworld", "--data_dir", common.games_dir(), "--algo", algo, "--init", init,
            "--seed", str(args.seed), "--updates", str(args.updates), "--tasks_per_update", str(args.tasks),
            "--group_size", str(args.group_size), "--max_steps", str(args.max_steps),
            "--history_length", str(args.history_length), "--max_tokens", str(args.max_tokens),
            "--analyzer_max_tokens", str(args.analyzer_max_tokens), "--micro_batch_size", str(args.micro_batch),
            "--engine", args.engine, "--eval_every", "0", "--save_every", "1000", "--out", run_dir, *extra]


def run_algo(algo, repeat, args, init, extra):
    """One child seed.py run -> its phase seconds, metric lines, memory probes, wall time and starting load."""
    run_dir = os.path.join(common.BENCH_CACHE, "runs", f"{args.name}-{algo}-r{repeat}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    load = round(os.getloadavg()[0], 2)
    argv = seed_argv(algo, args, init, run_dir, extra)
    wall = common.run_py([os.path.relpath(__file__, common.ROOT), "--child", run_dir, "--", *argv],
                         os.path.join(run_dir, "bench_stdout.log"))
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
    sec, _ = phase_seconds(lines, args.updates > 1)
    mem = json.load(open(os.path.join(run_dir, "bench_memory.json")))
    return {"sec": sec, "lines": lines, "mem": mem, "wall": wall, "load": load, "argv": argv}


def phase_seconds(lines, skip_first):
    """Mean seconds per phase over the timed updates (sec/* from seed.py's metrics.jsonl). -> (dict, count)."""
    timed = lines[1:] if skip_first and len(lines) > 1 else lines
    keys = [k for k, _ in PHASES] + ["total"]
    out = {k: sum(m.get(f"sec/{k}", 0.0) for m in timed) / len(timed) for k in keys}
    out["other"] = out["total"] - sum(out[k] for k, _ in PHASES)
    return out, len(timed)


def order(repeats):
    """ABBA: grpo seed | seed grpo | grpo seed ... (a drift of the machine's speed falls on both alike)."""
    return [("grpo", "seed") if r % 2 == 0 else ("seed", "grpo") for r in range(repeats)]


# ----------------------------------------------------------------------------- the numbers (pure functions)

def summarize(reps):
    """[{phase: s}] over repeats -> {phase: (median, min, max)}."""
    return {k: (statistics.median(r[k] for r in reps), min(r[k] for r in reps), max(r[k] for r in reps))
            for k in reps[0]}


def ratios(g, s):
    """grpo's and seed's {phase: s} (medians, or one repeat's) -> the shared-phase check (seed / grpo per
    shared phase and summed), the like-for-like and measured ratios, and the shared phases off by > 15 %."""
    shared = {k: s[k] / g[k] if g[k] else float("nan") for k in SHARED}
    shared_sum = sum(s[k] for k in SHARED) / sum(g[k] for k in SHARED)
    off = [k for k in SHARED if g[k] >= MIN_SHARE * g["total"] and abs(shared[k] - 1) > NOISE_LIMIT]
    if abs(shared_sum - 1) > NOISE_LIMIT:
        off.append("all shared")
    return {"shared": shared, "shared_sum": shared_sum, "off": off, "noisy": bool(off),
            "like_for_like": (g["total"] + sum(s[k] for k in ADDED)) / g["total"], "measured": s["total"] / g["total"]}


def headline(r):
    """The last line: the ratios, or why there is none."""
    if r["noisy"]:
        offs = ", ".join(f"{k} {r['shared'][k] if k in r['shared'] else r['shared_sum']:.2f}" for k in r["off"])
        return (f"seed/grpo update time: none, the run is noise-dominated (shared phases seed/grpo on the same rows: "
                f"{offs}; limit 1 +- {NOISE_LIMIT:.2f}); rerun on a quiet machine or with more --repeats")
    return f"seed/grpo update time: {r['like_for_like']:.2f} like for like, {r['measured']:.2f} measured"


# ----------------------------------------------------------------------------- main and the report

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1], argv[3:])
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", default="auto", help="Stage-1 checkpoint ('auto' = the bench's ALFWorld Stage 1, "
                                                   "built when missing; '' = the base model)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating (grpo, seed) pairs; medians over them")
    ap.add_argument("--updates", type=int, default=1, help="updates per run (the first is not timed when > 1)")
    ap.add_argument("--tasks", type=int, default=2, help="tasks per update (B)")
    ap.add_argument("--group_size", type=int, default=2, help="episodes per task (N)")
    ap.add_argument("--max_steps", type=int, default=4)
    ap.add_argument("--history_length", type=int, default=1)
    ap.add_argument("--max_tokens", type=int, default=64, help="response tokens per turn")
    ap.add_argument("--analyzer_max_tokens", type=int, default=192, help="new tokens per analysis")
    ap.add_argument("--micro_batch", type=int, default=2)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="update_cost", help="run folders: .cache/bench/runs/<name>-<algo>-r<repeat>")
    ap.add_argument("--max_wait", type=int, default=180, help="seconds to wait for a quiet machine")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        sys.exit(f"--repeats must be 1 or more, got {args.repeats}")

    t0 = time.perf_counter()
    init, how = stage1_checkpoint(args.init)
    load = common.wait_quiet(max_wait_s=args.max_wait)
    t1 = time.perf_counter()
    res = {"grpo": [], "seed": []}
    for r, pair in enumerate(order(args.repeats)):
        for algo in pair:
            res[algo].append(run_algo(algo, r, args, init, extra))
    report(args, extra, init, how, load, res, time.perf_counter() - t1, time.perf_counter() - t0)


def report(args, extra, init, how, load, res, wall_runs, wall_all):
    m = common.machine()
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, vllm {m['vllm']}, "
          f"transformers {m['transformers']}; 1-min load at start {load}, now {m['load_1min']}")
    print(f"checkpoint: {init or 'base model'} ({how})")
    print(f"config: alfworld (generated games), B={args.tasks} x N={args.group_size}, max_steps {args.max_steps}, "
          f"history {args.history_length}, max_tokens {args.max_tokens}, analyzer_max_tokens "
          f"{args.analyzer_max_tokens}, micro_batch {args.micro_batch}, engine {args.engine}{''.join(' ' + x for x in extra)}; "
          f"{args.updates} update(s) per run, {args.repeats} repeat(s) in ABBA order: "
          + " | ".join(" ".join(p) for p in order(args.repeats)))
    print(f"wall: {wall_all:.0f} s in all, {wall_runs:.0f} s for the {2 * args.repeats} runs "
          f"(engine start-up included; update time only in the tables)")
    work = {(x["lines"][-1].get("rows"), x["lines"][-1].get("tokens")) for a in res for x in res[a]}
    print(f"same rows in every run: {'yes' if len(work) == 1 else 'NO'} (rows, response tokens: "
          f"{', '.join(f'{w[0]}, {w[1]}' for w in sorted(work, key=str))})")
    for x in res["seed"]:
        l = x["lines"][-1]
        print(f"  seed run: skill rate {l.get('skill_rate', 0):.2f}, parse failures {l.get('parse_failure_rate', 0):.2f}")
    return conclusions(*tables(args, res))


def tables(args, res):
    """Per-phase medians (min-max), per-repeat ratios, peak RSS. -> (grpo summary, seed summary, per-repeat ratios)."""
    g = summarize([x["sec"] for x in res["grpo"]])
    s = summarize([x["sec"] for x in res["seed"]])
    print(f"\n| phase | grpo s, median (min-max) | seed s, median (min-max) | seed / grpo |\n|---|---|---|---|")
    for k, name in PHASES + [("other", "other (rows, advantages, records)"), ("total", "update total")]:
        ratio = f"{s[k][0] / g[k][0]:.2f}" if k not in ADDED and g[k][0] > 0 else "-"
        print(f"| {name} | {g[k][0]:.1f} ({g[k][1]:.1f}-{g[k][2]:.1f}) | {s[k][0]:.1f} ({s[k][1]:.1f}-{s[k][2]:.1f}) "
              f"| {ratio} |")
    print("\n| repeat | order | load at start (grpo, seed) | grpo total s | seed total s | shared seed/grpo "
          "| like for like | measured |\n|---|---|---|---|---|---|---|---|")
    per = []
    for r, pair in enumerate(order(args.repeats)):
        gr, sr = res["grpo"][r], res["seed"][r]
        per.append(ratios(gr["sec"], sr["sec"]))
        print(f"| {r} | {' '.join(pair)} | {gr['load']}, {sr['load']} | {gr['sec']['total']:.1f} | "
              f"{sr['sec']['total']:.1f} | {per[-1]['shared_sum']:.2f} | {per[-1]['like_for_like']:.2f} | "
              f"{per[-1]['measured']:.2f} |")
    print("\npeak RSS per phase (MiB, last repeat):\n| phase | grpo | seed |\n|---|---|---|")
    for k, name in PHASES:
        row = []
        for a in ("grpo", "seed"):
            seen = [x["peak_mb"] for x in res[a][-1]["mem"] if x["phase"] == k]
            row.append(f"{seen[-1]:.0f}" if seen else "-")
        print(f"| {name} | {row[0]} | {row[1]} |")
    return g, s, per


def conclusions(g, s, per):
    """The shared-phase check, the like-for-like and measured ratios of the medians, the verdict, the headline."""
    r = ratios({k: v[0] for k, v in g.items()}, {k: v[0] for k, v in s.items()})
    span = lambda key: f"repeats {min(p[key] for p in per):.2f}-{max(p[key] for p in per):.2f}"  # noqa: E731
    print(f"\nshared-phase check (seed / grpo on the same rows, medians; limit 1 +- {NOISE_LIMIT:.2f}): "
          + ", ".join(f"{name} {r['shared'][k]:.2f}" for k, name in PHASES if k in SHARED)
          + f"; all shared {r['shared_sum']:.2f} ({span('shared_sum')})")
    print(f"like for like ((grpo's update + seed's analysis + seed's re-scoring) / grpo's update): "
          f"{r['like_for_like']:.2f} ({span('like_for_like')})")
    print(f"measured (seed's update / grpo's update): {r['measured']:.2f} ({span('measured')})")
    if s["rescore"][0] == 0:
        print("note: seed's re-scoring did not run (no analysis parsed): the ratio measures nothing of SEED's "
              "re-scoring; start from a Stage-1 checkpoint (--init auto)")
    print(f"verdict: NOISE-DOMINATED (shared phases on the same rows differ by more than {NOISE_LIMIT:.0%})" if r["noisy"]
          else f"verdict: the shared phases agree within {NOISE_LIMIT:.0%} on the same rows: the ratios hold")
    print(headline(r))
    return r


if __name__ == "__main__":
    main()
