"""analyzer.py: the analysis prompt and its trimming, the analyzer's own budget (a 30-step episode of the real
ALFWorld game in ../shared/data read whole, the same prompt in Stage 1 and Stage 2), parsing of malformed
outputs, the retry path of `analyze` (a scripted engine double: the real engines are tested in
test_rollout.py) and one real run on the HF engine, skill insertion into the envs' real prompts, the scripted
Stage-1 annotator, the external client against a local HTTP server, and the skill library."""
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import analyzer  # noqa: E402
import envs  # noqa: E402
import rollout  # noqa: E402
import seed  # noqa: E402
import sft  # noqa: E402
from rollout import Episode, Step  # noqa: E402

REAL_GAMES = next((p for p in (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                                            "shared", "data", "alfworld"), "/work/shared/data/alfworld")
                   if os.path.isdir(p)), None)

GOOD = '{"episode_summary": "The agent found the apple and cooled it.", "episode_skill": "Find the apple, cool it in the fridge, then put it on the table."}'


def episode(won=False, steps=(), task="put a cool apple in diningtable", env="alfworld", family="cool", info=None):
    ep = Episode(task_id=3, group_id=0, env=env, task=task, family=family, info=dict(info or {}))
    for obs, resp, valid, action in steps:
        ep.steps.append(Step(prompt_text="", prompt_ids=[], response_ids=[], response_text=resp,
                             engine_logprobs=[], observation=obs, action=action, valid=valid))
    ep.won, ep.reward = won, 10.0 if won else 0.0
    return ep


STEPS = [("You are in the middle of a room.", "<think>look for the apple</think><action>go to countertop 1</action>",
          True, "go to countertop 1"),
         ("On the countertop 1, you see an apple 1.", "I will take it", False, ""),
         ("Nothing happens.", "<think>take it</think><action>take apple 1 from countertop 1</action>",
          True, "take apple 1 from countertop 1")]


# ----------------------------------------------------------------------------- the prompt

def test_analysis_prompt_holds_the_whole_episode():
    for won in (True, False):
        msgs = analyzer.analysis_prompt(episode(won, STEPS))
        assert [m["role"] for m in msgs] == ["system", "user"]
        text = msgs[1]["content"]
        assert "put a cool apple in diningtable" in text
        assert ("SUCCESS" in text) == won and ("FAILURE" in text) != won
        assert ("workflow" in text) == won and ("avoidance rule" in text) != won
        for obs, resp, _, _ in STEPS:
            assert obs in text and resp in text
        assert text.count("Action: valid") == 2 and text.count("Action: INVALID") == 1
        assert '"episode_summary"' in text and '"episode_skill"' in text


def test_analysis_prompt_trims_old_observations_first():
    steps = [(f"observation {t} " + "x" * 300, f"<think>step {t}</think><action>look</action>", True, "look")
             for t in range(20)]
    ep = episode(False, steps)
    full = analyzer.analysis_prompt(ep, max_chars=10**6)[1]["content"]
    assert analyzer.analysis_prompt(ep)[1]["content"] == full                # no budget: whole
    text = analyzer.analysis_prompt(ep, max_chars=4000)[1]["content"]
    assert len(full) > 6000 and len(text) <= 4000
    assert "observation 0 " not in text and "observation 19 " in text       # oldest go, the last stays
    assert all(f"<think>step {t}</think>" in text for t in range(20))       # responses kept whole
    tiny = analyzer.analysis_prompt(ep, max_chars=1500)[1]["content"]       # then responses shrink, then steps
    assert len(tiny) <= 1500 and "observation 19" in tiny and '"episode_skill"' in tiny


def test_fit_prompt_respects_a_token_budget(tokenizer):
    steps = [(f"observation {t} " + "the cabinet is closed. " * 30, "<action>look</action>", True, "look")
             for t in range(30)]
    msgs = analyzer.fit_prompt(episode(False, steps), tokenizer, 700)
    assert len(rollout.chat_ids(tokenizer, msgs)) <= 700
    assert "observation 29" in msgs[1]["content"]
    assert analyzer.fit_prompt(episode(False, steps), tokenizer, 10**5) == analyzer.analysis_prompt(episode(False, steps))


def thirty_step_episode():
    """30 steps of the real ALFWorld game (heat some potato ...), wandering (never the goal), each response a
    short reasoning plus the action, as an instruct model writes them; every 7th response malformed."""
    from envs.alfworld import AlfWorldEnv
    env = AlfWorldEnv(data_dir=REAL_GAMES, split="valid_seen", max_steps=30)
    obs, info = env.reset(seed=0)
    ep = Episode(task_id=0, group_id=0, env="alfworld", task=env.task, family=env.family, info={})
    for t in range(30):
        adm = [a for a in info["admissible"] if not a.startswith(("move", "heat", "put"))]
        action = adm[(7 * t + 3) % len(adm)]
        think = (f"<think>Step {t + 1}. My task is to {env.task} I have not found the potato yet. The last "
                 f"observation said: {obs[:160]} I have not checked every receptacle yet, so I will try "
                 f"'{action}' next and look for a potato there, then take it to the microwave.</think>")
        resp = think if t % 7 == 6 else f"{think}<action>{action}</action>"
        nxt, reward, term, trunc, info = env.step(resp)
        ep.steps.append(Step(prompt_text="", prompt_ids=[], response_ids=[], response_text=resp, engine_logprobs=[],
                             observation=obs, action=info["action"], valid=info["valid"], reward=reward))
        ep.won, obs = ep.won or info["won"], nxt
    ep.reward = 10.0 if ep.won else 0.0
    return ep


