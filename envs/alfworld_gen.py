"""Offline ALFWorld game generator (the ALFWorld setting of Section 4.1 without the download).

Writes new games in the official layout, `<out>/json_2.1.1/<split>/<task>-<Obj>-None-<Recep>-<scene>/<trial>/`
with `initial_state.pddl`, `traj_data.json` and `game.tw-pddl`, for the six task families. A game is
built the way the package's `alfworld-generate` builds one: the package's `alfred.pddl` domain, its
`alfred.twl2` grammar with the task sentence filled in from `traj_data.json` (`add_task_to_grammar`,
ALFRED's goal templates), and a PDDL problem; `solvable` and the expert's `walkthrough` are stored in
the game file as that script does.

Rooms come from the 120 ALFRED floor plans that ship with the package (`alfworld/gen/layouts`: the
receptacles of each plan with their navigation points, and the object classes of each plan). Each game
samples a plan, a target (object, receptacle or lamp) allowed for the family (ALFRED's GOALS_VALID
room types, VAL_RECEPTACLE_OBJECTS, VAL_ACTION_OBJECTS), and scatters the target and 6-12 distractor
classes over receptacles that may hold them. `train` and `valid_seen` use ALFRED's training floor
plans; `valid_unseen` uses its held-out plans, and its (family, object, receptacle) combinations never
occur in `train`. Every game is played by the package's hand-coded expert through the same engine as
`envs.alfworld.AlfWorldEnv`; a game the expert cannot win within `--max_expert_steps` is redrawn.

    python -m envs.alfworld_gen --out data/alfworld --train 60 --valid_seen 12 --valid_unseen 12 --seed 0

`--hidden` makes small hidden-object rooms (the CPU teacher-gap testbed, README; not ALFWorld's own games):
`--families` only, at most `--receptacles` receptacles, one target instance, `--distractors` other object
classes. The target is out of sight until the agent goes to its receptacle, which is its class's usual one
(a fixed hash ranks the receptacle classes per object class) USUAL of the time, so that what a hindsight skill
reveals ("the book was in drawer 2") is partly a prior that carries to other rooms. The stored `walkthrough` is
the direct route there (go, open, take, go, move), checked by playing it through the engine, so that the
scripted annotator's hindsight skill names where the object was; the game file says `"hidden": true`, and a warm
start's plain demonstrations there search at random (testbed.search_actions) instead of cloning the hand-coded
expert, whose searches by its priors are no policy a prompt without history can follow.

    python -m envs.alfworld_gen --out data/hidden --hidden --families pick --receptacles 5 --distractors 0-2 \
        --train 256 --valid_seen 128 --valid_unseen 0
"""
import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import time
from dataclasses import dataclass

from tqdm import tqdm

from envs import alfworld as aw

ORDER = ["pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
         "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"]
APPLIANCE = {"pick_clean_then_place_in_recep": "SinkBasin", "pick_heat_then_place_in_recep": "Microwave",
             "pick_cool_then_place_in_recep": "Fridge"}   # where the family's state change happens
ABILITY = {"pick_clean_then_place_in_recep": "Cleanable", "pick_heat_then_place_in_recep": "Heatable",
           "pick_cool_then_place_in_recep": "Coolable"}
LAMPS = ("DeskLamp", "FloorLamp")
LAMP_STANDS = ("Desk", "SideTable", "Dresser", "Shelf", "TVStand", "CoffeeTable", "DiningTable")
MAX_RECEPTACLES = 20     # the real kitchen game of ../shared/data has 20
HIDDEN_SPOTS = 3         # --hidden: receptacles the target could be in (its goal excluded), at least
USUAL = 0.8              # --hidden: chance that the target lies in its usual receptacle class (where the room has one)


# ----------------------------------------------------------------------------- package data

def package():
    """ALFRED constants, goal library, the domain/grammar files and the floor-plan folder."""
    import alfworld
    import alfworld.gen.constants as C
    import alfworld.gen.goal_library as G
    root = os.path.dirname(alfworld.__file__)
    return C, G, os.path.join(root, "data"), os.path.join(root, "gen", "layouts")


def room_type(scene):
    C = package()[0]
    return next(name for name, numbers in C.SCENE_TYPE.items() if scene in numbers)


