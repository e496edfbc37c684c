"""The CPU testbed (docs/design-notes.md#the-cpu-testbed-why-it-looks-the-way-it-does): the steps that are NOT
part of SEED and that the GPU recipes never run. The embedded 135M model writes no action at temperature 1, so:

    warm start     `sft.py --stage warmup`: behaviour cloning on the env's expert moves in its response format
                   (expert_examples, warmup)
    replay         `sft.py --replay K`: the expert's moves on K more tasks join Stage 1's pairs (stage1_extras),
                   or the model forgets the action format on analyses alone
    skill-following `--skill_tasks N`: expert demonstrations with their scripted skill in the prompt (the
                   teacher-gap testbeds), and on hidden-object ALFWorld rooms (envs/alfworld_gen.py --hidden):
                   searches (search_actions), elimination demonstrations and the failure labels that name only
                   what the episode saw (hidden_hindsight, which analyzer.scripted_analysis asks for such rooms)

Reached through sft.py (its flags and loop: draw_tasks, split_pairs, finetune); the method files hold the method.
"""
import dataclasses
import json
import os
import re
import time

import numpy as np

import analyzer
import envs
import parallel
import rollout
import runfolder
import sft
from rollout import Episode, Step

EZ_TRACK = "The formula so far is {formula}, so the next token is {action}."   # EZPoints: where the formula stands
EXPERT_THOUGHTS = {   # the one-sentence thought of a warm-start target, per env with an expert
    "alfworld": "To complete the task, my next step is to {action}.",
    "sokoban": "On the shortest way to push the box onto the target, my next move is {action}.",
    # the solution, then the formula so far, whose next token in the solution is the action (README, quick start)
    "ezpoints": "{solution} = 12. " + EZ_TRACK,
}


def expert_response(env, action=None):
    """The expert's next action (env.expert_action, or `action` where given) as a response in the env's
    format, after a short thought (EXPERT_THOUGHTS; EZPoints' states the solution and the formula so far, so
    that the action is the solution's next token): EZPoints a JSON object {"thoughts", "action"} (the authors' gym_cards format), the others
    <think>...</think><action>...</action>. None when the expert has no move here. A warm-start example with a
    skill in its prompt (--skill_tasks) has this same target: the teacher and the student write one kind of
    response, so that lp_skill - lp measures what the skill changes in it, not a change of style."""
    action = action or env.expert_action()
    if action is None:
        return None
    if env.name == "ezpoints":
        solution, formula = env.expert_formula(), " ".join(env.formula) or "empty"
        thought = EXPERT_THOUGHTS["ezpoints"].format(solution=" ".join(solution), action=action, formula=formula)
        return json.dumps({"thoughts": thought, "action": action})
    thought = EXPERT_THOUGHTS[env.name].format(action=action)
    return f"<think>{thought}</think><action>{action}</action>"


def scripted_skill(env, info, won, rng):
    """The scripted annotator's skill for the task `env` was just reset on (its expert plan in `info`), written
    as for a won episode (a workflow) or a failed one (an avoidance rule that ends with the key steps). The failed
    episode is simulated (1 to max_steps steps, each invalid with probability 1/3, else a random admissible
    action), so that the rule's problems vary as those of the policy's own failures do."""
    steps = []
    for _ in range(0 if won else int(rng.integers(1, env.max_steps + 1))):
        valid = bool(rng.random() > 1 / 3)
        action = str(rng.choice(info["admissible"])) if valid else ""
        steps.append(Step("", [], [], "", [], "", action, valid))
    ep = Episode(task_id=0, group_id=0, env=env.name, task=env.task, family=env.family, steps=steps, won=won,
                 info={**info, "hidden": False})   # a demonstration walks the route its skill names, failure or not
    return analyzer.scripted_analysis(ep, env.max_steps)["episode_skill"]


def search_actions(env, route, rng, skip=()):
    """A hidden-object room's plain demonstration (envs/alfworld_gen.py --hidden; the CPU testbed): a searcher
    who does not know where the object is goes to the room's receptacles in a seeded random order (the goal's
    and those in `skip` excluded), opening the closed ones, until the object is in reach; then the stored direct
    `route` from its take on. A generator: each next() reads the env as the previous action left it."""
    take = next(i for i, a in enumerate(route) if a.startswith("take "))
    goal = route[take + 1].removeprefix("go to ") if take + 1 < len(route) else None
    spots = [a.removeprefix("go to ") for a in env.admissible if a.startswith("go to ")]
    for where in rng.permutation([w for w in spots if w != goal and w not in skip]):
        yield f"go to {where}"
        if f"open {where}" in env.admissible:
            yield f"open {where}"
        if route[take] in env.admissible:
            break
    yield from route[take:]