class RecordingEngine:
    """An engine double of a given max_model_len: records each prompt's ids, answers GOOD."""

    def __init__(self, tokenizer, max_model_len):
        self.tok, self.max_model_len, self.prompts = tokenizer, max_model_len, []

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        assert temperature == 0.0 and n == 1
        self.prompts += [list(p) for p in prompt_ids_list]
        ids = self.tok(GOOD, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [(ids, [0.0] * len(ids)) for _ in prompt_ids_list]


def test_thirty_step_alfworld_episode_is_analyzed_whole(tokenizer, model_path, capsys):
    """At the defaults (one greedy call, 1,024 new tokens, the analyzer's own 16,384-token budget, capped by the
    embedded model's 8,192-token context), a 30-step episode of the real game reaches the analyzer whole, within
    the max_model_len seed.py gives the engine, and Stage 1 trains on that very prompt."""
    if REAL_GAMES is None:
        pytest.fail("the real ALFWorld game is not in ../shared/data/alfworld nor /work/shared/data/alfworld")
    ep = thirty_step_episode()
    assert ep.length == 30 and not ep.won and sum(not s.valid for s in ep.steps) >= 4
    cfg = seed.parse_config(["--skill_mode", "episode_step"])   # the longer prompt: it also asks for step skills
    assert (cfg.analyzer_max_prompt_tokens, cfg.analyzer_max_tokens, cfg.analyzer_retries) == (16384, 1024, 0)
    context = seed.engine_context(cfg, model_path)
    assert context == 8192 and "prompt budget is 7168" in capsys.readouterr().out    # the model's own limit
    engine = RecordingEngine(tokenizer, context)
    stats = analyzer.self_analyze(engine, tokenizer, [ep], cfg, progress=False)
    assert stats["parse_failures"] == 0 and ep.skill == json.loads(GOOD)["episode_skill"]
    assert len(engine.prompts) == 1                                        # one call, no retry
    ids = engine.prompts[0]
    text = tokenizer.decode(ids)
    assert len(ids) + cfg.analyzer_max_tokens <= context
    for t, s in enumerate(ep.steps):                                       # every step, whole
        assert f"## Step {t}\nObservation: {s.observation}\nAgent response: {s.response_text}\n" in text
    assert "trimmed" not in text and "[...]" not in text and "omitted" not in text
    whole = analyzer.analysis_prompt(ep, None, cfg.skill_mode, cfg.max_step_skills)
    assert ids == rollout.chat_ids(tokenizer, whole) and '"step_skills": {"0":' in text
    print(f"30-step episode: {len(whole[1]['content'])} characters, {len(ids)} tokens")
    label = json.loads(GOOD)                                               # Stage 1: the same prompt
    sc = sft.SFTConfig(skill_mode=cfg.skill_mode)                         # Stage 1 in the same mode
    (prompt, target), = sft.make_examples(tokenizer, {"0:0": ep}, {"0:0": label}, sft.prompt_budget(sc),
                                          sc.skill_mode, sc.max_step_skills)
    assert prompt == ids and tokenizer.decode(target).startswith('{"episode_summary"')


def test_analysis_budget_is_the_analyzers_own_capped_by_the_model(model_path, tmp_path, capsys):
    """The engine holds the larger of the actor's turn and the analysis; a model with a long context gets the
    full 16,384-token budget, the 8,192-token embedded model a capped one (a notice, no crash)."""
    with open(os.path.join(model_path, "config.json")) as f:
        conf = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(conf, max_position_embeddings=32768), f)
    assert analyzer.analysis_budget(str(tmp_path), 16384, 1024) == (16384, 17408) and not capsys.readouterr().out
    assert analyzer.analysis_budget(model_path, 16384, 1024, retries=2) == (8192 - 3 * 1024 - 192, 8192)
    assert "8192 tokens" in capsys.readouterr().out
    cfg = seed.parse_config(["--algo", "grpo"])                            # no live analyzer: the actor's turn
    assert seed.engine_context(cfg, str(tmp_path)) == cfg.max_prompt_tokens + cfg.max_tokens
    assert seed.engine_context(seed.parse_config([]), str(tmp_path)) == 16384 + 1024
    with pytest.raises(SystemExit):
        analyzer.analysis_budget(model_path, 16384, 4096, retries=1)           # nothing left for the episode


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text", [
    GOOD,
    "```json\n" + GOOD + "\n```",
    "Sure! Here is my analysis:\n" + GOOD + "\nHope this helps.",
    "{not json at all} and then " + GOOD,
    GOOD.replace('table."}', 'table.",}'),                                        # trailing comma
    '{"episode_skill": ["Find the apple first,", "then cool it in the fridge."]}',   # a list of lines, no summary
])
def test_parse_analysis_accepts(text):
    out = analyzer.parse_analysis(text)
    assert out is not None and set(out) == {"episode_summary", "episode_skill", "step_skills"}
    assert out["step_skills"] == {}                                          # episode_only (the default)
    assert "apple" in out["episode_skill"] and "fridge" in out["episode_skill"]