def load_room(scene):
    """One ALFRED floor plan: receptacles (class, id, navigation point) and the object classes in it."""
    C, _, _, layouts = package()
    with open(os.path.join(layouts, f"FloorPlan{scene}-objects.json")) as f:
        classes = set(json.load(f))
    with open(os.path.join(layouts, f"FloorPlan{scene}-openable.json")) as f:
        points = json.load(f)
    static = set(C.VAL_RECEPTACLE_OBJECTS) - set(C.MOVABLE_RECEPTACLES)
    receptacles = []
    for rid, (x, z, rot, hor) in sorted(points.items()):
        last = rid.split("|")[-1]
        cls = last if last.isalpha() else rid.split("|")[0]
        if cls in static:
            receptacles.append((cls, rid, (round(x / 0.25), round(z / 0.25), int(rot) // 90 % 4, int(hor))))
    present = {r[0] for r in receptacles}
    missing = sorted(c for c in classes & static if c not in present)   # e.g. StoveBurner, Toaster, Toilet
    return {"scene": scene, "type": room_type(scene), "receptacles": receptacles, "missing": missing,
            "objects": sorted(classes & pickupable()), "lamps": sorted(classes & set(LAMPS))}


def pickupable():
    C = package()[0]
    return {o for objs in C.VAL_RECEPTACLE_OBJECTS.values() for o in objs
            if not o.endswith("Sliced") and o in C.OBJECTS}


def mangle(name):
    """ALFRED's id escaping for PDDL ('Cabinet|+01.66|...' -> 'Cabinet_bar__plus_01_dot_66_bar_...')."""
    for a, b in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(a, b)
    return name


# ----------------------------------------------------------------------------- sampling a game

def candidates(room, task_type):
    """(target object, receptacle-or-lamp) pairs this room allows for the family."""
    C = package()[0]
    if room["type"] not in C.GOALS_VALID[task_type]:
        return []
    recep_classes = {r[0] for r in room["receptacles"]} | set(room["missing"])
    if task_type == "look_at_obj_in_light":
        lamps = [lamp for lamp in LAMPS if lamp in room["lamps"]]
        stands = recep_classes & set(LAMP_STANDS)
        return [(o, lamp) for o in room["objects"] for lamp in lamps if stands]
    objs = room["objects"]
    if task_type in ABILITY:
        if APPLIANCE[task_type] not in recep_classes:
            return []
        objs = [o for o in objs if o in C.VAL_ACTION_OBJECTS[ABILITY[task_type]]]
    pairs = [(o, r) for o in objs for r in sorted(recep_classes)
             if o in C.VAL_RECEPTACLE_OBJECTS[r] and r != APPLIANCE.get(task_type)]
    # the target must be able to start somewhere other than its goal receptacle
    return [(o, r) for o, r in pairs if any(o in C.VAL_RECEPTACLE_OBJECTS[q] for q in recep_classes if q != r)]


def build_receptacles(room, rng, keep, cap=MAX_RECEPTACLES):
    """Receptacle instances (class, id, location): the plan's own, plus the classes it lists without a
    navigation point; thinned at random to `cap`, never dropping a class in `keep`."""
    recs = list(room["receptacles"])
    for cls in room["missing"]:
        for _ in range(rng.randint(2, 4) if cls == "StoveBurner" else 1):
            x, y, z = rng.uniform(-3, 3), rng.uniform(0, 2), rng.uniform(-3, 3)
            rid = f"{cls}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}"
            if cls.endswith("Basin"):
                rid = f"{cls[:-5]}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}|{cls}"
            recs.append((cls, rid, (rng.randint(-12, 12), rng.randint(-12, 12), rng.randint(0, 3), 30)))
    rng.shuffle(recs)
    chosen, count = [], collections.Counter()
    for r in sorted(recs, key=lambda r: r[0] not in keep):   # one of each kept class first
        if (r[0] in keep and count[r[0]] == 0) or len(chosen) < cap:
            chosen.append(r)
            count[r[0]] += 1
    used, out = set(), []
    for cls, rid, loc in sorted(chosen, key=lambda r: r[1]):
        while loc in used:                                     # one receptacle per navigation point
            loc = (loc[0], loc[1], loc[2], loc[3] + 15)
        used.add(loc)
        out.append((cls, rid, "loc|%d|%d|%d|%d" % loc))
    start = (99, 99, 0, 30)
    return out, "loc|%d|%d|%d|%d" % start


def place(cls, receptacles, rng, avoid=()):
    C = package()[0]
    spots = [r for r in receptacles if cls in C.VAL_RECEPTACLE_OBJECTS[r[0]] and r[0] not in avoid]
    return rng.choice(spots) if spots else None


def usual_rank(cls, place_cls):
    """How usual a place receptacle class `place_cls` is for object class `cls` (lower: more usual): a fixed
    hash, so an object has the same preferences in every room and split: the prior a hindsight skill reveals."""
    return hashlib.sha256(f"{cls}/{place_cls}".encode()).hexdigest()


def place_usual(cls, receptacles, rng, avoid=()):
    """--hidden: in an instance of the most usual class (usual_rank) among the room's fitting receptacles, USUAL
    of the time; else in any other fitting one."""
    C = package()[0]
    spots = [r for r in receptacles if cls in C.VAL_RECEPTACLE_OBJECTS[r[0]] and r[0] not in avoid]
    if not spots:
        return None
    best = min({r[0] for r in spots}, key=lambda q: usual_rank(cls, q))
    usual, rest = [r for r in spots if r[0] == best], [r for r in spots if r[0] != best]
    return rng.choice(usual if not rest or rng.random() < USUAL else rest)


@dataclass(frozen=True)
class Shape:
    """What a game looks like (the defaults: ALFWorld's own mix)."""
    families: tuple = tuple(ORDER)       # ALFRED task types, drawn in turn by game index
    receptacles: int = MAX_RECEPTACLES   # at most this many receptacle instances
    distractors: tuple = (6, 12)         # other object classes in the room (1-2 instances each)
    hidden: bool = False                 # one target instance; walkthrough = the direct route (module docstring)


def sample_spec(task_type, rooms, rng, banned=frozenset(), shape=Shape()):
    """Draw room, target and object placement for one game; None when this draw does not work out."""
    C = package()[0]
    options = [(room, pair) for room in rooms for pair in candidates(room, task_type)
               if (task_type, *pair) not in banned]
    if not options:
        return None
    room, (target, other) = rng.choice(options)
    look = task_type == "look_at_obj_in_light"
    keep = set(LAMP_STANDS) if look else {other}
    keep |= {APPLIANCE[task_type]} if task_type in APPLIANCE else set()
    receptacles, start = build_receptacles(room, rng, keep, shape.receptacles)
    objects = []                                                # (class, receptacle) pairs
    n_target = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 3)
    if shape.hidden:
        n_target = 2 if task_type == "pick_two_obj_and_place" else 1
    for _ in range(n_target):
        objects.append((target, (place_usual if shape.hidden else place)(target, receptacles, rng,
                                                                          avoid=() if look else (other,))))
    others = [o for o in room["objects"] if o != target]
    for cls in rng.sample(others, min(len(others), rng.randint(*shape.distractors))):
        for _ in range(rng.randint(1, 2)):
            objects.append((cls, place(cls, receptacles, rng)))
    if look:
        stands = [r for r in receptacles if r[0] in LAMP_STANDS]
        if not stands:
            return None
        objects.append((other, rng.choice(stands)))
    objects = [(cls, r) for cls, r in objects if r is not None]
    if sum(cls == target for cls, _ in objects) < (2 if task_type == "pick_two_obj_and_place" else 1):
        return None
    spots = {r[1] for r in receptacles if target in C.VAL_RECEPTACLE_OBJECTS[r[0]] and r[0] != other}
    if shape.hidden and len(spots) < HIDDEN_SPOTS:      # the target's place must be a real guess
        return None
    taken = set()
    objects = [(cls, object_id(cls, r, rng, taken), r) for cls, r in objects]
    return {"task_type": task_type, "scene": room["scene"], "target": target, "other": other,
            "receptacles": receptacles, "start": start, "objects": objects}


def object_id(cls, receptacle, rng, taken):
    """An ALFRED-style instance id ('Apple|+01.59|+00.97|-01.29') near its receptacle, unique in `taken`."""
    x, y, z = (float(v) for v in receptacle[1].split("|")[1:4])
    while True:
        oid = f"{cls}|{x + rng.uniform(-.4, .4):+06.2f}|{y + rng.uniform(0, .3):+06.2f}|{z + rng.uniform(-.4, .4):+06.2f}"
        if oid not in taken:
            taken.add(oid)
            return oid


# ----------------------------------------------------------------------------- writing a game

def problem_text(spec, name):
    """The PDDL problem in the layout of ALFWorld's initial_state.pddl files."""
    C, G, _, _ = package()
    predicate = {"Cleanable": "cleanable", "Heatable": "heatable", "Coolable": "coolable", "Sliceable": "sliceable"}
    look = spec["task_type"] == "look_at_obj_in_light"
    receptacle_types = sorted(set(C.VAL_RECEPTACLE_OBJECTS) - set(C.MOVABLE_RECEPTACLES))
    object_types = sorted(set(C.OBJECTS) - set(receptacle_types))
    objs, facts = [], []
    for cls, oid, (rcls, rid, loc) in spec["objects"]:
        o = mangle(oid)
        objs.append(o)
        facts += [f"(objectType {o} {cls}Type)", f"(inReceptacle {o} {mangle(rid)})",
                  f"(objectAtLocation {o} {mangle(loc)})"]
        if look and cls == spec["other"]:
            facts.append(f"(toggleable {o})")
            continue
        facts.append(f"(pickupable {o})")
        if cls in C.MOVABLE_RECEPTACLES:
            facts.append(f"(isReceptacleObject {o})")
        facts += [f"({pred} {o})" for ab, pred in predicate.items() if cls in C.VAL_ACTION_OBJECTS[ab]]
    for rcls, rid, loc in spec["receptacles"]:
        facts += [f"(receptacleType {mangle(rid)} {rcls}Type)", f"(receptacleAtLocation {mangle(rid)} {mangle(loc)})"]
        if rcls in C.OPENABLE_CLASS_LIST:
            facts.append(f"(openable {mangle(rid)})")
    present_objects = sorted({obj[0] for obj in spec["objects"]})
    for rcls in sorted({r[0] for r in spec["receptacles"]}):
        facts += [f"(canContain {rcls}Type {cls}Type)" for cls in present_objects if cls in C.VAL_RECEPTACLE_OBJECTS[rcls]]
    locations = sorted({r[2] for r in spec["receptacles"]} | {spec["start"]})
    goal = G.gdict[spec["task_type"]]["pddl"].format(
        obj=spec["target"], recep=spec["other"], toggle=spec["other"], mrecep="").replace("#", "-")
    declare = (["agent1 - agent"] + [f"{t}Type - otype" for t in object_types]
               + [f"{t}Type - rtype" for t in receptacle_types] + [f"{o} - object" for o in objs]
               + [f"{mangle(r[1])} - receptacle" for r in spec["receptacles"]]
               + [f"{mangle(loc)} - location" for loc in locations])
    init = [f"(atLocation agent1 {mangle(spec['start'])})"] + facts
    return (f"\n(define (problem plan_{name})\n(:domain alfred)\n(:objects\n        " + "\n        ".join(declare)
            + "\n        )\n\n\n(:init\n\n\n        " + "\n        ".join(init) + "\n        )\n" + goal)


def traj_data(spec, trial, seed, split):
    return {"task_id": trial, "task_type": spec["task_type"],
            "pddl_params": {"object_target": spec["target"], "object_sliced": False, "mrecep_target": "",
                            "parent_target": "" if spec["task_type"] == "look_at_obj_in_light" else spec["other"],
                            "toggle_target": spec["other"] if spec["task_type"] == "look_at_obj_in_light" else ""},
            "scene": {"floor_plan": f"FloorPlan{spec['scene']}", "scene_num": spec["scene"], "random_seed": seed},
            "turk_annotations": {"anns": []},
            "generator": {"program": "envs.alfworld_gen", "seed": seed, "split": split}}


def write_game(out, split, spec, trial, seed):
    """Write the three files; return the game.tw-pddl path (not yet checked by the expert)."""
    from alfworld.agents.utils.misc import add_task_to_grammar
    _, _, data_dir, _ = package()
    folder = os.path.join(out, "json_2.1.1", split,
                          f"{spec['task_type']}-{spec['target']}-None-{spec['other']}-{spec['scene']}", trial)
    os.makedirs(folder, exist_ok=True)
    traj = traj_data(spec, trial, seed, split)
    problem = problem_text(spec, trial)
    with open(os.path.join(data_dir, "alfred.pddl")) as f:
        domain = f.read()
    with open(os.path.join(data_dir, "alfred.twl2")) as f:
        grammar = f.read()
    state = random.getstate()
    random.seed(seed)                       # add_task_to_grammar picks ALFRED's template with `random`
    grammar = add_task_to_grammar(grammar, traj)
    random.setstate(state)
    with open(os.path.join(folder, "initial_state.pddl"), "w") as f:
        f.write(problem)
    with open(os.path.join(folder, "traj_data.json"), "w") as f:
        json.dump(traj, f, indent=1)
    path = os.path.join(folder, "game.tw-pddl")
    with open(path, "w") as f:
        json.dump({"pddl_domain": domain, "grammar": grammar, "pddl_problem": problem,
                   "solvable": None, "walkthrough": None}, f)
    return path


# ----------------------------------------------------------------------------- one game, verified

def direct_route(plan):
    """The expert's plan without its search: for each `take X from R`, only `go to R` (and `open R` where the
    plan had to open it) before it; after the last take, the plan's steps but its `close`s. A plan without a
    take is kept."""
    takes = [i for i, a in enumerate(plan) if a.startswith("take ")]
    if not takes:
        return list(plan)
    out = []
    for i in takes:
        where = plan[i].split(" from ", 1)[1]
        out += [f"go to {where}"] + ([f"open {where}"] if f"open {where}" in plan[:i] else []) + [plan[i]]
    return out + [a for a in plan[takes[-1] + 1:] if not a.startswith("close ")]


def wins(engine, path, plan):
    """Does `plan` win the game from its start (every command admissible when sent)?"""
    state = aw.engine_reset(engine, path)
    for k, command in enumerate(plan):
        if command not in state["admissible_commands"]:
            return False
        state, _ = aw.engine_step(engine, command, k + 1)
    return bool(state["won"])


_ENGINE = None
_ROOMS = None


def all_rooms():
    global _ROOMS
    if _ROOMS is None:
        C = package()[0]
        _ROOMS = {scene: load_room(scene) for scene in sorted(C.TRAIN_SCENE_NUMBERS + C.TEST_SCENE_NUMBERS)}
    return _ROOMS


def make_game(job):
    """Draw, write and verify game `index` of a split; retry new draws until the expert wins."""
    global _ENGINE
    out, split, index, seed, banned, max_expert_steps, attempts, shape = job
    C = package()[0]
    scenes = C.TEST_SCENE_NUMBERS if split == "valid_unseen" else C.TRAIN_SCENE_NUMBERS
    rooms = [all_rooms()[s] for s in scenes]
    task_type = shape.families[index % len(shape.families)]
    _ENGINE = _ENGINE or aw.make_engine()
    for attempt in range(attempts):
        rng = random.Random(f"{seed}/{split}/{index}/{attempt}")
        spec = sample_spec(task_type, rooms, rng, banned, shape)
        if spec is None:
            continue
        trial = f"trial_S{seed}_{index:05d}"
        path = write_game(out, split, spec, trial, seed=rng.getrandbits(31))
        plan = aw.play_expert(path, max_steps=max_expert_steps, engine=_ENGINE)
        searched = len(plan) if plan else 0
        if plan and shape.hidden and wins(_ENGINE, path, direct_route(plan)):
            plan = direct_route(plan)
        elif shape.hidden:
            plan = None                         # a hidden room keeps only games whose direct route wins
        aw.clear_caches()                       # the file is rewritten below or deleted
        if plan is None:
            shutil.rmtree(os.path.dirname(path))
            try:
                os.rmdir(os.path.dirname(os.path.dirname(path)))     # the task folder, if now empty
            except OSError:
                pass
            continue
        with open(path) as f:
            game = json.load(f)
        with open(path, "w") as f:
            json.dump({**game, "solvable": True, "walkthrough": plan, "hidden": shape.hidden}, f)
        return {"path": path, "split": split, "family": aw.FAMILIES[task_type], "scene": spec["scene"],
                "combo": (task_type, spec["target"], spec["other"]), "expert_steps": searched,
                "plan_steps": len(plan), "attempts": attempt + 1}
    return {"path": None, "split": split, "family": aw.FAMILIES[task_type], "attempts": attempts}


# ----------------------------------------------------------------------------- command line

def generate(out, counts, seed=0, max_expert_steps=30, workers=None, attempts=40, progress=True, shape=Shape()):
    """Generate every split (train first: valid_unseen must avoid its combinations). Returns records."""
    workers = workers or min(os.cpu_count() or 1, 8)
    pool = mp.get_context("fork").Pool(workers) if workers > 1 else None
    records, train_combos = [], frozenset()
    bar = tqdm(total=sum(counts.values()), desc="alfworld games", unit="game", disable=None if progress else True)   # no bar in a log file
    try:
        for split in aw.SPLITS:
            banned = train_combos if split == "valid_unseen" else frozenset()
            jobs = [(out, split, i, seed, banned, max_expert_steps, attempts, shape) for i in range(counts.get(split, 0))]
            results = pool.imap(make_game, jobs) if pool else map(make_game, jobs)
            for r in results:
                records.append(r)
                bar.update(1)
                bar.set_postfix(split=split, failed=sum(x["path"] is None for x in records), refresh=False)
            if split == "train":
                train_combos = frozenset(r["combo"] for r in records if r["path"])
    finally:
        bar.close()
        if pool:
            pool.close()
            pool.join()
    return records


def summary(records):
    table = collections.Counter((r["split"], r["family"]) for r in records if r["path"])
    lines = ["split         " + " ".join(f"{f:>6}" for f in aw.FAMILIES.values()) + "  total"]
    for split in aw.SPLITS:
        row = [table[(split, f)] for f in aw.FAMILIES.values()]
        lines.append(f"{split:13s} " + " ".join(f"{n:6d}" for n in row) + f"  {sum(row):5d}")
    steps = [r["expert_steps"] for r in records if r["path"]]
    direct = [r["plan_steps"] for r in records if r["path"]]
    if steps:
        lines.append(f"expert steps: mean {sum(steps) / len(steps):.1f}, max {max(steps)}; "
                     f"draws per game: {sum(r['attempts'] for r in records) / len(records):.2f}")
    if direct != steps:
        lines.append(f"stored walkthrough (the direct route): mean {sum(direct) / len(direct):.1f} steps, max {max(direct)}")
    failed = [r for r in records if not r["path"]]
    if failed:
        lines.append(f"{len(failed)} game(s) could not be made: " + ", ".join(f"{r['split']}/{r['family']}" for r in failed))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=aw.REPO_DATA, help="data folder (json_2.1.1/ is created inside)")
    p.add_argument("--train", type=int, default=60, help="games in train")
    p.add_argument("--valid_seen", type=int, default=12, help="games in valid_seen (training floor plans)")
    p.add_argument("--valid_unseen", type=int, default=12, help="games in valid_unseen (held-out plans and combinations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_expert_steps", type=int, default=30, help="keep games the expert wins within this many steps")
    p.add_argument("--workers", type=int, default=None, help="processes (default: number of cores, at most 8)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing json_2.1.1/ in --out")
    p.add_argument("--hidden", action="store_true", help="small hidden-object rooms (module docstring; the CPU testbed)")
    p.add_argument("--families", default=",".join(aw.FAMILIES.values()), help="task families, comma-separated")
    p.add_argument("--receptacles", type=int, default=MAX_RECEPTACLES, help="receptacle instances per room, at most")
    p.add_argument("--distractors", default="6-12", help="other object classes per room, LO-HI")
    args = p.parse_args(argv)
    if min(args.train, args.valid_seen, args.valid_unseen) < 0 or args.max_expert_steps < 1:
        p.error("counts must be >= 0 and --max_expert_steps >= 1")
    label = {f: t for t, f in aw.FAMILIES.items()}
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if not families or any(f not in label for f in families):
        p.error(f"--families: choose from {', '.join(label)}, got {args.families!r}")
    try:
        lo, hi = (int(x) for x in args.distractors.split("-"))
        assert 0 <= lo <= hi
    except (ValueError, AssertionError):
        p.error(f"--distractors must be LO-HI with 0 <= LO <= HI, got {args.distractors!r}")
    if args.receptacles < HIDDEN_SPOTS + 1:
        p.error(f"--receptacles must be at least {HIDDEN_SPOTS + 1}, got {args.receptacles}")
    shape = Shape(tuple(label[f] for f in families), args.receptacles, (lo, hi), args.hidden)
    target = os.path.join(args.out, "json_2.1.1")
    if os.path.exists(target):
        if not args.overwrite:
            p.error(f"{target} exists; pass --overwrite to replace it or choose another --out")
        shutil.rmtree(target)
    t0 = time.time()
    counts = {"train": args.train, "valid_seen": args.valid_seen, "valid_unseen": args.valid_unseen}
    records = generate(args.out, counts, args.seed, args.max_expert_steps, args.workers, shape=shape)
    print(summary(records))
    n = sum(1 for r in records if r["path"])
    print(f"wrote {n} games to {target} in {time.time() - t0:.1f} s")
    return 0 if n == sum(counts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
