"""The CPU testbed's warm start (`sft.py --stage warmup`, docs/design-notes.md, the CPU testbed): every behaviour-cloning
target is exactly what the env accepts (decoded as a rollout decodes a sampled response, replayed through
`env.step`: valid at every step, the episode won, the prompts the ones a rollout would send), and the stage
runs end to end on a tiny config, reporting its held-out loss and writing a checkpoint seed.py and sft.py take."""
import json
import math
import os
import re

import pytest

import envs
import rollout
import runfolder
import seed
import sft
import testbed
from tests.test_alfworld import REAL, hidden  # noqa: F401 (hidden: a fixture)


def sft_config(flags):
    return runfolder.parse_config(flags, sft.SFTConfig, sft.ENV_DEFAULTS)


@pytest.mark.parametrize("env_name, split, tasks", [
    ("sokoban", "train", range(24)),
    ("ezpoints", "train", range(24)),
    ("alfworld", "valid_seen", [0]),          # the real ALFRED game (shared data), 16 expert steps
])
def test_warmup_targets_replay_valid_and_win(env_name, split, tasks, tokenizer):
    kw = dict(data_dir=str(REAL)) if env_name == "alfworld" else {}
    cfg = sft_config(["--env", env_name, "--max_steps", "30" if env_name == "alfworld" else "15",
                      "--history_length", "2"])
    cfg.data_dir = kw.get("data_dir", "")
    per_task = testbed.expert_examples(cfg, tokenizer, list(tasks), split)
    assert all(per_task), "the expert failed a task"
    env = envs.from_config(cfg, split)
    for task, pairs in zip(tasks, per_task):
        env.reset(seed=task)
        for k, (prompt, completion) in enumerate(pairs):
            assert prompt == rollout._prompt(env, tokenizer, None, cfg.max_prompt_tokens)[1]
            assert completion[-1] == tokenizer.eos_token_id
            text = tokenizer.decode(completion, skip_special_tokens=True)   # what rollout.collect sends
            _, reward, terminated, truncated, info = env.step(text)
            assert info["valid"], (env_name, task, k, text)
            assert (terminated or truncated) == (k == len(pairs) - 1)
        assert info["won"] and terminated and reward == env.reward_scale


def test_skill_examples_carry_the_scripted_skill_and_obey_it(tokenizer):
    """--skill_tasks (CPU testbed, not the method): a skill example's prompt is the rollout prompt with the
    task's scripted skill inserted (naming the route), the target is the plain example's own (the teacher writes
    the student's kind of response); both skill forms occur, and the avoidance rules name more than one kind of
    failure."""
    cfg = sft_config(["--env", "ezpoints", "--max_steps", "5", "--history_length", "0"])
    tasks = list(range(12))
    plain = testbed.expert_examples(cfg, tokenizer, tasks)
    skilled = testbed.expert_examples(cfg, tokenizer, tasks, skills=True)
    env, forms, rules = envs.from_config(cfg, "train"), set(), set()
    for task, p, q in zip(tasks, plain, skilled):
        _, info = env.reset(seed=task)
        assert len(p) == len(q) > 0
        for (pp, pc), (sp, sc) in zip(p, q):
            text, plain_text = tokenizer.decode(sp), tokenizer.decode(pp)
            assert envs.EPISODE_SKILL[0] in text and envs.EPISODE_SKILL[0] not in plain_text
            route = " -> ".join(info["expert_plan"])
            assert route in text                                                  # the skill names the route
            assert sc == pc and sp != pp                                          # same target, other prompt
        prompt = tokenizer.decode(q[0][0])
        forms.add("workflow" in prompt)
        if "Avoid this failure" in prompt:
            rules.add(prompt.split("Avoid this failure: ")[1].split(". Instead")[0])
    assert forms == {True, False}                                                 # both skill forms occur
    assert len(rules) > 1                                                         # failures of several kinds


def test_alfworld_skill_examples_follow_the_route_the_skill_names(hidden, tokenizer):
    """In a hidden-object room (CPU testbed) a skill example's target walks the stored direct route that its
    skill names, or, where the skill is in the failure form that names only empty places (testbed.elimination_demo),
    searches the other places; the plain example searches (testbed.search_actions: goes to receptacles, opens the
    closed ones, never the goal's, then the route from its take); all win."""
    out, _ = hidden
    cfg = sft_config(["--env", "alfworld", "--max_steps", "20", "--history_length", "0", "--data_dir", str(out)])
    tasks = list(range(8))
    plain = testbed.expert_examples(cfg, tokenizer, tasks, "valid_seen")
    skilled = testbed.expert_examples(cfg, tokenizer, tasks, "valid_seen", skills=True)
    env, forms = envs.from_config(cfg, "valid_seen"), set()
    said = lambda pairs: [envs.action_text(tokenizer.decode(c, skip_special_tokens=True)) for _, c in pairs]
    for task, p, q in zip(tasks, plain, skilled):
        _, info = env.reset(seed=task)
        route = list(info["expert_plan"])
        take = next(i for i, a in enumerate(route) if a.startswith("take "))
        prompt = tokenizer.decode(q[0][0])
        rule = re.search(r"was not in ([a-z0-9, ]+): look in the other places first", prompt)
        forms.add(bool(rule))
        if rule:   # the target never visits a place the skill names, and ends with the route from its take
            named = rule.group(1).split(", ")
            assert route[take].split(" from ")[1] not in named and said(q)[-len(route) + take:] == route[take:]
            assert not {a.removeprefix("go to ") for a in said(q)[:-len(route) + take]} & set(named)
        else:
            assert said(q) == route and " -> ".join(route) in prompt
        searched = said(p)
        k = searched.index(route[take])
        assert searched[k:] == route[take:] and searched[k - 1 - route[take - 1].startswith("open ")] == route[0]
        assert all(a.startswith(("go to ", "open ")) and a != route[take + 1] for a in searched[:k])
        assert envs.EPISODE_SKILL[0] not in tokenizer.decode(p[0][0])
    assert forms == {True, False}