@pytest.mark.parametrize("text", [
    None, "", "   ", "I think the agent should be more careful.",
    '{"episode_summary": "ok", "episode_skill": ""}',
    '{"episode_summary": "ok", "episode_skill": "N/A"}',
    '{"episode_summary": "ok", "episode_skill": "<the skill>"}',
    '{"episode_summary": "<one or two sentences>", "episode_skill": "<one short skill, a full sentence addressed to the agent>"}',
    '{"episode_summary": "ok", "episode_skill": "Be careful"}',                    # trivial: two words
    '{"episode_summary": "ok", "episode_skill": 42}',
    '{"episode_summary": "ok", "episode_skill": null}',
    '{"episode_summary": "ok", "episode_skill": "!!! ??? ### $$$ %%% ^^^ &&&"}',
    '{"episode_summary": "ok", "skill": "Find the apple and cool it in the fridge."}',  # wrong key
    '{"episode_summary": "ok", "episode_skill": "Find the apple and cool it',           # cut off
    "{'episode_summary': 'ok', 'episode_skill': 'Find the apple and cool it.'}",        # Python, not JSON
    '["Find the apple and cool it in the fridge."]',
    "```json\n```",
])
def test_parse_analysis_rejects(text):
    assert analyzer.parse_analysis(text) is None


def test_parse_analysis_lenient_keeps_any_non_empty_skill():
    """Stage 1's label filter (the authors' pipeline): a non-empty skill string is kept, even a trivial one."""
    assert analyzer.parse_analysis('{"episode_summary": "ok", "episode_skill": "N/A"}', lenient=True) == \
        {"episode_summary": "ok", "episode_skill": "N/A", "step_skills": {}}
    for text in ('{"episode_summary": "ok", "episode_skill": "  "}', '{"episode_skill": 42}', "no JSON", None):
        assert analyzer.parse_analysis(text, lenient=True) is None


def test_parse_analysis_shortens_a_rambling_skill():
    skill = "Open the fridge before you put the apple inside. " * 40
    out = analyzer.parse_analysis(json.dumps({"episode_summary": "s", "episode_skill": skill}))
    assert len(out["episode_skill"]) <= analyzer.MAX_SKILL_CHARS and out["episode_skill"].endswith(".")


# ----------------------------------------------------------------------------- analyze

class ScriptedEngine:
    """An engine double: answers each prompt with the next scripted text of its episode, recording prompts.
    (The real vLLM/HF engines are tested in test_rollout.py; here the point is the retry logic.)"""

    def __init__(self, tokenizer, scripts):
        self.tok, self.scripts, self.calls = tokenizer, scripts, []
        self.max_model_len = 4096

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        assert temperature == 0.0 and n == 1
        self.calls.append([self.tok.decode(p) for p in prompt_ids_list])
        out = []
        for text in self.calls[-1]:
            k = next(i for i, ep_task in enumerate(("task A", "task B", "task C")) if ep_task in text)
            ids = self.tok(self.scripts[k].pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append((ids, [0.0] * len(ids)))
        return out


def test_analyze_retry_path(tokenizer):
    eps = [episode(True, STEPS, task=t) for t in ("task A", "task B", "task C")]
    engine = ScriptedEngine(tokenizer, [[GOOD], ["Let me think... no JSON here.", "```json\n" + GOOD + "\n```"],
                                        ["{}", '{"episode_skill": "N/A"}', "still nothing"]])
    stats = analyzer.analyze(engine, tokenizer, eps, max_tokens=64, retries=2)
    assert stats == {"episodes": 3, "parsed": 2, "parse_failures": 1, "parse_failure_rate": pytest.approx(1 / 3),
                     "first_try_failures": 2, "generate_calls": 3}
    assert [len(c) for c in engine.calls] == [3, 2, 1]                     # one batched call per round
    assert eps[0].skill == eps[1].skill == json.loads(GOOD)["episode_skill"]
    assert eps[2].skill is None and eps[2].summary is None
    retry = engine.calls[1][0]                                             # task B's second prompt
    assert "Let me think... no JSON here." in retry and "could not be used: no JSON object" in retry
    last = engine.calls[2][0]                                              # task C's third: both corrections
    assert last.count("could not be used") == 2 and "empty or trivial" in last


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # the 2 test cores are shared: one thread is far faster than two contended
    yield
    torch.set_num_threads(threads)


def test_analyze_runs_on_the_real_hf_engine(hf_engine, tokenizer, one_thread):
    """The plumbing on the real engine (token ids in, decoded text out). The base 135M model does not
    write the JSON before Stage 1 (measured: 0 of 2 parsed at 128 tokens, 3 rounds), so both outcomes pass."""
    eps = [episode(False, STEPS[1:2])]
    stats = analyzer.analyze(hf_engine, tokenizer, eps, max_tokens=8, retries=1)
    assert stats["episodes"] == 1 and stats["parsed"] + stats["parse_failures"] == 1
    assert stats["generate_calls"] == 1 + stats["first_try_failures"]
    assert (eps[0].skill is None) == (stats["parse_failures"] == 1)


# ----------------------------------------------------------------------------- insert_skill

SKILL = "Push the box along the free column first, never into a corner."
BLOCK = envs.skill_section(envs.EPISODE_SKILL, SKILL)       # the episode-skill section (seed/prompting.py)
words = lambda text: " ".join(text.split())


def _check_after_task_line(prompt, name):
    out = envs.insert_skill(prompt, SKILL)
    assert out.count(SKILL) == 1
    lines = out.split("\n")
    at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith(envs.task_line(name)))
    assert lines[at + 1:at + 6] == [""] + BLOCK.split("\n") + [""]
    assert words(out.replace(BLOCK, "")) == words(prompt)                     # nothing else changed


