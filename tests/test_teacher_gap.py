"""The teacher-gap check (bench/teacher_gap.py) and the action/thought split of a response (envs.response_masks),
with a scripted engine on EZPoints and a tiny random model for the teacher-forced scores."""
import json
import math
import os
import random
import re
import sys

import pytest
import torch

import envs
from envs import ezpoints

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import teacher_gap  # noqa: E402

TOKEN = re.compile(r"10|[1-9]|\+|\*|=")


class SkillReader:
    """A scripted policy for EZPoints: when the actor prompt carries a skill block naming the solution
    ("... workflow: 4 -> + -> 8 -> =" / "... key steps are: ..."), it plays that solution's next token; otherwise
    a random token. As the analyzer (an analysis prompt) it writes the solution as a workflow skill, read from
    the episode's cards. generate() returns real token ids of the given tokenizer."""

    def __init__(self, tok, seed=0, max_model_len=4096):
        self.tok, self.rng, self.max_model_len = tok, random.Random(seed), max_model_len
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")

    def reply(self, text):
        if "# Your job" in text:   # the analysis prompt
            values = [int(v) for v in re.findall(r"\(value (\d+)\)", text)[:2]]
            sol = ezpoints.solutions(values)[0]
            skill = ("For tasks like this one, write the card values and operators in the right order, as in "
                     f"this workflow: {' -> '.join(sol + ['='])}.")
            return json.dumps({"episode_summary": "done", "episode_skill": skill})
        formula = re.findall(r"Formula so far: (.*)", text)[-1].strip()
        written = [] if formula.startswith("(empty)") else formula.split()
        named = re.search(r"(?:workflow|key steps are): ([^.]*)", text) if envs.EPISODE_SKILL[0] in text else None
        plan = TOKEN.findall(named.group(1)) if named else []
        action = plan[len(written)] if len(written) < len(plan) else self.rng.choice(ezpoints.TOKENS)
        return json.dumps({"thoughts": "I pick the next token.", "action": action})

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        out = []
        for ids in prompt_ids_list:
            for _ in range(n):
                toks = self.tok.encode(self.reply(self.tok.decode(ids)), add_special_tokens=False)
                out.append((toks + [self.eos], [-1.0] * (len(toks) + 1)))
        return out


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    """A 2-layer random Llama with the embedded model's vocabulary: real log-probs, fast."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()


def config(*extra):
    return teacher_gap.parse_config(["--env", "ezpoints", "--tasks", "4", "--group_size", "2", "--max_steps", "4",
                                     "--history_length", "0", "--max_tokens", "48", "--analyzer_max_tokens", "128",
                                     "--micro_batch_size", "4", "--out", "/nonexistent", *extra])


def test_response_masks_find_the_action_and_the_thought(tokenizer):
    for env, text, action, thought in (
            ("ezpoints", '{"thoughts": "4 + 8 = 12, so 8", "action": "8"}', "8", "4 + 8 = 12, so 8"),
            ("sokoban", "<think>the box is left</think><action>left</action>", "left", "the box is left")):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        act, th = envs.response_masks(tokenizer, ids, env)
        assert len(act) == len(th) == len(ids) and not act[-1] and not th[-1]   # the end-of-turn token is neither
        assert tokenizer.decode([t for t, m in zip(ids, act) if m]).strip(' "') == action
        assert thought in tokenizer.decode([t for t, m in zip(ids, th) if m])
        assert not any(a and b for a, b in zip(act, th))
    act, th = envs.response_masks(tokenizer, tokenizer.encode("no format at all", add_special_tokens=False), "sokoban")
    assert not any(act) and not any(th)                                          # invalid: no action tokens


def test_a_skill_reading_policy_has_a_positive_gap(tokenizer, tiny_model):
    cfg = config()
    res, student = teacher_gap.measure(SkillReader(tokenizer), tiny_model, tokenizer, cfg)
    assert res["tasks"] == 4 and res["samples"] == 2 and len(student) == 8
    assert res["skill_rate"]["own"] == 1.0 and all(ep.skill for ep in student)
    assert res["student"] < 0.5 and res["own"] == res["oracle"] == 1.0          # random without, the solution with
    assert res["gap_own"] > 0.5 and res["gap_oracle"] > 0.5 and res["se_own"] >= 0
    assert res["after_own"]["lost"] == res["after_oracle"]["lost"] == 1.0            # a lost episode's skill names the solution too
    for name in ("own", "oracle"):
        s = res["shift"][name]
        assert s["action_tokens"] > 0 and s["gate_std_action"] > 0               # another context, other log-probs
        assert s["gate_std_response"] > 0
        assert 0 <= s["action_shift_share"] <= 1 and s["delta_action_p5"] <= s["delta_action_p50"] <= s["delta_action_p95"]
    assert 0 <= res["tied_groups"] <= 1
    text = teacher_gap.table(res, cfg)
    assert "(b) own hindsight skill" in text and "verdict: teacher gap (own skill) +" in text and "after won" in text


def test_a_skill_that_changes_nothing_has_no_signal(tokenizer, tiny_model, monkeypatch):
    monkeypatch.setattr(envs, "insert_skill", lambda prompt, skill, step_skill=None: prompt)
    cfg = config("--seed", "1")
    res, _ = teacher_gap.measure(SkillReader(tokenizer, seed=1), tiny_model, tokenizer, cfg)
    for name in ("own", "oracle"):
        s = res["shift"][name]
        assert s["action_tokens"] > 0 and s["rows"] > 0
        for k in ("delta_action_p5", "delta_action_p50", "delta_action_p95", "delta_action_mean", "delta_thought_p50",
                  "gate_std_action", "gate_std_response", "action_shift_share", "gate_adv_cov"):
            assert s[k] == 0.0, (name, k, s[k])
    assert not res["signal"] and "OPD has no signal" in res["verdict"]
    few, _ = teacher_gap.measure(SkillReader(tokenizer, seed=1), tiny_model, tokenizer, config("--shift_rows", "3"))
    assert few["shift"]["own"]["rows"] == few["shift"]["oracle"]["rows"] == 3      # (d) on a sample of the rows
    assert not math.isnan(res["gap_own"])


def test_bad_flags_stop_at_start_up():
    for flags in (["--group_size", "1"], ["--split", "nosuchsplit"], ["--init", "/nonexistent"], ["--tasks", "0"]):
        with pytest.raises(SystemExit):
            config(*flags)
