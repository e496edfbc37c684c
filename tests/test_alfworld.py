"""ALFWorld env (envs/alfworld.py) and offline game generator (envs/alfworld_gen.py).

The real ALFRED game in ../shared/data/alfworld (data nobody on the project wrote) and freshly
generated games go through the same loader, engine and expert.
"""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from envs import alfworld as aw
from envs import alfworld_gen as gen
from envs import task_line

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (REPO.parent / "shared" / "data", Path("/work/shared/data")) if p.is_dir()), None)
REAL = SHARED / "alfworld" if SHARED else None
REAL_PLAN = ["look", "go to sinkbasin 1", "go to microwave 1", "open microwave 1", "close microwave 1",
             "go to garbagecan 1", "go to fridge 1", "open fridge 1", "close fridge 1", "go to countertop 1",
             "go to countertop 2"]   # the README's plan up to the potato (which potato is the expert's draw)
# (response, valid, what the game is sent) under the authors' ALFWorld projection (projection.py:19-63 at
# 2cf2fad): the lower-cased text between the first <action> and the first </action>; valid when <think> and
# </think> are there and no CJK ideograph; without the action tags the last 30 lower-cased characters are sent.
CASES = [("", False, ""), (" ", False, " "), ("x" * 10_000, False, "x" * 30), ("<think>hm</think>", False, "<think>hm</think>"),
         ("<action></action>", False, ""), ("<action>look", False, "<action>look"),
         ("<action>look</action>", False, "look"),                                   # no think block: invalid, still sent
         ("<think>\u601d\u8003</think><action>look</action>", False, "look"),        # CJK in the reasoning
         ("<think>ok</think><action>\u65e5\u672c\u8a9e</action>", False, "\u65e5\u672c\u8a9e"),
         ("<think>ok</think><action>go to the moon</action>", True, "go to the moon"),  # inadmissible, valid
         ("<think>ok</think><action>l\u00f6\u00f6k</action>", True, "l\u00f6\u00f6k"),
         ("<think>ok</think><action>look\x00</action>", True, "look\x00"),
         ("<think>ok</think><action>look</action><action>inventory</action>", True, "look"),
         ("<think>ok</think><ACTION>  LOOK </ACTION>", True, "look"),
         ("<think>ok</think></action>look<action>", True, ""),                       # their find(): end before start
         ("<think>ok</think><action>__import__('os').system('echo pwned')</action>", True,
          "__import__('os').system('echo pwned')"),
         (None, False, ""), (42, False, ""), (b"<action>look</action>", False, "")]


def respond(action):
    return f"<think>The expert would do this.</think><action>{action}</action>"


def play_expert(env, task_id):
    obs, info = env.reset(seed=task_id)
    taken = []
    while True:
        action = env.expert_action()
        assert action is not None, f"expert gave up after {taken}"
        taken.append(action)
        obs, reward, terminated, truncated, info = env.step(respond(action))
        assert info["valid"], obs
        if terminated or truncated:
            return info, reward, terminated, taken


# ----------------------------------------------------------------------------- the real game

@pytest.fixture(scope="module")
def real_env():
    if REAL is None:
        pytest.fail("shared data not found beside the repository (../shared/data) nor at /work/shared/data")
    return aw.AlfWorldEnv(data_dir=str(REAL), split="valid_seen", max_steps=30)


def test_real_game_expert_wins_in_16_steps(real_env):
    obs, info = real_env.reset(seed=0)
    assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert real_env.task == "heat some potato and put it in sinkbasin."
    assert real_env.family == info["family"] == "heat" and real_env.num_tasks == 1
    assert "help" not in info["admissible"] and "go to microwave 1" in info["admissible"]
    info, reward, terminated, taken = play_expert(real_env, 0)
    assert info["won"] and terminated and reward == real_env.reward_scale == 10
    assert len(taken) == 16 and taken[:11] == REAL_PLAN and taken[-1] == "move potato 1 to sinkbasin 1"
    assert taken == real_env.reset(seed=0)[1]["expert_plan"]          # the plan reset reports is the one played
    assert sys.argv[0] != "translate.py"                               # the PDDL translator's argv hack is undone