def test_insert_skill_after_the_task_line_of_real_prompts():
    for name in ("sokoban", "ezpoints", "search"):
        env = envs.make(name)
        env.reset(seed=1)
        _check_after_task_line(env.prompt(), name)
        if name == "sokoban":                                                # a later step's prompt too
            env.step("<think>t</think><action>up</action>")
            _check_after_task_line(env.prompt(), name)
    _check_after_task_line("You answer questions.\nYour question: who wrote Hamlet?\nThink, then answer.", "search")


# The cases of the authors' tests/trainer/ppo/test_episode_skill_guidance.py (2cf2fad), with the exact strings
# their build_augmented_observation_text returns for them (computed with their seed/prompting.py) as fixtures.
THEIR_PROMPT = """You are an expert autonomous agent.
Your task is to: find a red mug under 20 dollars.

Now it's your turn to choose the next action."""
THEIR_SOKOBAN = """You are an expert agent operating in the Sokoban environment. Your goal is to push all the boxes onto the target spots. Once all boxes are on the targets, you win!

# Rules
You can only push boxes.

# Current Step
Your current observation is shown in the image: <image>
Your admissible actions are ["up", "down", "left", "right"].

Now it's your turn to make a move."""
EPISODE_HEAD = ("**Episode-Level Skill**\nRefer to this episode-level skill when deciding what action to take in "
                "the current episode:\n")
STEP_HEAD = "**Critical-Step Skill**\nUse this current-step skill for this decision only:\n"
THEIR_CASES = [   # (prompt, episode skill, step skill, their output)
    (THEIR_PROMPT, "Check price and color before selecting the product.", "",
     "You are an expert autonomous agent.\nYour task is to: find a red mug under 20 dollars.\n\n" + EPISODE_HEAD
     + "[Check price and color before selecting the product.]\n\nNow it's your turn to choose the next action."),
    (THEIR_PROMPT, "Check constraints before selecting the product.",
     "Search with the required attributes before clicking.",
     "You are an expert autonomous agent.\nYour task is to: find a red mug under 20 dollars.\n\n" + EPISODE_HEAD
     + "[Check constraints before selecting the product.]\n\n" + STEP_HEAD
     + "[Search with the required attributes before clicking.]\n\nNow it's your turn to choose the next action."),
    (THEIR_SOKOBAN, "Move behind each box before pushing it toward a target.", "",
     "You are an expert agent operating in the Sokoban environment. Your goal is to push all the boxes onto the "
     "target spots. Once all boxes are on the targets, you win!\n\n" + EPISODE_HEAD
     + "[Move behind each box before pushing it toward a target.]\n\n# Rules\nYou can only push boxes.\n\n"
     "# Current Step\nYour current observation is shown in the image: <image>\nYour admissible actions are "
     '["up", "down", "left", "right"].\n\nNow it\'s your turn to make a move.'),
    (THEIR_PROMPT, "", "", THEIR_PROMPT),
    # beyond their file: a step skill alone, and the no-anchor fallback (both sections appended at the end)
    (THEIR_PROMPT, "", "Search with the required attributes before clicking.",
     "You are an expert autonomous agent.\nYour task is to: find a red mug under 20 dollars.\n\n" + STEP_HEAD
     + "[Search with the required attributes before clicking.]\n\nNow it's your turn to choose the next action."),
    ("Just text.", "E skill.", "S skill.", "Just text.\n\n" + EPISODE_HEAD + "[E skill.]\n\n" + STEP_HEAD + "[S skill.]"),
]


@pytest.mark.parametrize("prompt,episode_skill,step_skill,theirs", THEIR_CASES)
def test_insert_skill_equals_the_authors_function(prompt, episode_skill, step_skill, theirs):
    """envs.insert_skill returns exactly what the authors' build_augmented_observation_text returns on the
    cases of their test file (their strings, above): the sections' format, the task-line and turn anchors,
    the blank lines, and the fallback to the end of the prompt."""
    assert envs.insert_skill(prompt, episode_skill, step_skill) == theirs


