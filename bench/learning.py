"""The CPU testbed (README): does the embedded agent learn, and does SEED beat GRPO from the same Stage-1 checkpoint (Table 2's "w/o OPD"),
GRPO from the warm start (Table 1's GRPO: no Stage 1, `grpo@warm`) and the paper's
"w/o on-policy skills" ablation (`static_skills`, Section 4.1 / B.2) on the same budget?

    warm start   sft.py --stage warmup           behaviour cloning on the env's solver (built once, cached)
    Stage 1      sft.py --model <warm start>     hindsight-skill SFT, scripted annotator (built once, cached)
    Stage 2      seed.py --algo A --seed s --init <Stage 1>   for every algo A and seed s

Every Stage-2 run gets the same flags (learning rate, sizes, updates: no per-algo tuning), the same seed
hence the same task draws, and the same held-out tasks, evaluated every --eval_every updates at temperature 0.4 with no skill, and greedily; the
starting checkpoint, the same for every run, is evaluated once (the first algo's first seed). Each run is an ordinary seed.py run
folder (.cache/bench/learning/<config>/runs/<algo>-s<seed>): a finished one is skipped, a killed or
stopped one continues from its last checkpoint (--resume), so the benchmark can be stopped and restarted
at any time. A run's metrics.jsonl is also kept beside the results (bench/learning_results/<config>/runs/),
so the table survives the cache, and a later sitting on a machine without it adds seeds (--first_seed)
under another --name. It ends with bench/learning_results/<config>/curves.png (held-out success vs update: mean
over seeds with a min-max band per algo; invalid-action rate; episode length) and table.md.

    .venv/bin/python bench/learning.py --env sokoban                  # the default config (hours on 2 cores)
    .venv/bin/python bench/learning.py --env sokoban --report_only    # table and plot from the runs so far
Arguments after `--` go to every seed.py run unchanged.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
from bench import common  # noqa: E402

RESULTS = os.path.join(common.ROOT, "bench", "learning_results")
# the envs with an expert for the warm start (testbed.EXPERT_THOUGHTS), and the held-out splits seed.py evaluates
EVAL_SPLITS = {e: envs.env_class(e).eval_splits for e in ("alfworld", "sokoban", "ezpoints")}


def parse_args(argv):
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="sokoban", choices=sorted(EVAL_SPLITS))
    ap.add_argument("--algos", default="seed,grpo,static_skills",
                    help="comma-separated arms: <seed.py --algo>[@warm][+flag=value...], from the Stage-1 checkpoint or "
                         "with @warm from the warm start (grpo@warm: Table 1's GRPO, no Stage 1), with flags of its own "
                         "(seed+lambda_opd=0.1)")
    ap.add_argument("--reference", default="seed", help="the arm every other is paired against in the table")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per algo: first_seed .. first_seed + seeds - 1")
    ap.add_argument("--first_seed", type=int, default=0, help="the first seed (its first algo evaluates the start)")
    ap.add_argument("--updates", type=int, default=12, help="Stage-2 updates per run")
    ap.add_argument("--tasks_per_update", type=int, default=4)
    ap.add_argument("--group_size", type=int, default=4)
    ap.add_argument("--max_steps", type=int, default=4,
                    help="steps per episode; Sokoban rooms need at most this many moves (bench/RESULTS.md, History: why 4)")
    ap.add_argument("--history_length", type=int, default=0, help="past steps in the prompt (Sokoban is Markov)")
    ap.add_argument("--max_tokens", type=int, default=48, help="response tokens per turn")
    ap.add_argument("--analyzer_max_tokens", type=int, default=256, help="SEED's analysis tokens")
    ap.add_argument("--lr", type=float, default=2e-5, help="Stage-2 learning rate, every algo")
    ap.add_argument("--kl_coef", type=float, default=0.0, help="0 skips the reference pass (CPU time)")
    ap.add_argument("--eval_every", type=int, default=4)
    ap.add_argument("--eval_tasks", type=int, default=64, help="held-out tasks per split")
    ap.add_argument("--warmup", default="", help="warm-start checkpoint ('' = build it in the cache)")
    ap.add_argument("--stage1", default="", help="Stage-1 checkpoint ('' = build it from the warm start)")
    ap.add_argument("--warmup_tasks", type=int, default=53, help="solver episodes of the warm start (10%% held out)")
    ap.add_argument("--warmup_lr", type=float, default=2e-4)
    ap.add_argument("--warmup_skill_tasks", type=int, default=0,
                    help="more warm-start tasks taught with their scripted skill in the prompt (sft.py --skill_tasks; "
                         "the teacher-gap testbed, not the method)")
    ap.add_argument("--stage1_tasks", type=int, default=16, help="Stage-1 tasks (M), K0 = --stage1_k0")
    ap.add_argument("--stage1_k0", type=int, default=2)
    ap.add_argument("--stage1_lr", type=float, default=2e-4)
    ap.add_argument("--stage1_replay", type=int, default=16, help="expert tasks replayed in Stage 1 (sft.py --replay)")
    ap.add_argument("--stage1_skill_tasks", type=int, default=0,
                    help="expert tasks with their scripted skill in the prompt joining Stage 1 (sft.py --skill_tasks; "
                         "the teacher-gap testbed, not the method)")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--data_dir", default="", help="ALFWorld games ('' = a small generated set in the cache; "
                                                   "the hidden-object testbed: README)")
    ap.add_argument("--name", default="", help="config name ('' = from the env and sizes)")
    ap.add_argument("--report_only", action="store_true", help="only write the table and plot")
    args = ap.parse_args(argv)
    args.algos = [a for a in args.algos.split(",") if a]
    args.name = args.name or (f"{args.env}-B{args.tasks_per_update}xN{args.group_size}-steps{args.max_steps}-h{args.history_length}"
                              f"-u{args.updates}-lr{args.lr:g}")
    return args, extra


# ----------------------------------------------------------------------------- building and running

def checkpoints(args, cache, warm, stage1):
    """Build the warm start `warm` and the Stage-1 checkpoint `stage1` every run starts from, once, unless
    given (--warmup / --stage1) or already in the cache."""
    common_env = ["--env", args.env, "--max_steps", str(args.max_steps), "--history_length", str(args.history_length),
                  "--max_tokens", str(args.max_tokens), "--engine", args.engine]
    if args.env == "alfworld":
        common_env += ["--data_dir", args.data_dir or common.games_dir()]
    for path in (args.warmup, args.stage1):
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            sys.exit(f"{path} is not a checkpoint folder (no config.json)")
    if not args.stage1 and not os.path.isfile(os.path.join(stage1, "stage1.json")):
        if not args.warmup and not os.path.isfile(os.path.join(warm, "warmup.json")):
            common.run_py(["sft.py", "--stage", "warmup", *common_env, "--out", warm, "--tasks", str(args.warmup_tasks),
                           "--val_fraction", "0.1", "--epochs", "1", "--lr", str(args.warmup_lr), "--batch_size", "8",
                           "--micro_batch_size", "4", "--skill_tasks", str(args.warmup_skill_tasks)],
                          os.path.join(cache, "warmup.log"), "learning")
        common.run_py(["sft.py", *common_env, "--model", warm, "--out", stage1, "--tasks", str(args.stage1_tasks),
                       "--k0", str(args.stage1_k0), "--epochs", "2", "--lr", str(args.stage1_lr), "--batch_size", "8",
                       "--replay", str(args.stage1_replay), "--skill_tasks", str(args.stage1_skill_tasks),
                       "--micro_batch_size", "2", "--analyzer_max_tokens", str(args.analyzer_max_tokens)],
                      os.path.join(cache, "stage1.log"), "learning")


def seed_argv(args, stage1, extra):
    """The seed.py flags every run shares (everything but --algo, --seed and --out)."""
    argv = ["--env", args.env, "--init", stage1, "--updates", str(args.updates),
            "--tasks_per_update", str(args.tasks_per_update), "--group_size", str(args.group_size),
            "--max_steps", str(args.max_steps), "--history_length", str(args.history_length),
            "--max_tokens", str(args.max_tokens), "--analyzer_max_tokens", str(args.analyzer_max_tokens),
            "--lr", str(args.lr), "--kl_coef", str(args.kl_coef), "--eval_every", str(args.eval_every),
            "--eval_tasks", str(args.eval_tasks), "--eval_greedy", "--save_every", "1",
            "--engine", args.engine]
    if args.env == "alfworld":
        argv += ["--data_dir", args.data_dir or common.games_dir()]
    return argv + extra


def arm_argv(arm, warm, stage1):
    """An arm of --algos -> the seed.py flags it adds to the shared ones (a later flag wins): its --algo, its start
    (--init: the Stage-1 checkpoint, or the warm start for <algo>@warm) and its own +flag=value pairs."""
    head, *flags = arm.split("+")
    algo, _, start = head.partition("@")
    if start not in ("", "warm") or not all("=" in f for f in flags):
        sys.exit(f"bad arm {arm!r}: <algo>[@warm][+flag=value...]")
    return ["--algo", algo, "--init", warm if start else stage1] + [x for f in flags for x in ("--" + f.split("=")[0],
                                                                                                f.split("=", 1)[1])]


def label(arm):
    """The table's name of an arm: the paper's row where it is one (GRPO from Stage 1 is Table 2's w/o OPD)."""
    return {"grpo": "w/o OPD (grpo from Stage 1)", "grpo@warm": "GRPO (Table 1: from the warm start)"}.get(arm, arm)


def seeds(args):
    return range(args.first_seed, args.first_seed + args.seeds)


def kept(args, algo, s):
    """The copy of a run's metrics.jsonl beside the results, which outlives the cache."""
    return os.path.join(RESULTS, args.name, "runs", f"{algo}-s{s}.jsonl")


def finished(lines, updates):
    return any(m["update"] == updates - 1 for m in lines)


def read(path):
    return [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []


def run_folder(cache, algo, s):
    return os.path.join(cache, "runs", f"{algo}-s{s}")


def lines_of(args, cache, algo, s):
    """A run's metrics lines: from its run folder, or from the kept copy where the folder is gone."""
    return read(os.path.join(run_folder(cache, algo, s), "metrics.jsonl")) or read(kept(args, algo, s))


def run_all(args, cache, shared, warm, stage1):
    starts = {}   # the first arm of each start evaluates it before update 0 (first seed): the others share it
    for algo in args.algos:
        starts.setdefault(arm_argv(algo, warm, stage1)[3], algo)
    for s in seeds(args):                # seed-major: every algo has the same number of seeds done so far
        for algo in args.algos:
            run_dir = run_folder(cache, algo, s)
            if finished(lines_of(args, cache, algo, s), args.updates):
                print(f"[learning] {algo} seed {s}: done, skipped", flush=True)
                continue
            os.makedirs(run_dir, exist_ok=True)
            # every run starts from the same checkpoint: its evaluation before update 0 is made once (first run)
            mine = arm_argv(algo, warm, stage1)
            first = ["--eval_first"] if s == args.first_seed and starts[mine[3]] == algo else []
            wall = common.run_py(["seed.py", *shared, *mine, "--seed", str(s), "--out", run_dir, "--resume", *first],
                                 os.path.join(run_dir, "bench_stdout.log"), "learning")
            print(f"[learning] {algo} seed {s}: {wall:.0f} s", flush=True)
            metrics, copy = os.path.join(run_dir, "metrics.jsonl"), kept(args, algo, s)
            if os.path.exists(metrics):
                os.makedirs(os.path.dirname(copy), exist_ok=True)
                shutil.copyfile(metrics, copy)


# ----------------------------------------------------------------------------- results

def curves(lines, splits, prefix="eval", what="success"):
    """-> {updates done: held-out `what` (mean over the splits)}; the line of update u is after u + 1
    updates, the --eval_first line (update -1) is at 0."""
    keys = [f"{prefix}/{s}/{what}" for s in splits]
    return {m["update"] + 1: float(np.mean([m[k] for k in keys])) for m in lines
            if all(m.get(k) is not None for k in keys)}


def auc(curve):
    """Area under the held-out success curve over the updates, divided by their span (a mean success)."""
    x = sorted(curve)
    if len(x) < 2:
        return float("nan")
    y = [curve[k] for k in x]
    return float(np.sum(np.diff(x) * (np.array(y[1:]) + np.array(y[:-1])) / 2) / (x[-1] - x[0]))


def collect(args, cache):
    """-> {algo: [per seed: dict(lines, eval, greedy)]} for the runs with any metrics."""
    splits = EVAL_SPLITS[args.env]
    out = {}
    for algo in args.algos:
        for s in seeds(args):
            lines = lines_of(args, cache, algo, s)
            if lines:
                train = [m for m in lines if m["update"] >= 0]
                out.setdefault(algo, []).append(dict(seed=s, lines=train, eval=curves(lines, splits),
                                                     greedy=curves(lines, splits, "eval_greedy"),
                                                     invalid=curves(lines, splits, what="invalid_rate")))
    return out


def mean_of(lines, key):
    """Mean of metrics.jsonl's `key` over the lines that hold a number for it (nan where none does: diag/gate_*
    only where a teacher is scored)."""
    xs = [m[key] for m in lines if isinstance(m.get(key), (int, float)) and not np.isnan(m[key])]
    return float(np.mean(xs)) if xs else float("nan")


def pm(xs):
    xs = [x for x in xs if x is not None and not np.isnan(x)]
    if not xs:
        return "-"
    return f"{np.mean(xs):.3f} ± {np.std(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


# Student's t 0.975 quantile by degrees of freedom (index; 0 unused), then the normal 1.96 past 30
T975 = [float("nan"), 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042, 1.960]


def ci95(xs):
    """'mean ± SE [95% interval]' of paired differences (one per seed): SE = sample std / sqrt(n), the interval
    Student's t with n - 1 degrees of freedom; '-' without two values."""
    xs = [x for x in xs if x is not None and not np.isnan(x)]
    if len(xs) < 2:
        return "-"
    m, se = float(np.mean(xs)), float(np.std(xs, ddof=1) / np.sqrt(len(xs)))
    h = T975[min(len(xs) - 1, len(T975) - 1)] * se
    return f"{m:+.3f} ± {se:.3f} [{m - h:+.3f}, {m + h:+.3f}]"


def table(args, res, cmd):
    """table.md: per algo, held-out success at the start and the end (mean ± std over seeds), area under the
    curve, train episode length and invalid rate, the diag/* means (tied groups, gate std, gate-advantage
    covariance), seconds per update; then (--reference) - other at matched updates, each arm named by label()."""
    # "the end" is the last evaluation every run has reached (all of them once the benchmark is done)
    end = min((max(r["eval"]) for runs in res.values() for r in runs if r["eval"]), default=0)
    upto = lambda c: {x: y for x, y in c.items() if x <= end}
    first = lambda c: c.get(0)      # the start, where the run evaluated it
    last = lambda c: upto(c)[end] if end in c else None
    area = lambda c: auc(upto(c))
    out = [f"# Learning on the CPU testbed: {args.name}", "",
           f"Command: `{cmd}`", "",
           f"{args.env}; B={args.tasks_per_update} tasks x N={args.group_size} episodes per update, max "
           f"{args.max_steps} steps, history {args.history_length}, {args.max_tokens} response tokens, lr {args.lr:g}, "
           f"KL {args.kl_coef:g}; held-out: {args.eval_tasks} tasks per split of {', '.join(EVAL_SPLITS[args.env])}, "
           f"every {args.eval_every} updates; mean ± std over seeds (population std).", "",
           f"| algo | seeds | updates done | held-out success at 0 (T=0.4) | at {end} (T=0.4) | greedy at 0 | "
           f"greedy at {end} | AUC 0-{end} (T=0.4) | train success | train episode length | train invalid rate | "
           "tied groups | gate std, response tokens | gate-advantage cov | s / update (no eval) |", "|" + "---|" * 15]
    for algo, runs in res.items():
        done = [len(r["lines"]) for r in runs]
        sec = [np.mean([m["sec/total"] - m.get("sec/eval", 0.0) for m in r["lines"]]) for r in runs]
        per = lambda key: [mean_of(r["lines"], key) for r in runs]
        out.append(f"| {label(algo)} | {len(runs)} | {min(done)}-{max(done)} | {pm([first(r['eval']) for r in runs])} | "
                   f"{pm([last(r['eval']) for r in runs])} | {pm([first(r['greedy']) for r in runs])} | "
                   f"{pm([last(r['greedy']) for r in runs])} | {pm([area(r['eval']) for r in runs])} | "
                   f"{pm(per('success'))} | {pm(per('length'))} | {pm(per('invalid_rate'))} | "
                   f"{pm(per('diag/tied_groups'))} | {pm(per('diag/gate_std_response'))} | {pm(per('diag/gate_adv_cov'))} | "
                   f"{pm(sec)} |")
    ids = sorted({r["seed"] for runs in res.values() for r in runs})
    out += ["", f"Held-out success (T=0.4) at {end} by seed:", "", "| algo | " + " | ".join(f"s{i}" for i in ids) + " |",
            "|---|" + "---|" * len(ids)]
    for algo, runs in res.items():
        at = {r["seed"]: last(r["eval"]) for r in runs}
        out.append(f"| {algo} | " + " | ".join("-" if at.get(i) is None else f"{at[i]:.3f}" for i in ids) + " |")
    ref = args.reference
    if ref in res and len(res) > 1:
        out += ["", f"{label(ref)} minus each other arm on held-out success (T=0.4), paired by seed (same task draws and "
                f"held-out tasks), at matched updates; mean ± SE [95% interval] over the seeds both have (a seed's "
                f"difference averages {args.eval_tasks} tasks x {len(EVAL_SPLITS[args.env])} split(s) x 1 sample; "
                "SE = sample std / sqrt(seeds), the interval Student's t):", ""]
        others = [a for a in res if a != ref]
        xs = sorted(set().union(*[r["eval"] for r in res[ref]]))
        out += ["| updates done | " + " | ".join(f"{label(ref)} - ({label(a)})" for a in others) + " |",
                "|---|" + "---|" * len(others)]
        for x in [x for x in xs if x <= end] + ["AUC"]:
            cells = []
            for a in others:
                pairs = [(r, o) for r in res[ref] for o in res[a] if r["seed"] == o["seed"]]
                if x == "AUC":
                    d = [area(r["eval"]) - area(o["eval"]) for r, o in pairs]
                else:
                    d = [r["eval"][x] - o["eval"][x] for r, o in pairs if x in r["eval"] and x in o["eval"]]
                cells.append(ci95(d))
            out.append(f"| {x if x != 'AUC' else f'AUC 0-{end}'} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def band(ax, runs, key_fn, color, label, style="-", fill=True):
    """Mean over seeds with a min-max band, at the x values every run has."""
    curves_ = [key_fn(r) for r in runs]
    xs = sorted(set.intersection(*[set(c) for c in curves_])) if curves_ else []
    if not xs:
        return
    ys = np.array([[c[x] for x in xs] for c in curves_])                       # [seeds, points]
    ax.plot(xs, ys.mean(0), style, color=color, label=label, marker="o", ms=3)
    if fill and len(curves_) > 1:
        ax.fill_between(xs, ys.min(0), ys.max(0), color=color, alpha=0.2)


def plot(args, res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    per_update = lambda key: (lambda r: {m["update"] + 1: m[key] for m in r["lines"] if m.get(key) is not None})
    for i, (algo, runs) in enumerate(res.items()):
        c = f"C{i}"
        band(ax[0], runs, lambda r: r["eval"], c, f"{algo} (T=0.4, {len(runs)} seeds)")
        band(ax[0], runs, lambda r: r["greedy"], c, f"{algo} (greedy)", style="--", fill=False)
        band(ax[1], runs, per_update("invalid_rate"), c, f"{algo} (train rollouts)")
        band(ax[1], runs, lambda r: r["invalid"], c, f"{algo} (held-out, T=0.4)", style=":", fill=False)
        band(ax[2], runs, per_update("length"), c, f"{algo} (train rollouts)")
    ax[0].set(title="held-out success (mean, min-max over seeds)", xlabel="updates done", ylim=(-0.02, 1.02))
    ax[1].set(title="invalid-action rate (per step)", xlabel="updates done", ylim=(-0.02, 1.02))
    ax[2].set(title="episode length (steps)", xlabel="updates done")
    for a in ax:
        a.legend(fontsize=7)
    fig.suptitle(f"CPU testbed: {args.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(args, cache, cmd):
    res = collect(args, cache)
    out = os.path.join(RESULTS, args.name)
    os.makedirs(out, exist_ok=True)
    if not res:
        print(f"[learning] no runs with metrics under {cache} yet", flush=True)
        return None
    md = table(args, res, cmd)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(md)
    plot(args, res, os.path.join(out, "curves.png"))
    print(md + f"\n[learning] wrote {out}/table.md and curves.png", flush=True)
    return res


def cadence_free(argv):
    """seed.py's flags less --eval_every: the evaluation cadence may change between sittings (a run evaluates after
    its last update whatever the cadence), every other flag must match the cached runs'."""
    i = argv.index("--eval_every")
    return argv[:i] + argv[i + 2:]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse_args(argv)
    cache = os.path.join(common.BENCH_CACHE, "learning", args.name)
    os.makedirs(cache, exist_ok=True)
    cmd = "bench/learning.py " + " ".join(argv)
    if not args.report_only:
        warm, stage1 = args.warmup or os.path.join(cache, "warmup"), args.stage1 or os.path.join(cache, "stage1")
        shared = seed_argv(args, stage1, extra)
        built = {k: getattr(args, k) for k in ("warmup_tasks", "warmup_lr", "stage1_tasks", "stage1_k0", "stage1_lr",
                                               "stage1_replay")}   # the config name does not hold these
        for k in ("warmup_skill_tasks", "stage1_skill_tasks"):   # (keys only where set: older caches still match)
            if getattr(args, k):
                built[k] = getattr(args, k)
        saved = os.path.join(cache, "bench_config.json")
        old = json.load(open(saved)) if os.path.exists(saved) else {}
        if old and (cadence_free(old["seed_argv"]) != cadence_free(shared) or old.get("checkpoint_flags", built) != built):
            sys.exit(f"{cache} holds runs made with other flags ({saved}); pass another --name")
        checkpoints(args, cache, warm, stage1)
        with open(saved, "w") as f:
            json.dump({"seed_argv": shared, "checkpoint_flags": built, "warmup": warm, "stage1": stage1,
                       "machine": common.machine()}, f, indent=2)
        run_all(args, cache, shared, warm, stage1)
    return report(args, cache, cmd)


if __name__ == "__main__":
    main()