def test_projection_rule_on_the_real_game():
    """Validity is the authors' format rule, not admissibility; whatever the projection passes on is sent
    to the game, inadmissible text gets the game's own "Nothing happens.", and nothing ever raises."""
    env = aw.AlfWorldEnv(data_dir=str(REAL), split="valid_seen", max_steps=1000)
    env.reset(seed=0)
    admissible = list(env.admissible)
    for text, valid, sent in CASES:
        obs, reward, terminated, truncated, info = env.step(text)
        assert info["valid"] is valid and info["action"] == sent, repr(text)[:80]
        assert env.history[-1][1] == sent and reward == 0 and not (terminated or truncated)
        if sent not in admissible:
            assert obs == "Nothing happens." and env.admissible == admissible, repr(text)[:80]
    rng = random.Random(0)
    for _ in range(40):                                                   # random junk: never raises
        junk = "".join(rng.choice("<>/actionthk \n\t\u00e9\u4e2d\U0001F600x") for _ in range(rng.randint(0, 300)))
        obs, reward, _, _, info = env.step(junk)
        assert isinstance(obs, str) and reward == 0 and env.history[-1][1] == info["action"]


def test_inadmissible_command_is_valid_sent_and_kept_in_the_history(real_env):
    real_env.reset(seed=0)
    obs, _, _, _, info = real_env.step("<think>The moon may hold a potato.</think><action>Go to the MOON</action>")
    assert info["valid"] and info["action"] == "go to the moon" and obs == "Nothing happens."
    assert real_env.history == [(real_env.history[0][0], "go to the moon")]
    prompt = real_env.prompt()
    assert "[Action 1] go to the moon" in prompt and "Current observation: Nothing happens." in prompt
    # the response's own spacing is kept (lower-cased and stripped only), as the authors send it
    obs, _, _, _, info = real_env.step("<think>go</think><action>  go to   microwave 1 </action>")
    assert info["valid"] and info["action"] == "go to   microwave 1" and obs == "Nothing happens."
    obs, _, _, _, info = real_env.step("<think>go</think><action>Go To Microwave 1</action>")
    assert info["valid"] and info["action"] == "go to microwave 1" and "microwave 1" in obs and obs != "Nothing happens."


def test_missing_think_is_invalid_penalized_and_still_executed(real_env):
    import grpo
    real_env.reset(seed=0)
    obs, _, _, _, info = real_env.step("<action>go to microwave 1</action>")
    assert not info["valid"] and info["action"] == "go to microwave 1" and "microwave 1" in obs
    assert real_env.history[-1][1] == "go to microwave 1"
    # the trainer's row reward (episode reward 10 here) loses the invalid-action penalty on this row only
    rows = grpo.row_rewards([10.0, 10.0], [info["valid"], True], real_env.invalid_penalty)
    assert rows.tolist() == pytest.approx([9.9, 10.0])
    # no action tags: the last 30 lower-cased characters go to the game (an exact command would run)
    obs, _, _, _, info = real_env.step("Go to countertop 1")
    assert not info["valid"] and info["action"] == "go to countertop 1" and "countertop 1" in obs
    obs, _, _, _, info = real_env.step("I think I should now " + "look around the kitchen carefully")
    assert not info["valid"] and info["action"] == "look around the kitchen carefully"[-30:] and obs == "Nothing happens."


def test_cjk_inside_the_tags_is_invalid(real_env):
    real_env.reset(seed=0)
    for text in ["<think>\u52a0\u70ed\u571f\u8c46</think><action>look</action>",
                 "<think>heat it</think><action>look \u4e00</action>"]:
        obs, _, _, _, info = real_env.step(text)
        assert not info["valid"], text
    # outside the ideograph block (the authors test \u4e00-\u9fff only) the format rule holds
    obs, _, _, _, info = real_env.step("<think>\u3072\u3089\u304c\u306a</think><action>look</action>")
    assert info["valid"] and info["action"] == "look"