def test_insert_skill_fallbacks_multiline_and_empty():
    prompt = "You play a game.\nCurrent observation: a wall.\nNow it's your turn to act. Use <action>."
    out = envs.insert_skill(prompt, SKILL).split("\n")
    assert out[2:7] == [""] + BLOCK.split("\n") + [""] and out[7].startswith("Now it's your turn")
    assert envs.insert_skill("Just text.", SKILL) == "Just text.\n\n" + BLOCK
    # the task sentence inside a longer line still anchors the skill
    out = envs.insert_skill("You are an agent. Your task is to: heat an egg.\nAct now.", SKILL)
    assert out == "You are an agent. Your task is to: heat an egg.\n\n" + BLOCK + "\n\nAct now."
    # a multi-line skill is kept inside its brackets (stripped); empty skills change nothing
    assert envs.insert_skill("Your task is to: x\nGo.", "  a\n\n b  c ") == (
        "Your task is to: x\n\n" + EPISODE_HEAD + "[a\n\n b  c]\n\nGo.")
    for empty in (None, "", "  \n "):
        assert envs.insert_skill("Your task is to: x\nGo.", empty, empty) == "Your task is to: x\nGo."


# ----------------------------------------------------------------------------- scripted analysis

def test_scripted_analysis_success_is_a_workflow():
    plan = ["go to countertop 1", "go to countertop 2", "take apple 1 from countertop 2", "go to fridge 1",
            "cool apple 1 with fridge 1", "go to diningtable 1", "put apple 1 in/on diningtable 1"]
    out = analyzer.scripted_analysis(episode(True, STEPS, info={"expert_plan": plan}))
    skill = out["episode_skill"]
    assert "go to countertop 2 -> take apple 1 from countertop 2 -> go to fridge 1 -> cool apple 1" in skill
    assert "go to countertop 1" not in skill                               # a detour, dropped
    assert analyzer.parse_analysis(json.dumps(out)) == out


def test_scripted_analysis_failure_is_an_avoidance_rule():
    env = envs.make("sokoban")
    _, info = env.reset(seed=4)
    steps = [("a wall", "<action>up</action>", True, "up")] * 4 + [("a wall", "go up!!", False, "")] * 2
    out = analyzer.scripted_analysis(episode(False, steps, task=env.task, env="sokoban", info=info), max_steps=6)
    summary, skill = out["episode_summary"], out["episode_skill"]
    assert "2 of 6 responses were invalid" in summary and "'up' was repeated 4 times" in summary
    assert "all 6 steps ran out" in summary
    assert skill.startswith("Avoid this failure:") and "do not repeat 'up'" in skill
    assert "key steps are:" in skill and info["expert_plan"][0] in skill
    assert analyzer.parse_analysis(json.dumps(out)) == out
    bare = analyzer.scripted_analysis(episode(False, STEPS[:1]))           # no plan, no visible problem
    assert analyzer.parse_analysis(json.dumps(bare)) == bare


def test_scripted_failure_in_a_hidden_room_names_only_what_it_saw():
    """A hidden-object room (envs/alfworld_gen.py --hidden): a failure that never had the book in view names the
    places it saw empty, not the expert's route (a place it never saw); one that saw the book names the route."""
    plan = ["go to drawer 2", "open drawer 2", "take book 1 from drawer 2", "go to desk 1", "move book 1 to desk 1"]
    act = lambda a: (f"<think>t</think><action>{a}</action>", True, a)
    missed = [("You are in the middle of a room.", *act("go to shelf 1")),
              ("You arrive at shelf 1. On the shelf 1, you see a pen 1.", *act("go to drawer 1")),
              ("You arrive at drawer 1. The drawer 1 is closed.", *act("open drawer 1")),
              ("You open the drawer 1. The drawer 1 is open. In it, you see nothing.", *act("go to desk 1")),
              ("You arrive at desk 1. On the desk 1, you see a pen 2.", *act("go to shelf 1"))]   # the goal
    info = {"expert_plan": plan, "hidden": True}
    skill = analyzer.scripted_analysis(episode(False, missed, task="put a book in desk", info=info), 6)["episode_skill"]
    assert skill.endswith("The book was not in shelf 1, drawer 1: look in the other places first.")
    assert "drawer 2" not in skill and "desk 1" not in skill and "key steps" not in skill
    saw = missed[:1] + [("You arrive at drawer 2. The drawer 2 is open. In it, you see a book 1.", *act("go to desk 1"))]
    skill = analyzer.scripted_analysis(episode(False, saw, task="put a book in desk", info=info), 6)["episode_skill"]
    assert "key steps are: go to drawer 2 -> open drawer 2 -> take book 1 from drawer 2" in skill
    blind = analyzer.scripted_analysis(episode(False, missed[:1], task="put a book in desk", info=info), 6)
    assert blind["episode_skill"].endswith("The book was not found: look in each place once, opening the closed ones.")
    won = analyzer.scripted_analysis(episode(True, missed, task="put a book in desk", info=info), 6)["episode_skill"]
    assert "workflow: go to drawer 2 -> open drawer 2" in won                      # a success keeps its workflow
    # the oracle teacher (seed.py --teacher oracle) knows the game: the route, where the book lay, after any failure
    oracle = analyzer.scripted_analysis(episode(False, missed, task="put a book in desk", info=info), 6, oracle=True)
    assert "key steps are: go to drawer 2 -> open drawer 2 -> take book 1 from drawer 2" in oracle["episode_skill"]
    assert "was not in" not in oracle["episode_skill"]


