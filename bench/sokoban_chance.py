"""Chance level of the CPU testbed (docs/design-notes.md, the CPU testbed): how often a policy that ignores the board wins.

For each held-out Sokoban room (the test split, tasks 0 .. N-1, the rooms bench/learning.py evaluates), every
sequence of `max_steps` moves is played through the env, so the numbers are exact, not sampled:

- uniform: a mover that picks up/down/left/right uniformly at random each turn;
- constant: one move repeated every turn, for each of the four moves.

A learned policy whose held-out success does not clear these has not learned to read the board.

    .venv/bin/python bench/sokoban_chance.py --max_steps 3 4
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from envs.sokoban import ACTIONS, SokobanEnv  # noqa: E402


def won(env, task, moves):
    env.reset(seed=task)
    for a in moves:
        _, reward, term, trunc, _ = env.step(f"<think>-</think><action>{a}</action>")
        if term or trunc:
            return reward > 0
    return False


def chance(max_steps, tasks):
    """-> (uniform success, {plan length: uniform success}, {move: success of that move repeated})."""
    env = SokobanEnv("test", max_steps=max_steps, history_length=0)
    uniform, by_plan, constant = [], {}, {a: 0 for a in ACTIONS}
    seqs = list(itertools.product(ACTIONS, repeat=max_steps))
    for t in range(tasks):
        env.reset(seed=t)
        plan = len(env.room["plan"])
        p = sum(won(env, t, s) for s in seqs) / len(seqs)
        uniform.append(p)
        by_plan.setdefault(plan, []).append(p)
        for a in ACTIONS:
            constant[a] += won(env, t, [a] * max_steps)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return mean(uniform), {k: (mean(v), len(v)) for k, v in sorted(by_plan.items())}, \
        {a: c / tasks for a, c in constant.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max_steps", type=int, nargs="+", default=[3, 4], help="step budgets (= longest plan)")
    ap.add_argument("--tasks", type=int, default=64, help="held-out rooms 0 .. tasks-1")
    args = ap.parse_args(argv)
    if min(args.max_steps) < 1 or max(args.max_steps) > 6:
        sys.exit("--max_steps must be between 1 and 6 (4^steps sequences are played per room)")
    print("| max steps | rooms by plan length | uniform random mover | by plan length | one move repeated |")
    print("|---|---|---|---|---|")
    for ms in args.max_steps:
        uni, by_plan, const = chance(ms, args.tasks)
        rooms = ", ".join(f"{k}: {n}" for k, (_, n) in by_plan.items())
        plans = ", ".join(f"{k}: {p:.3f}" for k, (p, _) in by_plan.items())
        moves = ", ".join(f"{a} {p:.3f}" for a, p in const.items())
        print(f"| {ms} | {rooms} | **{uni:.3f}** | {plans} | {moves} |", flush=True)


if __name__ == "__main__":
    main()