def test_prompt_first_step_and_later_steps(real_env):
    real_env.reset(seed=0)
    first = real_env.prompt().splitlines()
    assert [ln for ln in first if ln.startswith(task_line("alfworld"))] == [
        "Your task is to: heat some potato and put it in sinkbasin."]
    assert first[1].startswith("Current observation: You are in the middle of a room.") and "Welcome" not in first[1]
    assert not any(ln.startswith(("Prior to this step", "[Observation", "You are now at step")) for ln in first)
    for action in REAL_PLAN[:7]:
        real_env.step(respond(action))
    real_env.step("no tags at all")
    prompt = real_env.prompt()
    lines = prompt.splitlines()
    assert [ln for ln in lines if ln.startswith(task_line("alfworld"))] == [
        "Your task is to: heat some potato and put it in sinkbasin."]
    assert "Prior to this step you have taken 8 step(s)." in prompt and "You are now at step 9." in prompt
    assert sum(ln.startswith("[Action ") for ln in lines) == real_env.history_length == 5
    assert "[Action 8] no tags at all" in prompt and "[Action 3]" not in prompt and "[Action 4] " in prompt
    assert all(f'"{a}"' in prompt for a in real_env.admissible) and '"help"' not in prompt
    assert lines[-1].startswith("Now it's your turn") and "<think>" in lines[-1] and "<action>" in lines[-1]


def test_skill_block_after_the_task_line_at_the_first_and_a_later_step(real_env):
    """The first-step prompt states the task inside the observation, on its own line: the episode-skill
    section (title, the line telling the agent to use it, the skill in brackets) goes right after it, set
    apart by blank lines, as at later steps; a step skill goes before the turn instruction."""
    import envs
    skill = "Find the potato first.\nHeat it with the microwave, then put it in the sinkbasin."
    block = envs.skill_section(envs.EPISODE_SKILL, skill).split("\n")
    real_env.reset(seed=0)
    for step in range(3):
        prompt = real_env.prompt()
        lines = envs.insert_skill(prompt, skill).split("\n")
        at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith(task_line("alfworld")))
        assert lines[at + 1:at + 7] == [""] + block + [""], step
        assert " ".join(lines[:at + 1] + lines[at + 7:]).split() == prompt.split()
        lines = envs.insert_skill(prompt, None, "Open the fridge now.").split("\n")
        turn = next(i for i, ln in enumerate(lines) if ln.startswith(envs.TURN_LINE))
        assert lines[turn - 5:turn] == [""] + envs.skill_section(envs.STEP_SKILL, "Open the fridge now.").split(
            "\n") + [""]
        real_env.step(respond(REAL_PLAN[step]))


def test_truncation_and_steps_after_the_end(real_env):
    env = aw.AlfWorldEnv(data_dir=str(REAL), split="valid_seen", max_steps=3)
    env.reset(seed=5)                                                  # wraps around to the only game
    outs = [env.step("nothing") for _ in range(3)]
    assert [o[3] for o in outs] == [False, False, True] and not any(o[2] for o in outs)
    obs, reward, terminated, truncated, info = env.step(respond("look"))
    assert not info["valid"] and reward == 0 and truncated


def test_data_folder_choice_and_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as err:
        aw.AlfWorldEnv(data_dir=str(tmp_path / "nowhere"))
    assert "envs.alfworld_gen" in str(err.value) and "alfworld-download" in str(err.value)
    monkeypatch.setenv("ALFWORLD_DATA", str(REAL))
    assert aw.find_data_dir() == os.path.abspath(REAL)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))                 # set on purpose, but empty: no fallback
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        aw.find_data_dir()
    with pytest.raises(ValueError, match="split"):
        aw.AlfWorldEnv(data_dir=str(REAL), split="test")
    with pytest.raises(TypeError):
        aw.AlfWorldEnv(data_dir=str(REAL), max_step=3)                 # a misspelt option is not ignored


