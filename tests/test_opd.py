"""opd.py: the gate and the OPD gradient by hand, the paper's expected-gradient claim by exact enumeration
over a small vocabulary (and GRPO's zero gradient on a tied group), and dual-context re-scoring with the
embedded SmolLM2 tokenizer, chat template and weights."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import diagnostics  # noqa: E402
import envs  # noqa: E402
import grpo  # noqa: E402
import opd  # noqa: E402
import rollout  # noqa: E402
from rollout import Step  # noqa: E402


# ----------------------------------------------------------------------------- gate and loss

def test_gates_hand_computed():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    lp_skill = torch.tensor([[-1.0, -1.8, -0.9]])
    g = opd.gates(lp, lp_skill)                                    # sigmoid(5 * [0, 0.2, -0.4])
    assert torch.allclose(g, torch.tensor([[0.5, 0.7310586, 0.1192029]]), atol=1e-6)
    assert torch.allclose(opd.gates(lp, lp_skill, beta=1.0), torch.sigmoid(lp_skill - lp))


def test_opd_gradient_is_minus_gate_over_tokens():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -9.0]], requires_grad=True)
    lp_skill = torch.tensor([[-0.2, -2.5, -0.5], [-1.0, -3.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    g = opd.gates(lp, lp_skill)
    assert not g.requires_grad                                     # the gate is a constant
    per_token = opd.opd_loss(lp, lp_skill)
    assert torch.allclose(per_token, g * (lp_skill - lp))
    grpo.masked_mean(per_token, mask).backward()
    assert torch.allclose(lp.grad, -g * mask / 5)                  # d L / d lp = -g / num_tokens
    assert lp_skill.grad is None or (lp_skill.grad == 0).all()     # nothing reaches the teacher side


def _expected_grad(loss_fn, z, lp_skill):
    """Exact E_{a ~ pi}[d loss(a) / d z] over the whole vocabulary (pi is the sampling law: no gradient)."""
    z = z.clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)                                  # [V]
    pi = lp.exp().detach()                                         # [V]
    per_token = loss_fn(lp[None], lp_skill[None])[0]               # [V]: the loss had token v been sampled
    (pi * per_token).sum().backward()
    return z.grad, pi


def test_expected_opd_gradient_matches_the_paper():
    torch.manual_seed(0)
    V = 6
    z = torch.randn(V, dtype=torch.float64)
    lp_skill = torch.log_softmax(z + torch.tensor([1.5, -1.0, 0.0, 0.3, -2.0, 0.8], dtype=torch.float64), -1)
    grad, pi = _expected_grad(opd.opd_loss, z, lp_skill)
    g = opd.gates(torch.log_softmax(z, -1), lp_skill)              # [V]
    Z = (pi * g).sum()
    assert torch.allclose(grad, -pi * (g - Z), atol=1e-12)         # descent moves logit v by +pi(v)(g(v) - Z)
    promoted = g > Z
    assert promoted.any() and (~promoted).any()
    assert (grad[promoted] < 0).all() and (grad[~promoted] > 0).all()


def test_tied_group_grpo_gradient_zero_opd_not():
    """A group of N = V samples, one per vocabulary token, weighted by pi (exact expectation); all rewards
    tie, so GRPO's advantage and gradient are exactly zero while OPD's is not."""
    torch.manual_seed(1)
    V = 5
    z = torch.randn(V, dtype=torch.float64, requires_grad=True)
    lp = torch.log_softmax(z, -1)[:, None]                         # [rows = V, 1]: row v sampled token v
    pi = lp.exp().detach()                                         # [V, 1]
    lp_skill = (lp.detach() + torch.tensor([[0.7], [-0.4], [0.1], [0.0], [-1.2]], dtype=torch.float64))
    adv = grpo.group_advantages([10.0] * V, [0] * V)
    assert torch.equal(adv, torch.zeros(V))
    pg = grpo.policy_loss(lp, lp.detach(), adv.double(), torch.ones_like(lp))
    g_pg, = torch.autograd.grad((pi * pg).sum(), z, retain_graph=True)
    g_opd, = torch.autograd.grad((pi * opd.opd_loss(lp, lp_skill)).sum(), z)
    assert torch.equal(g_pg, torch.zeros(V, dtype=torch.float64))
    assert g_opd.abs().max() > 1e-3


def test_opsd_variants_by_enumeration():
    """The ungated OPSD baseline's expected gradient is that of KL(pi || pi_skill); a literal gate g = 1
    would carry no signal at all (E_pi[grad log pi] = 0)."""
    torch.manual_seed(2)
    V = 6
    z = torch.randn(V, dtype=torch.float64)
    lp_skill = torch.log_softmax(torch.randn(V, dtype=torch.float64), -1)
    grad, pi = _expected_grad(opd.opsd_loss, z, lp_skill)
    zz = z.clone().requires_grad_(True)
    p = torch.softmax(zz, -1)
    kl_grad, = torch.autograd.grad((p * (p.log() - lp_skill)).sum(), zz)
    assert torch.allclose(grad, kl_grad, atol=1e-12)
    assert torch.allclose(opd.opsd_loss(z[None], lp_skill[None]), (z - lp_skill)[None])   # value: log-ratio
    ones, _ = _expected_grad(lambda lp, ls: ls.detach() - lp, z, lp_skill)
    assert ones.abs().max() < 1e-12


def test_rlsd_weights_hand_computed():
    """RLSD: w = clip(exp(sign(A) (lp_skill - lp)), 1 - eps, 1 + eps), no gradient; strength scales w - 1."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]], requires_grad=True)
    lp_skill = torch.tensor([[-0.9, -3.0, -0.5], [-0.9, -3.0, -0.5]])              # gaps 0.1, -1.0, 0
    w = opd.rlsd_weights(lp, lp_skill, torch.tensor([2.0, -0.5]), eps=0.2)
    e = math.exp(0.1)
    assert torch.allclose(w, torch.tensor([[e, 0.8, 1.0], [1 / e, 1.2, 1.0]]), atol=1e-6)   # A > 0 row, A < 0 row
    assert not w.requires_grad
    half = opd.rlsd_weights(lp, lp_skill, torch.tensor([2.0, -0.5]), eps=0.2, strength=0.5)
    assert torch.allclose(half, 1 + 0.5 * (w - 1)) and torch.equal(
        opd.rlsd_weights(lp, lp_skill, torch.tensor([2.0, -0.5]), strength=0.0), torch.ones(2, 3))
    assert torch.equal(opd.rlsd_weights(lp, lp_skill, torch.zeros(2)), torch.ones(2, 3))    # A = 0: plain GRPO