def test_oracle_and_hindsight_teachers_write_the_scripted_annotators_skills():
    """seed.py --teacher oracle / hindsight: every episode's skill, summary and step skills are the scripted
    annotator's (with oracle=True / False), the analyzer never runs, and only an algo whose skills are live
    accepts the flag."""
    from types import SimpleNamespace
    import seed
    plan = ["go to drawer 2", "open drawer 2", "take book 1 from drawer 2", "go to desk 1", "move book 1 to desk 1"]
    act = lambda a: (f"<think>t</think><action>{a}</action>", True, a)
    steps = [("You arrive at shelf 1. On the shelf 1, you see a pen 1.", *act("go to desk 1")),
             ("You arrive at desk 1. On the desk 1, you see a pen 2.", *act("go to shelf 1"))]
    info = {"expert_plan": plan, "hidden": True}
    for teacher in ("oracle", "hindsight"):
        eps = [episode(False, steps, task="put a book in desk", info=info), episode(True, steps, task="put a book in desk",
                                                                                   info=info)]
        cfg = seed.Config(env="alfworld", algo="opd_only", teacher=teacher, max_steps=6, max_step_skills=2)
        run = SimpleNamespace(cfg=cfg, engine=None, tok=None, rank=0)   # no engine: the analyzer must not run
        assert seed.teacher_skills(run, seed.ALGOS["opd_only"], eps) == {}
        for ep in eps:
            want = analyzer.scripted_analysis(ep, 6, 2, oracle=teacher == "oracle")
            assert (ep.skill, ep.summary, ep.step_skills) == (want["episode_skill"], want["episode_summary"],
                                                               want["step_skills"])
        assert ("take book 1 from drawer 2" in eps[0].skill) == (teacher == "oracle")
    with pytest.raises(SystemExit):
        seed.validate(seed.Config(env="sokoban", algo="grpo", teacher="oracle"))
    with pytest.raises(SystemExit):
        seed.validate(seed.Config(env="sokoban", algo="seed", teacher="expert"))


# ----------------------------------------------------------------------------- the external analyzer

class Server:
    """A local OpenAI-compatible endpoint that plays a script: ("status", code) | ("sleep", s) | ("text", t)."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                kind, value = outer.script.pop(0) if outer.script else ("status", 500)
                try:
                    if kind == "sleep":
                        time.sleep(value)
                        kind, value = "text", GOOD
                    if kind == "status":
                        self.send_response(value)
                        self.end_headers()
                        self.wfile.write(b'{"error": "busy"}')
                        return
                    payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": value}}]})
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(payload.encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_external_analyzer_errors_then_timeout_then_json(monkeypatch):
    """Transport retries (5xx, a timeout) are retried; an answer that does not parse is final by default (the
    authors' Stage 1: one request per episode), and with parse_retries=1 gets one corrective follow-up."""
    monkeypatch.setenv("SEED_TEST_KEY", "sk-secret-123")
    server = Server([("status", 500), ("status", 503), ("sleep", 3.0), ("text", "Sorry, I cannot."),
                     ("text", "Sorry, I cannot."), ("text", "```json\n" + GOOD + "\n```")])
    prompt = analyzer.analysis_prompt(episode(True, STEPS))
    try:
        client = analyzer.ExternalAnalyzer(server.url, "glm-test", api_key_env="SEED_TEST_KEY", timeout=1.0,
                                           retries=4, backoff=0.01, concurrency=2)
        t0 = time.time()
        assert client.annotate([prompt], progress=False) == [None] and len(server.requests) == 4
        assert time.time() - t0 < 10
        client.parse_retries = 1
        out = client.annotate([prompt], progress=False)
    finally:
        server.close()
    assert out == [json.loads(GOOD) | {"step_skills": {}}]
    assert len(server.requests) == 6
    path, headers, body = server.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-secret-123"
    assert body["model"] == "glm-test" and body["temperature"] == 0 and body["max_tokens"] == 1024
    assert body["messages"] == prompt
    last = server.requests[-1][2]["messages"]                              # the corrective follow-up
    assert last[-2] == {"role": "assistant", "content": "Sorry, I cannot."} and "could not be used" in last[-1]["content"]


def test_external_analyzer_unreachable_names_the_url_never_the_key(monkeypatch, capsys):
    monkeypatch.setenv("SEED_TEST_KEY", "sk-secret-123")
    with socket.socket() as s:                                             # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = analyzer.ExternalAnalyzer(f"http://127.0.0.1:{port}/v1", "m", api_key_env="SEED_TEST_KEY",
                                       timeout=0.2, retries=2, backoff=0.01)
    with pytest.raises(RuntimeError) as err:
        client.annotate([analyzer.analysis_prompt(episode(False, STEPS))], progress=False)
    msg = str(err.value)
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in msg and "3 attempts" in msg
    assert "sk-secret" not in msg and "sk-secret" not in repr(client.__dict__)
    assert "sk-secret" not in "".join(capsys.readouterr())
    server = Server([("status", 401)])                                     # a refusal is not retried
    try:
        client = analyzer.ExternalAnalyzer(server.url, "m", api_key_env="SEED_TEST_KEY", timeout=10, retries=3)
        with pytest.raises(RuntimeError, match="HTTP 401.*API key"):
            client.chat([{"role": "user", "content": "hi"}])
        assert len(server.requests) == 1
    finally:
        server.close()