def test_family_labels():
    for task_type, family in [("pick_and_place_simple", "pick"), ("look_at_obj_in_light", "look"),
                              ("pick_clean_then_place_in_recep", "clean"), ("pick_heat_then_place_in_recep", "heat"),
                              ("pick_cool_then_place_in_recep", "cool"), ("pick_two_obj_and_place", "pick2")]:
        assert aw.family_of(f"/d/json_2.1.1/train/{task_type}-Mug-None-Desk-301/trial_1/game.tw-pddl") == family
    assert sorted(aw.FAMILIES.values()) == sorted(["pick", "look", "clean", "heat", "cool", "pick2"])


# ----------------------------------------------------------------------------- generated games

@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("alfworld")
    records = gen.generate(str(out), {"train": 6, "valid_seen": 6, "valid_unseen": 6}, seed=3,
                           max_expert_steps=30, workers=2, progress=False)
    return out, records


def test_generator_covers_every_family_and_split(generated):
    out, records = generated
    assert all(r["path"] for r in records), gen.summary(records)
    cells = {(r["split"], r["family"]) for r in records}
    assert cells == {(s, f) for s in aw.SPLITS for f in aw.FAMILIES.values()}
    C = gen.package()[0]
    train = [r for r in records if r["split"] == "train"]
    unseen = [r for r in records if r["split"] == "valid_unseen"]
    assert all(r["scene"] in C.TRAIN_SCENE_NUMBERS for r in records if r["split"] != "valid_unseen")
    assert all(r["scene"] in C.TEST_SCENE_NUMBERS for r in unseen)
    assert not {r["combo"] for r in unseen} & {r["combo"] for r in train}


def test_generated_games_use_the_package_domain_and_grammar(generated):
    out, records = generated
    _, _, data_dir, _ = gen.package()
    domain = Path(data_dir, "alfred.pddl").read_text()
    grammar = Path(data_dir, "alfred.twl2").read_text()
    for r in records:
        folder = Path(r["path"]).parent
        assert {p.name for p in folder.iterdir()} == {"game.tw-pddl", "traj_data.json", "initial_state.pddl"}
        game = json.loads(Path(r["path"]).read_text())
        traj = json.loads((folder / "traj_data.json").read_text())
        assert game["pddl_domain"] == domain and game["solvable"] is True and game["walkthrough"]
        assert game["pddl_problem"] == (folder / "initial_state.pddl").read_text()
        assert "UNKNOWN GOAL" not in game["grammar"] and game["grammar"].count("Your task is to: ") == 1
        assert game["grammar"].replace(game["grammar"].split("Your task is to: ")[1].split('"')[0], "UNKNOWN GOAL.") == grammar
        assert traj["task_type"] in aw.FAMILIES and folder.parent.name.startswith(traj["task_type"] + "-")


def test_generated_games_are_won_by_the_expert_through_the_env(generated):
    out, _ = generated
    for split in aw.SPLITS:
        env = aw.AlfWorldEnv(data_dir=str(out), split=split, max_steps=30)
        families = set()
        for task_id in range(env.num_tasks):
            plan = env.reset(seed=task_id)[1]["expert_plan"]
            info, reward, terminated, taken = play_expert(env, task_id)
            assert info["won"] and terminated and reward == 10 and taken == plan, (env.game, taken, plan)
            families.add(env.family)
        assert families == set(aw.FAMILIES.values())


