"""How does a checkpoint lose a hidden-object room? A probe for the oracle-teacher comparison (bench/RESULTS.md
section 11) on the CPU testbed's rooms (`envs.alfworld_gen --hidden`, not the method). What an oracle's skill knows
is the route: where the object lay (the walkthrough's first action, `go to <receptacle>`), then take, go, move.
On the first --tasks tasks of each held-out split (the ids seed.py evaluates), one greedy episode each (seed.py's
`eval_greedy`), counted per episode:

    won         the episode won
    first       its first move went where the object lay (a wrong guess leaves one or two of the 6 steps spare)
    premature   a `move ...` before any `take ...`: the route's end played without the object in hand
    cut         a one-word action (`go`, `take`): valid by the authors' format rule, a no-op in the game

One checkpoint per call (one vLLM engine per process); each call adds its rows to --out, which keeps the others',
and prints the table of all of them:

    for c in runs/hid-sft .cache/bench/learning/alfhid-D45/runs/grpo-s0/checkpoint; do
        python bench/route_probe.py --data_dir data/hidden --tasks 64 --checkpoint $c; done
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

COLUMNS = ("won", "first", "premature", "cut")


def route_flags(actions, plan):
    """One episode's executed actions and its walkthrough -> {column: 0 or 1} (won is the caller's)."""
    took = [i for i, a in enumerate(actions) if a.startswith("take ")]
    moved = [i for i, a in enumerate(actions) if a.startswith("move ")]
    return {"first": int(bool(actions) and actions[0] == plan[0]),
            "premature": int(bool(moved) and (not took or moved[0] < took[0])),
            "cut": int(any(len(a.split()) == 1 and a not in ("look", "inventory") for a in actions))}


def play(engine, tok, cfg, split, ids):
    """-> one dict per task: its greedy episode's actions, walkthrough and route_flags."""
    env_list = [envs.from_config(cfg, split) for _ in ids]
    eps = rollout.collect(engine, tok, env_list, ids, 1, 0.0, cfg.max_tokens, progress=False)
    out = []
    for ep in eps:
        acts, plan = [s.action for s in ep.steps], ep.info["expert_plan"]
        out.append({"task": ep.task_id, "actions": acts, "plan": plan, "won": int(ep.won)} | route_flags(acts, plan))
    return out


def probe(path, cfg, tasks):
    model, tok, resolved = rollout.load_model(path)
    del model
    engine = rollout.make_engine(cfg.engine, resolved, dtype=resolved_dtype(cfg), seed=cfg.seed,
                                 max_model_len=seed.engine_context(cfg, resolved))
    res = {split: play(engine, tok, cfg, split, list(range(min(tasks, envs.from_config(cfg, split).num_tasks))))
           for split in envs.env_class(cfg.env).eval_splits}
    engine.close()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint folder")
    ap.add_argument("--data_dir", required=True, help="the hidden-object games (envs.alfworld_gen --hidden)")
    ap.add_argument("--tasks", type=int, default=64, help="the first N tasks of each held-out split")
    ap.add_argument("--max_steps", type=int, default=6, help="the runs' --max_steps")
    ap.add_argument("--max_tokens", type=int, default=48, help="the runs' --max_tokens")
    ap.add_argument("--out", default="bench/learning_results/route_probe.json")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        sys.exit(f"{args.checkpoint} is not a checkpoint folder (no config.json)")
    if not os.path.isdir(args.data_dir):
        sys.exit(f"--data_dir {args.data_dir} is not a folder")
    cfg = seed.parse_config(["--env", "alfworld", "--data_dir", args.data_dir, "--max_steps", str(args.max_steps),
                             "--history_length", "0", "--max_tokens", str(args.max_tokens)])
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    results[args.checkpoint] = probe(args.checkpoint, cfg, args.tasks)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("| checkpoint | episodes | " + " | ".join(COLUMNS) + " |\n|---|---|" + "---|" * len(COLUMNS))
    for p, res in results.items():
        eps = [e for split in res.values() for e in split]
        print(f"| {p} | {len(eps)} | " + " | ".join(f"{np.mean([e[c] for e in eps]):.3f}" for c in COLUMNS) + " |")
    print(f"[route_probe] {args.out}")


if __name__ == "__main__":
    main()
