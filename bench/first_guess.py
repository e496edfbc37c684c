"""Where does the agent look first? A probe of the hidden-object rooms (`envs.alfworld_gen --hidden`, the CPU
testbed, not the method) for the oracle-teacher comparison (bench/RESULTS.md section 11). What an oracle's skill
knows is where the object lay, and with 6 steps and a direct route of 4-5 (go, [open], take, go, move) a wrong
first guess leaves one or two steps to spare: the first move decides most episodes. For each checkpoint, on the first --tasks tasks of each held-out split
(the ids seed.py evaluates), --samples first moves at T=0.4 and one greedy: the share that go where the object lay
(the walkthrough's first action), the share of valid actions, and the distinct first moves per task. Beside
held-out success it splits a change of success into "learned where to look" and "lost the rest of the route".
One checkpoint per call (one vLLM engine per process); each call adds its results to --out, which keeps the
others', and prints the table of all of them:

    for c in runs/hid-sft .cache/bench/learning/alfhid-D45/runs/grpo-s0/checkpoint; do
        python bench/first_guess.py --data_dir data/hidden --tasks 64 --samples 4 --checkpoint $c; done
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
import rollout  # noqa: E402
import seed  # noqa: E402
from parallel import resolved_dtype  # noqa: E402


def first_moves(engine, tok, cfg, split, ids, samples, temperature):
    """-> one dict per task: its first actions, how many are valid and how many go where the object lay."""
    env_list = [envs.from_config(cfg, split) for _ in range(len(ids) * samples)]
    eps = rollout.collect(engine, tok, env_list, ids, samples, temperature, cfg.max_tokens, progress=False)
    out = []
    for t in ids:
        mine = [ep for ep in eps if ep.task_id == t]
        target = mine[0].info["expert_plan"][0]                   # "go to <where the object lay>"
        acts = [ep.steps[0].action for ep in mine]
        out.append({"task": t, "target": target, "actions": acts, "right": sum(a == target for a in acts),
                    "valid": sum(ep.steps[0].valid for ep in mine), "n": len(mine)})
    return out


def summary(tasks):
    n = sum(x["n"] for x in tasks)
    return {"right": sum(x["right"] for x in tasks) / n, "valid": sum(x["valid"] for x in tasks) / n,
            "distinct": float(np.mean([len(set(x["actions"])) for x in tasks]))}


def probe(path, cfg, tasks, samples):
    model, tok, resolved = rollout.load_model(path)
    del model
    engine = rollout.make_engine(cfg.engine, resolved, dtype=resolved_dtype(cfg), seed=cfg.seed,
                                 max_model_len=seed.engine_context(cfg, resolved))
    res = {}
    for split in envs.env_class(cfg.env).eval_splits:
        ids = list(range(min(tasks, envs.from_config(cfg, split).num_tasks)))
        res[split] = {"T0.4": first_moves(engine, tok, cfg, split, ids, samples, 0.4),
                      "greedy": first_moves(engine, tok, cfg, split, ids, 1, 0.0)}
    engine.close()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint folder")
    ap.add_argument("--data_dir", required=True, help="the hidden-object games (envs.alfworld_gen --hidden)")
    ap.add_argument("--tasks", type=int, default=64, help="the first N tasks of each held-out split")
    ap.add_argument("--samples", type=int, default=4, help="first moves per task at T=0.4")
    ap.add_argument("--max_tokens", type=int, default=48, help="response tokens (the runs' --max_tokens)")
    ap.add_argument("--out", default="bench/learning_results/first_guess.json")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        sys.exit(f"{args.checkpoint} is not a checkpoint folder (no config.json)")
    if not os.path.isdir(args.data_dir):
        sys.exit(f"--data_dir {args.data_dir} is not a folder")
    cfg = seed.parse_config(["--env", "alfworld", "--data_dir", args.data_dir, "--max_steps", "1",
                             "--history_length", "0", "--max_tokens", str(args.max_tokens)])
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    results[args.checkpoint] = probe(args.checkpoint, cfg, args.tasks, args.samples)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("| checkpoint | split | first move to the object, T=0.4 | greedy | valid (T=0.4) | distinct first moves per task |")
    print("|---|---|---|---|---|---|")
    for p, res in results.items():
        for split, r in res.items():
            s, g = summary(r["T0.4"]), summary(r["greedy"])
            print(f"| {p} | {split} | {s['right']:.3f} | {g['right']:.3f} | {s['valid']:.3f} | {s['distinct']:.2f} |")
    print(f"[first_guess] {args.out}")


if __name__ == "__main__":
    main()