def test_same_seed_same_task(generated):
    out, _ = generated
    a = aw.AlfWorldEnv(data_dir=str(out), split="train")
    b = aw.AlfWorldEnv(data_dir=str(out), split="train")
    seen = []
    for task_id in range(a.num_tasks):
        obs_a, info_a = a.reset(seed=task_id)
        obs_b, info_b = b.reset(seed=task_id + b.num_tasks)            # ids wrap around
        assert obs_a == obs_b and a.task == b.task and a.game == b.game and info_a["family"] == info_b["family"]
        seen.append(a.game)
    assert len(set(seen)) == a.num_tasks


def test_sampling_is_deterministic():
    rooms = [gen.all_rooms()[s] for s in gen.package()[0].TRAIN_SCENE_NUMBERS]
    for task_type in gen.ORDER:
        specs = [gen.sample_spec(task_type, rooms, random.Random(f"same/{task_type}")) for _ in range(2)]
        assert specs[0] == specs[1]


def test_engine_speedups_do_not_change_transcripts(generated):
    """The cached TextWorld text generation gives the same observations and admissible commands as
    the package's own code path (SEED_ALFWORLD_PLAIN=1 turns the caches off)."""
    out, records = generated
    games = [r["path"] for r in records if r["split"] == "valid_seen"][:2]
    script = (
        "import json, random, sys\n"
        "from envs import alfworld as aw\n"
        "eng, log = aw.make_engine(), []\n"
        "for path in sys.argv[1:]:\n"
        "    rng, state = random.Random(0), aw.engine_reset(eng, path)\n"
        "    for k in range(1, 13):\n"
        "        cmd = state['extra.expert_plan'][0] if k % 3 else rng.choice(state['admissible_commands'])\n"
        "        state, _ = aw.engine_step(eng, cmd, k)\n"
        "        log.append([cmd, state['feedback'], state['admissible_commands'], state['extra.expert_plan']])\n"
        "print(json.dumps(log))\n")
    runs = []
    for plain in ("", "1"):
        env = {**os.environ, "SEED_ALFWORLD_PLAIN": plain, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-c", script, *games], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and len(runs[0]) == 24


# ----------------------------------------------------------------------------- hidden-object rooms (the CPU testbed)

HIDDEN = gen.Shape(families=("pick_and_place_simple",), receptacles=5, distractors=(0, 2), hidden=True)


@pytest.fixture(scope="module")
def hidden(tmp_path_factory):
    out = tmp_path_factory.mktemp("hidden")
    records = gen.generate(str(out), {"train": 4, "valid_seen": 4}, seed=1, workers=2, progress=False, shape=HIDDEN)
    return out, records


def test_direct_route_drops_the_search():
    searched = ["look", "go to shelf 1", "go to drawer 1", "open drawer 1", "close drawer 1", "go to drawer 2",
                "open drawer 2", "take pen 1 from drawer 2", "go to desk 1", "open desk 1", "close desk 1",
                "move pen 1 to desk 1"]
    assert gen.direct_route(searched) == ["go to drawer 2", "open drawer 2", "take pen 1 from drawer 2", "go to desk 1",
                                          "open desk 1", "move pen 1 to desk 1"]
    assert gen.direct_route(["look", "go to desk 1"]) == ["look", "go to desk 1"]     # no take: kept as it is


def test_hidden_rooms_hide_one_target_and_store_the_direct_route(hidden):
    """--hidden: at most 5 receptacles, the one target instance out of sight at the start, and the stored
    walkthrough goes straight to it (shorter than the expert's search, which still looks first) and wins."""
    out, records = hidden
    assert len(records) == 8 and all(r["path"] for r in records), gen.summary(records)
    assert all(r["plan_steps"] < r["expert_steps"] for r in records)     # the expert searched; the route does not
    assert "direct route" in gen.summary(records)
    for split in ("train", "valid_seen"):
        env = aw.AlfWorldEnv(data_dir=str(out), split=split, max_steps=10)
        for task_id in range(env.num_tasks):
            obs, info = env.reset(seed=task_id)
            plan, target = info["expert_plan"], env.task.split()[2]          # "put some <target> on <place>."
            where = plan[0].removeprefix("go to ")
            assert plan[0].startswith("go to ") and plan[1 + plan[1].startswith("open ")] == f"take {target} 1 from {where}"
            assert sum(a.startswith("go to ") for a in env.admissible) <= HIDDEN.receptacles
            assert f"{target} 1" not in obs
            for command in plan:
                obs, reward, terminated, truncated, info = env.step(respond(command))
            assert info["won"] and terminated and env.steps == len(plan) <= 6


def test_hidden_target_lies_in_its_usual_place_most_of_the_time():
    """place_usual: the object's most usual fitting receptacle class (a fixed ranking per object class, the same in
    every room) holds it USUAL of the time; a class it does not fit or the goal's (avoid) never does."""
    recs = [("Drawer", "Drawer_1", "l1"), ("Drawer", "Drawer_2", "l2"), ("Shelf", "Shelf_1", "l3"),
            ("Desk", "Desk_1", "l4"), ("Fridge", "Fridge_1", "l5")]
    rng = random.Random(0)
    best = min(("Drawer", "Shelf"), key=lambda q: gen.usual_rank("Book", q))
    spots = [gen.place_usual("Book", recs, rng, avoid=("Desk",))[0] for _ in range(2000)]
    assert set(spots) == {"Drawer", "Shelf"}
    assert abs(spots.count(best) / len(spots) - gen.USUAL) < 0.03
    assert gen.usual_rank("Book", "Drawer") == gen.usual_rank("Book", "Drawer") != gen.usual_rank("Pen", "Drawer")


class FirstGoTo:
    """A scripted engine for the route probe: always goes to the first receptacle the prompt's admissible actions
    list (real token ids of the given tokenizer)."""

    def __init__(self, tok):
        self.tok, self.eos, self.max_model_len = tok, tok.convert_tokens_to_ids("<|im_end|>"), 4096

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        out = []
        for ids in prompt_ids_list:
            first = next(a for a in re.findall(r'"([^"]+)"', self.tok.decode(ids)) if a.startswith("go to "))
            toks = self.tok.encode(respond(first), add_special_tokens=False) + [self.eos]
            out += [(toks, [-1.0] * len(toks))] * n
        return out


def test_the_route_probe_reads_how_an_episode_went(hidden, tokenizer):
    """bench/route_probe.py on real hidden rooms: a policy that always goes to the first listed receptacle has its
    first move right exactly where the walkthrough starts there, never takes, moves or wins; the flags of a
    premature move and of a cut action, on hand-written episodes."""
    sys.path.insert(0, str(REPO / "bench"))
    import route_probe
    import seed
    out, _ = hidden
    cfg = seed.parse_config(["--env", "alfworld", "--data_dir", str(out), "--max_steps", "2", "--history_length", "0",
                             "--max_tokens", "48"])
    got = route_probe.play(FirstGoTo(tokenizer), tokenizer, cfg, "valid_seen", [0, 1, 2, 3])
    env = aw.AlfWorldEnv(data_dir=str(out), split="valid_seen", max_steps=2)
    for t, g in zip(range(4), got):
        obs, info = env.reset(seed=t)
        first = next(a for a in env.admissible if a.startswith("go to "))
        assert g["plan"] == info["expert_plan"] and g["actions"][0] == first and len(g["actions"]) == 2
        assert g["first"] == int(first == info["expert_plan"][0]) and g["won"] == g["premature"] == g["cut"] == 0
    plan = ["go to drawer 1", "open drawer 1", "take book 1 from drawer 1", "go to desk 1", "move book 1 to desk 1"]
    assert route_probe.route_flags(plan, plan) == {"first": 1, "premature": 0, "cut": 0}
    assert route_probe.route_flags(["go to shelf 1", "go", "move book 1 to desk 1"], plan) == \
        {"first": 0, "premature": 1, "cut": 1}
    assert route_probe.route_flags(["look", "inventory"], plan)["cut"] == 0