# ----------------------------------------------------------------------------- re-scoring with SmolLM2

PROMPT = ("Your task is to: put a clean apple in fridge.\n"
          "You see a countertop 1, a fridge 1 and a sinkbasin 1.\n"
          "Admissible actions: [go to countertop 1, go to fridge 1, go to sinkbasin 1, look].\n"
          "Now it's your turn: think in <think> </think>, then act in <action> </action>.")
SKILL = "Find the apple first, clean it at the sinkbasin, then open the fridge and put it in."


def _steps(tok):
    texts = ["<think>I need the apple.</think><action>go to countertop 1</action>",
             "<think>ok</think><action>look</action>",
             "<think>The apple may be on the countertop, so I go there first and check.</think>"
             "<action>go to countertop 1</action>"]
    steps = []
    for k, text in enumerate(texts):
        prompt_text = PROMPT.replace("apple", ["apple", "egg", "tomato"][k])
        pieces = [text] if k != 1 else ["<think>ok</think><action>lo", "ok</action>"]   # "lo" + "ok":
        ids = sum((tok(p, add_special_tokens=False)["input_ids"] for p in pieces), []) + [tok.eos_token_id]
        steps.append(Step(prompt_text=prompt_text, prompt_ids=rollout.chat_ids(tok, prompt_text),
                          response_ids=ids, response_text=tok.decode(ids), engine_logprobs=[0.0] * len(ids),
                          observation="", action="", valid=True))
    # row 1 is a non-canonical tokenization: decoding and re-tokenizing it would change its ids
    assert tok(steps[1].response_text, add_special_tokens=False)["input_ids"] != steps[1].response_ids
    return steps


def _naive(model, prompt, response):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_rescore_same_tokens_skill_after_task_line(smol):
    model, tok = smol
    steps = _steps(tok)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append((kw["input_ids"].clone(),
                                                                           kw["attention_mask"].clone())),
                                           with_kwargs=True)
    try:
        lp_skill = opd.rescore(model, tok, steps, [SKILL, None, SKILL], micro_batch=2)
    finally:
        hook.remove()
    R = max(len(s.response_ids) for s in steps)
    assert lp_skill.shape == (3, R) and not lp_skill.requires_grad
    # what the model saw: each row = the skill prompt's chat ids + the SAME response ids
    fed = [ids[am.bool()].tolist() for ids_b, am_b in seen for ids, am in zip(ids_b, am_b)]
    for s, skill in zip(steps, [SKILL, None, SKILL]):
        prompt = opd.skill_prompt_ids(tok, s, skill) if skill else s.prompt_ids
        assert prompt + s.response_ids in fed
    # the skill appears once, on the line right after the task line, in the chat-templated text
    text = tok.decode(opd.skill_prompt_ids(tok, steps[0], SKILL))
    assert text.count(SKILL) == 1
    lines = text.split("\n")
    at = next(i for i, ln in enumerate(lines) if ln.startswith("Your task is to:"))
    assert lines[at + 1:at + 6] == [""] + envs.skill_section(envs.EPISODE_SKILL, SKILL).split("\n") + [""]
    # the values: equal to a naive unpadded per-row computation
    for i, (s, skill) in enumerate(zip(steps, [SKILL, None, SKILL])):
        prompt = opd.skill_prompt_ids(tok, s, skill) if skill else s.prompt_ids
        n = len(s.response_ids)
        assert (lp_skill[i, :n].double() - _naive(model, prompt, s.response_ids)).abs().max() < 1e-4
        assert (lp_skill[i, n:] == 0).all()