# ----------------------------------------------------------------------------- the skill library

def test_skill_library_family_first_then_bm25(tmp_path):
    lib = analyzer.SkillLibrary()
    lib.add("alfworld", "heat", "heat some egg and put it in garbagecan", "Heat eggs in the microwave.")
    lib.add("alfworld", "heat", "heat some apple and put it in fridge", "Heat apples in the microwave.")
    lib.add("alfworld", "cool", "cool some egg and put it in garbagecan", "Cool eggs in the fridge.")
    lib.add("sokoban", "room", "push the box onto the target", "Never push the box into a corner.")
    lib.add("alfworld", "look", "look at apple under the desklamp", "")                  # empty: not kept
    path = tmp_path / "lib" / "skills.jsonl"
    lib.save(path)
    lib = analyzer.SkillLibrary.load(path)
    assert len(lib.entries) == 4
    # same family wins even though the cool task shares more words; BM25 decides inside the family
    assert lib.retrieve("alfworld", "heat", "cool some egg and put it in garbagecan") == "Heat eggs in the microwave."
    assert lib.retrieve("alfworld", "heat", "heat some apple and put it in countertop") == "Heat apples in the microwave."
    # unknown family: BM25 over all of the env's skills
    assert lib.retrieve("alfworld", "pick2", "put two egg in garbagecan, cool them") == "Cool eggs in the fridge."
    assert lib.retrieve("alfworld", "pick2", "zzz") is not None
    assert lib.retrieve("webshop", "any", "buy a shirt") is None
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        analyzer.SkillLibrary.load(tmp_path / "nowhere.jsonl")


@pytest.mark.parametrize("env_name", ["ezpoints", "sokoban"])
def test_library_with_every_task_returns_each_tasks_own_skill(env_name):
    """A library holding one skill per held-out task (filed as sft.py files them: analyzer.task_key of the
    real env's task text and first observation) returns each task's own skill through for_tasks, as the
    skill_prompt / skill_grpo baselines ask: EZPoints' card values are one-character tokens and every
    Sokoban room has the same task text (its key holds the board)."""
    env, ids = envs.make(env_name, split="test"), list(range(64))
    lib = analyzer.SkillLibrary()
    for t in ids:
        obs, _ = env.reset(seed=t)
        lib.add(env_name, env.family, analyzer.task_key(env_name, env.task, obs), f"skill of task {t}")
    assert lib.for_tasks(env, ids) == [f"skill of task {t}" for t in ids]


def test_library_bm25_sees_card_values():
    """Without an exact entry, BM25 over analyzer.words ranks by the card values (one-character tokens that
    bm25s.tokenize drops): a reworded EZPoints task gets the skill of the task with the same two values."""
    assert analyzer.words("the 2 of diamonds, 10 of clubs") == ["the", "2", "of", "diamonds", ",", "10", "of",
                                                                 "clubs"]
    env, lib, values = envs.make("ezpoints", split="train"), analyzer.SkillLibrary(), {}
    for t in range(40):
        env.reset(seed=t)
        lib.add("ezpoints", env.family, env.task, f"skill {t}")
        values[t] = sorted(w for w in analyzer.words(env.task) if w.isdigit() and w != "12")
    hits = 0
    for t in range(40):
        env.reset(seed=t)
        got = int(lib.retrieve("ezpoints", env.family, "please " + env.task).split()[1])
        hits += values[got] == values[t]
    assert hits == 40


# ----------------------------------------------------------------------------- critical-step skills

STEPPED = ('{"episode_summary": "It looped.", "episode_skill": "Find the apple first, then cool it in the fridge.", '
           '"step_skills": {"0": "Go to the countertop where apples usually are.", "2": "Take the apple before '
           'anything else.", "x": "Not a step number at all here.", "-1": "A negative step is not a step.", '
           '"7": "Step seven does not exist in this episode.", "1": "ok", " 1 ": "Write the action inside the '
           'action tags."}}')