def elimination_demo(env, route, rng):
    """A hidden-object room's skill demonstration in the failure form (the CPU testbed): the skill names 1 or
    more places that do not hold the object, as not_found_rule words a failure that saw them empty, and
    the target searches only the others (search_actions). -> (skill, route generator)"""
    obj, where, goal = hidden_target(route)
    empty = [a.removeprefix("go to ") for a in env.admissible
             if a.startswith("go to ") and a.removeprefix("go to ") not in (where, goal)]
    seen = [str(w) for w in rng.permutation(empty)[:int(rng.integers(1, len(empty) + 1))]]
    return not_found_rule(obj, seen), search_actions(env, route, rng, skip=seen)


def expert_examples(cfg, tok, tasks, split="train", skills=False):
    """The env's expert plays each task; every step gives one pair (the actor prompt's chat ids, exactly as
    rollout.collect builds them -> the expert's move in the env's response format (expert_response)
    + end of turn). The target is what the env receives, so each step is valid by construction (a test
    replays them). `skills` (--skill_tasks; the CPU testbed, not the method): True puts each task's scripted
    skill (scripted_skill, workflow or avoidance form by a seeded coin) in the actor prompt, with the same
    target; in ALFWorld that target follows the route the skill names (the stored walkthrough: in a hidden-object
    room the direct one). A hidden-object room's plain target searches at random (search_actions), and half its
    skill demonstrations, by the coin, are in the failure form that names only empty places (elimination_demo).
    -> one list of pairs per task ([] where the expert did not win)."""
    env, out = envs.from_config(cfg, split), []
    coin = np.random.default_rng([cfg.seed, 3])
    for t in tasks:
        _, info = env.reset(seed=int(t))
        plan, hidden = list(info.get("expert_plan") or []), info.get("hidden")
        skill = scripted_skill(env, info, bool(coin.integers(2)), coin) if skills else None
        route = (iter(plan) if skills and env.name == "alfworld" else
                 search_actions(env, plan, coin) if hidden else iter(()))
        if skills and hidden and coin.integers(2):
            skill, route = elimination_demo(env, plan, coin)
        pairs, won, done = [], False, False
        while not done and (target := expert_response(env, next(route, None))) is not None:
            _, ids, _ = rollout._prompt(env, tok, skill, cfg.max_prompt_tokens)
            pairs.append((ids, tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
            _, _, terminated, truncated, info = env.step(target)
            won, done = bool(info.get("won")), terminated or truncated
        out.append(pairs if won else [])
    return out


def ids_have_skill(tok, ids):
    return envs.EPISODE_SKILL[0] in tok.decode(ids)


def warmup(cfg, rank, world, device):
    """Behaviour cloning on expert episodes (docs/design-notes.md, the CPU testbed): a model too small to write the action
    format learns it before Stage 1. Tasks are split (seeded) into training and held-out ones
    (--val_fraction); the held-out loss is reported after every epoch. Same loss and loop as Stage 1
    (finetune: completion-only token-mean NLL). Writes an HF checkpoint, sft_log.jsonl and warmup.json."""
    t0 = time.time()
    tok = sft._tokenizer(cfg.model)
    tasks = sft.draw_tasks(envs.from_config(cfg, "train"), cfg.tasks, np.random.default_rng(cfg.seed))
    per_task = expert_examples(cfg, tok, tasks)
    if cfg.skill_tasks:   # N more tasks (a seeded draw of their own) taught with their skill in the prompt
        more = sft.draw_tasks(envs.from_config(cfg, "train"), cfg.skill_tasks, np.random.default_rng([cfg.seed, 2]))
        per_task += expert_examples(cfg, tok, more, skills=True)
    train, val = sft.split_pairs(per_task, cfg.val_fraction, np.random.default_rng([cfg.seed, 1]))   # by task
    train, val = [x for t in train for x in t], [x for t in val for x in t]
    if not train:
        runfolder.fail(f"the expert won none of the {len(tasks)} training tasks within --max_steps {cfg.max_steps}")
    if rank == 0:
        print(f"[warmup] expert won {sum(bool(t) for t in per_task)}/{len(per_task)} tasks: {len(train)} training "
              f"and {len(val)} held-out steps", flush=True)
    model, tok, log, val_log = sft.finetune(cfg, train, val, rank, world, device)
    if runfolder.save_model(model, tok, cfg.out, rank):
        with open(os.path.join(cfg.out, "sft_log.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
        summary = {"config": dataclasses.asdict(cfg), "world_size": world, "tasks": len(per_task),
                   "expert_won": sum(bool(t) for t in per_task), "train_steps": len(train), "val_steps": len(val),
                   "skill_steps": sum(ids_have_skill(tok, x[0]) for x in train + val),
                   "train_loss": [log[0]["loss"], log[-1]["loss"]], "val_loss": val_log, "sec/total": time.time() - t0}
        with open(os.path.join(cfg.out, "warmup.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"[warmup] saved {cfg.out} (loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}, held-out "
              f"{val_log[-1] if val_log else float('nan'):.3f}; {summary['sec/total']:.0f} s)", flush=True)
    parallel.teardown_dist()


def stage1_extras(cfg, tok, probe, rank):
    """The testbed's pairs that join Stage 1's training pairs: --replay expert tasks (the action format) and
    --skill_tasks expert tasks with their skill in the prompt (skill-following), each a seeded draw of its own."""
    out = []
    if cfg.replay:   # the testbed's tiny model forgets the action format on analyses alone (README)
        more = sft.draw_tasks(probe, cfg.replay, np.random.default_rng([cfg.seed, 2]))
        replay = [x for t in expert_examples(cfg, tok, more) for x in t]
        out += replay
        if rank == 0:
            print(f"[sft] replay: {len(replay)} expert steps of {cfg.replay} tasks join the training pairs", flush=True)
    if cfg.skill_tasks:   # keeps skill-following alive through Stage 1 (the CPU testbed, not the method)
        more = sft.draw_tasks(probe, cfg.skill_tasks, np.random.default_rng([cfg.seed, 5]))
        taught = [x for t in expert_examples(cfg, tok, more, skills=True) for x in t]
        out += taught
        if rank == 0:
            print(f"[sft] skill replay: {len(taught)} expert steps of {cfg.skill_tasks} tasks with their skill "
                  f"in the prompt join the training pairs", flush=True)
    return out


# ----------------------------------------------------------------------------- hidden-object rooms: what a failure saw

def hidden_hindsight(episode, plan):
    """A failure in a hidden-object room (envs/alfworld_gen.py --hidden) names only what its own observations
    showed: the places whose contents it saw without the object (the goal's left out: no search goes there);
    None where one showed the object (or the plan takes nothing), and the route may be named. The expert's
    route would name a place the episode never saw, and an analyzer taught that guesses one."""
    if not any(a.startswith("take ") for a in plan):
        return None
    (obj, _, goal), empty = hidden_target(plan), []
    for s in episode.steps:
        m = re.match(r"You (?:arrive at|open the) ([a-z]+ \d+)\.", s.observation or "")
        if m and "you see" in s.observation:
            if re.search(rf"\b{re.escape(obj)}\b", s.observation.split("you see", 1)[1]):
                return None
            empty += [m.group(1)] if m.group(1) not in empty + [goal] else []
    return not_found_rule(obj, empty)


def hidden_target(plan):
    """A hidden-object room's direct route -> (object, where it lies, goal receptacle): ("book 1", "drawer 1",
    "desk 1") from "take book 1 from drawer 1" and the final "move book 1 to desk 1"."""
    obj, where = next(a for a in plan if a.startswith("take ")).removeprefix("take ").split(" from ")
    return obj, where, plan[-1].split(" to ", 1)[-1]


def not_found_rule(obj, empty):
    """The hidden-object failure rule for object `obj` ("book 1") and the places seen without it."""
    name = obj.rsplit(" ", 1)[0]
    return (f"The {name} was not in {', '.join(empty)}: look in the other places first." if empty else
            f"The {name} was not found: look in each place once, opening the closed ones.")