def test_warmup_stage_end_to_end(tmp_path):
    """4 Sokoban rooms (one held out), 1 epoch: the held-out loss is written per epoch, the checkpoint loads,
    and seed.py --init / sft.py --model accept it."""
    out = str(tmp_path / "warmup")
    sft.main(["--stage", "warmup", "--env", "sokoban", "--tasks", "4", "--val_fraction", "0.25", "--epochs", "1",
              "--max_steps", "8", "--history_length", "1", "--lr", "2e-4", "--batch_size", "4",
              "--micro_batch_size", "4", "--out", out])
    summary = json.load(open(os.path.join(out, "warmup.json")))
    assert summary["expert_won"] == 4 and summary["train_steps"] > 0 and summary["val_steps"] > 0
    assert len(summary["val_loss"]) == 1 and math.isfinite(summary["val_loss"][0]) and summary["val_loss"][0] > 0
    log = [json.loads(x) for x in open(os.path.join(out, "sft_log.jsonl"))]
    assert "val_loss" in log[-1] and log[-1]["loss"] < log[0]["loss"]
    model, tok, path = rollout.load_model(out)
    assert path == out and tok.eos_token_id is not None
    seed.validate(seed.parse_config(["--env", "sokoban", "--init", out]))
    sft.validate(sft_config(["--env", "sokoban", "--model", out]))


def test_warmup_bad_flags_stop_at_start_up(capsys):
    for flags, words in ((["--env", "sokoban", "--stage", "bc"], "unknown --stage"),
                         (["--stage", "warmup", "--env", "search"], "needs an env with an expert"),
                         (["--env", "search", "--skill_tasks", "4"], "needs an env with an expert"),
                         (["--env", "ezpoints", "--skill_tasks", "-1"], "must be 0 or more")):
        with pytest.raises(SystemExit):
            sft.validate(sft_config(flags))
        assert words in capsys.readouterr().err


def test_stage1_replay_adds_the_experts_moves(tmp_path, monkeypatch):
    """sft.py --replay k: the expert's moves on k more tasks join Stage 1's training pairs (the analyses
    stay the validation pairs), each completion a valid action; without it the pairs are analyses only.
    The fine-tuning itself is stopped at its start (sft.finetune patched): only the pairs are checked."""
    seen = {}

    def stop(cfg, train, val, *a):
        seen[cfg.replay] = (train, val)
        raise KeyboardInterrupt

    monkeypatch.setattr(sft, "finetune", stop)
    flags = ["--env", "sokoban", "--engine", "hf", "--tasks", "2", "--k0", "1", "--max_steps", "2",
             "--history_length", "0", "--max_tokens", "8", "--val_fraction", "0.5"]
    for replay in (0, 3):
        with pytest.raises(KeyboardInterrupt):
            sft.main(flags + ["--replay", str(replay), "--out", str(tmp_path / f"r{replay}")])
    (plain, val0), (mixed, val3) = seen[0], seen[3]
    assert len(plain) == 1 and len(val0) == len(val3) == 1
    extra = [p for p in mixed if p not in plain]
    assert len(mixed) > len(plain) and len(extra) == len(mixed) - len(plain)
    _, tok, _ = rollout.load_model(rollout.resolve_model(rollout.EMBEDDED))
    env = envs.make("sokoban", split="train", max_steps=2, history_length=0)
    for _, completion in extra:
        env.reset(seed=0)
        assert env.step(tok.decode(completion, skip_special_tokens=True))[4]["valid"]


def test_ezpoints_thought_states_the_solution_and_the_formula_so_far():
    """EZPoints' warm-start thought: a solution that equals 12, the formula so far, then that solution's next
    token as the action (`=` once the formula is the whole solution)."""
    from envs import ezpoints
    env = envs.make("ezpoints", max_steps=5, history_length=0)
    for task in range(12):
        env.reset(seed=task)
        while not env.done:
            answer = json.loads(testbed.expert_response(env))
            solution, rest = answer["thoughts"].split(" = 12. The formula so far is ")
            so_far, action = rest.rsplit(", so the next token is ", 1)
            assert ezpoints.evaluate(solution.split()) == 12
            assert so_far == (" ".join(env.formula) or "empty") and solution.startswith(" ".join(env.formula))
            assert action == answer["action"] + "." and answer["action"] == env.expert_action()
            env.step(json.dumps(answer))
        assert env.formula == solution.split()