def test_step_skills_parse_with_the_authors_keys_and_rules():
    """0-based string keys become ints; a key that is no number, a negative or out-of-range step, and a trivial
    value are dropped; the first max_step_skills kept, in the answer's order; episode_only keeps none."""
    out = analyzer.parse_analysis(STEPPED, skill_mode="episode_step", max_step_skills=5, n_steps=3)
    assert out["episode_skill"].startswith("Find the apple")
    assert out["step_skills"] == {0: "Go to the countertop where apples usually are.",
                                  2: "Take the apple before anything else.",
                                  1: "Write the action inside the action tags."}
    assert list(analyzer.parse_analysis(STEPPED, skill_mode="episode_step", max_step_skills=2,
                                        n_steps=3)["step_skills"]) == [0, 2]
    assert analyzer.parse_analysis(STEPPED, skill_mode="episode_only", max_step_skills=5)["step_skills"] == {}
    # step_only: the step skills are the analysis; no usable one, no analysis
    out = analyzer.parse_analysis(STEPPED, skill_mode="step_only", max_step_skills=5, n_steps=3)
    assert out["episode_skill"] == "" and list(out["step_skills"]) == [0, 2, 1]
    for bad in ('{"step_skills": {"9": "Out of range step skill here."}}', '{"step_skills": ["a", "b"]}',
                '{"episode_skill": "Find the apple first, then cool it."}', '{"step_skills": {"0": 5}}'):
        assert analyzer.parse_analysis(bad, skill_mode="step_only", max_step_skills=5, n_steps=3) is None
    # a malformed step_skills never costs the episode skill, and nothing raises
    for odd in ('[1, 2]', '"text"', 'null', '{"0": {"nested": 1}}', '{"0": ["Go to", "the fridge now."]}'):
        text = GOOD[:-1] + ', "step_skills": ' + odd + "}"
        out = analyzer.parse_analysis(text, skill_mode="episode_step", max_step_skills=5, n_steps=3)
        assert out["episode_skill"] == json.loads(GOOD)["episode_skill"]
        assert out["step_skills"] == ({0: "Go to the fridge now."} if "fridge now" in odd else {})
    for text in ("{", '{"step_skills": {"0": "Go', None, 42, "```json\n{]\n```"):
        assert analyzer.parse_analysis(text, skill_mode="episode_step", max_step_skills=5) is None


def test_analysis_prompt_asks_for_step_skills_by_mode():
    ep = episode(False, STEPS)
    ask = lambda mode, k: analyzer.analysis_prompt(ep, None, mode, k)[1]["content"]
    both = ask("episode_step", 5)
    assert '"episode_skill"' in both and '"step_skills": {"0":' in both and "at most 3 critical step(s)" in both
    assert "## Step 0\n" in both and "## Step 2\n" in both and "## Step 3" not in both
    assert '"step_skills"' not in ask("episode_only", 5) and '"step_skills"' not in ask("episode_step", 0)
    only = ask("step_only", 2)
    assert '"step_skills"' in only and '"episode_skill"' not in only and "at most 2 critical" in only


def test_scripted_analysis_writes_step_skills():
    """The scripted annotator marks where a failure left the expert plan, its invalid responses and repeats;
    a success's key moves. Each is one sentence the strict parse accepts, at most max_step_skills."""
    plan = ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1", "cool apple 1 with fridge 1"]
    steps = [STEPS[0], STEPS[1], ("Nothing happens.", "<action>go to countertop 1</action>", True, "go to countertop 1"),
             ("Nothing happens.", "<action>go to countertop 1</action>", True, "go to countertop 1")]
    out = analyzer.scripted_analysis(episode(False, steps, info={"expert_plan": plan}), max_step_skills=5)
    assert sorted(out["step_skills"]) == [1, 3]
    assert "take apple 1 from countertop 1" in out["step_skills"][1] and "repeat" in out["step_skills"][3]
    assert analyzer.parse_analysis(json.dumps(out), skill_mode="episode_step", max_step_skills=5, n_steps=4) == out
    assert list(analyzer.scripted_analysis(episode(False, steps, info={"expert_plan": plan}),
                                           max_step_skills=1)["step_skills"]) == [1]
    won = [STEPS[0], STEPS[2]]
    out = analyzer.scripted_analysis(episode(True, won, info={"expert_plan": plan}), max_step_skills=5)
    assert list(out["step_skills"]) == [1] and "take apple 1" in out["step_skills"][1]
    assert analyzer.scripted_analysis(episode(True, won, info={"expert_plan": plan}))["step_skills"] == {}


class SteppedEngine(RecordingEngine):
    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        ids = self.tok(STEPPED, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [(ids, [0.0] * len(ids)) for _ in prompt_ids_list]


def test_analyze_sets_step_skills(tokenizer):
    eps = [episode(False, STEPS), episode(False, STEPS[:1])]
    analyzer.analyze(SteppedEngine(tokenizer, 4096), tokenizer, eps, max_tokens=256, skill_mode="episode_step",
                     max_step_skills=5)
    assert eps[0].skill.startswith("Find the apple") and sorted(eps[0].step_skills) == [0, 1, 2]
    assert list(eps[1].step_skills) == [0]                               # a 1-step episode has step 0 only
    analyzer.analyze(SteppedEngine(tokenizer, 4096), tokenizer, eps, max_tokens=256, skill_mode="step_only",
                     max_step_skills=5)
    assert eps[0].skill is None and sorted(eps[0].step_skills) == [0, 1, 2]