def test_rescore_empty_skill_equals_plain_and_skill_changes_it(smol):
    model, tok = smol
    steps = _steps(tok)
    plain, mask, _ = grpo.response_logprobs(model, [s.prompt_ids for s in steps],
                                            [s.response_ids for s in steps], tok.pad_token_id)
    lp = opd.rescore(model, tok, steps, ["", None, "   "], micro_batch=8)
    assert (lp - plain).abs().max() < 1e-5
    lp = opd.rescore(model, tok, steps, [SKILL] * 3, micro_batch=1)
    assert (lp - plain).abs().max() > 1e-2                         # the skill does change the scores
    g = opd.gates(plain, lp)
    assert ((g * mask) != 0.5 * mask).any()
    with pytest.raises(ValueError):
        opd.rescore(model, tok, steps, [SKILL])


# ----------------------------------------------------------------------------- critical-step skills in the teacher

def _analyzed(skill, step_skills, n=3):
    ep = rollout.Episode(task_id=0, group_id=0, env="alfworld", task="heat an apple", skill=skill,
                         step_skills=dict(step_skills))
    ep.steps = [Step(prompt_text=PROMPT, prompt_ids=[], response_ids=[1], response_text="", engine_logprobs=[0.0],
                     observation="", action="", valid=True) for _ in range(n)]
    return ep


@pytest.mark.parametrize("mode,teacher,want", [
    # (skill_mode, skill_teacher_mode, the teacher of steps 0, 1, 2 when step 1 has a step skill)
    ("episode_step", "step_priority", [("E", None), (None, "S1"), ("E", None)]),
    ("episode_step", "additive", [("E", None), ("E", "S1"), ("E", None)]),
    ("step_only", "step_priority", [None, (None, "S1"), None]),
    ("step_only", "additive", [None, (None, "S1"), None]),
    ("episode_only", "step_priority", [("E", None)] * 3),
    ("episode_only", "additive", [("E", None)] * 3),
])
def test_teacher_skills_follow_the_authors_selection(mode, teacher, want):
    """The cases of the authors' select_skill_teacher_sources tests: step_priority scores a step with its step
    skill when it has one and with the episode skill otherwise; additive with both; step_only only the steps
    that have a step skill (no episode fallback); episode_only never the step skill. An unanalyzed episode
    (skill None, no step skills) has no teacher."""
    ep = _analyzed("E", {1: "S1"})
    cfg = type("Cfg", (), {"skill_mode": mode, "skill_teacher_mode": teacher})
    assert opd.row_teachers([ep], cfg) == want
    assert opd.row_teachers([_analyzed(None, {})], cfg) == [None] * 3


def test_teacher_context_holds_the_chosen_sections(tokenizer):
    """The re-scoring context of each mode: step_priority's step row holds the step section only, additive's
    both (episode after the task line, step before the turn instruction), an episode row the episode one."""
    ep = _analyzed("Heat the apple in the microwave first.", {1: "Open the microwave now."})
    step = ep.steps[1]
    text = lambda sk: tokenizer.decode(opd.skill_prompt_ids(tokenizer, step, sk))
    cfg = lambda mode, teacher: type("Cfg", (), {"skill_mode": mode, "skill_teacher_mode": teacher})
    prio = text(opd.row_teachers([ep], cfg("episode_step", "step_priority"))[1])
    assert "Critical-Step Skill" in prio and "Open the microwave now." in prio and "Episode-Level Skill" not in prio
    both = text(opd.row_teachers([ep], cfg("episode_step", "additive"))[1])
    assert both.index("Your task is to:") < both.index("Episode-Level Skill") < both.index("Critical-Step Skill")
    assert both.index("Critical-Step Skill") < both.index("Now it's your turn")
    plain = text(opd.row_teachers([ep], cfg("episode_step", "step_priority"))[0])
    assert "Episode-Level Skill" in plain and "Critical-Step Skill" not in plain
    assert text("Heat the apple in the microwave first.") == plain                # a str is the episode skill


def test_a_one_token_decision_shows_in_the_row_statistics_not_the_percentiles():
    """A hidden room's decision is one token of a ~33-token response (the receptacle's name in the thought; the
    action copies it): a skill that moves only that token (delta +3 on 1 of 24 thought tokens, 0 elsewhere) leaves
    the thought's p5 / p95 at 0 and the gate's std under the old verdict's 0.1, while every row's largest |delta|
    exceeds 0.5 (row_shift_share 1) and the unsure tokens (p < 0.5) carry the shift; a skill that moves nothing
    scores 0 on all of them."""
    n, T, decision = 32, 33, 5
    thought = [[t < 24 for t in range(T)]] * n
    action = [[t >= 28 for t in range(T)]] * n
    lp = [torch.full((T,), -0.05) for _ in range(n)]
    for x in lp:
        x[decision] = math.log(0.3)                              # the student was unsure at the decision
    moved = [x.clone() for x in lp]
    for x in moved:
        x[decision] += 3.0
    m = diagnostics.shift_metrics(diagnostics.shift_samples(lp, moved, action, thought, [0.0] * n), beta=5.0)
    assert m["delta_thought_p95"] == pytest.approx(0.0) and m["delta_thought_p5"] == pytest.approx(0.0)
    assert m["gate_std_response"] < 0.1 and m["action_shift_share"] == 0.0
    assert m["row_shift_share"] == 1.0 and m["thought_row_shift_share"] == 1.0 and m["row_max_delta_p50"] == pytest.approx(3.0)
    assert m["unsure_tokens"] == n and m["unsure_shift_share"] == 1.0 and m["delta_unsure_abs_mean"] == pytest.approx(3.0)
    still = diagnostics.shift_metrics(diagnostics.shift_samples(lp, lp, action, thought, [0.0] * n), beta=5.0)
    assert still["row_shift_share"] == still["unsure_shift_share"] == still["row_max_delta_p50"] == 0.0
    assert still["gate_mean_response"] == pytest.approx(0.5)


def test_the_gradient_split_at_decision_tokens():
    """diagnostics.gradient_split: c (1 - p) is the derivative of c * lp on the sampled token's own logit (checked
    by autograd); the teacher that moves only the decision token puts all of OPD's skill-dependent mass there, up
    where the row won and down where it lost (decision_agree 1 against GRPO's advantages), nothing of it in a
    tied group; a teacher that moves nothing leaves OPD only its imitation part (opd_skill_mass 0)."""
    z = torch.randn(7, requires_grad=True)
    c, y = 0.37, 3
    (c * torch.log_softmax(z, -1)[y]).backward()
    assert float(z.grad[y]) == pytest.approx(c * (1 - float(torch.softmax(z.detach(), -1)[y])), rel=1e-5)

    T, decision = 10, 4
    thought, action = [[t < 8 for t in range(T)]] * 4, [[t >= 8 for t in range(T)]] * 4
    lp = [torch.full((T,), -0.05) for _ in range(4)]
    for x in lp:
        x[decision] = math.log(0.3)
    adv = [1.0, -1.0, 1.0, -1.0]                                 # rows 0, 2 won, rows 1, 3 lost
    moved = [x.clone() for x in lp]
    for x, a in zip(moved, adv):
        x[decision] += 2.0 if a > 0 else -2.0                    # the oracle agrees with the outcome
    m = diagnostics.gradient_split(diagnostics.shift_samples(lp, moved, action, thought, adv), beta=5.0)
    assert m["decision_token_share"] == pytest.approx(1 / T) and m["decision_agree"] == 1.0
    assert m["decision_tied_share"] == 0.0 and 0 < m["opd_skill_mass"] < 1
    ratio = abs(float(torch.sigmoid(torch.tensor(10.0))) - 0.5)   # |g - Z| at a decision token (Z = 0.5 here)
    assert m["decision_opd_over_pg"] == pytest.approx(ratio, rel=0.02)
    tied = diagnostics.gradient_split(diagnostics.shift_samples(lp, moved, action, thought, [0.0] * 4), beta=5.0)
    assert tied["decision_tied_share"] == 1.0 and math.isnan(tied["decision_agree"])
    still = diagnostics.gradient_split(diagnostics.shift_samples(lp, lp, action, thought, adv), beta=5.0)
    assert still["opd_skill_mass"] == 0.0 and still["decision_token_share"] == 0.0
