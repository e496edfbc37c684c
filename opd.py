"""The distillation half of the SEED objective: dual-context re-scoring, the sigmoid gate and the gated
on-policy distillation loss (Section 3.3, the OPD objective), as restated in docs/design-notes.md#formulas.

For every step of an episode whose analysis produced a skill, the SAME sampled response tokens are scored
twice by the snapshot pi_old: under the plain context h (the log-probs the trainer already has) and under
the skill-augmented context h~ = insert_skill(h, skill). No new tokens are sampled.

    delta = sg(lp_skill - lp)                    (the skill-induced log-prob gap)
    g     = sigmoid(beta * delta),  beta = 5     (the gate, detached)
    opd   = g * (sg(lp_skill) - lp)              (per token; d opd / d lp = -g)

In expectation over a ~ pi the logit of token v moves by pi(v) (g(v) - Z), Z = E_pi[g] (the expected logit
derivative, Appendix A, Eq. 10): tokens the hindsight supports more than average are promoted, the rest
suppressed, even when every reward in the group ties. The OPD term of the joint loss is the token mean of
`opd` over the tokens of rows with a skill (grpo.joint_loss).

Baselines (Appendix B.2; README says which parts are interpretations): `opsd_loss` (ungated on-policy
self-distillation: every token weighted by its own teacher/student log-ratio, i.e. the sampled gradient of
KL(pi || pi_skill); opsd, grpo_opsd, skill_sd) and `rlsd_weights` (RLSD's bounded per-token weight on the
GRPO loss); static skills only change where the skill string comes from (`analyzer.SkillLibrary`).
"""
import torch

import envs
import grpo
import rollout
import vision
from parallel import all_sum, gather, resolved_dtype


def gates(lp, lp_skill, beta=5.0):
    """The OPD gate: g = sigmoid(beta * (lp_skill - lp)), no gradient.  [rows, R] -> [rows, R]"""
    return torch.sigmoid(beta * (lp_skill - lp)).detach()


def opd_loss(lp, lp_skill, beta=5.0):
    """The gated OPD loss per token: g * (sg(lp_skill) - lp). Its gradient on lp is -g (a gate-weighted NLL of the
    policy's own sampled tokens); nothing flows into lp_skill or the gate.  [rows, R] -> [rows, R]"""
    g = gates(lp, lp_skill, beta)                                               # [rows, R]
    return g * (lp_skill.detach() - lp)                                         # [rows, R]


def opsd_loss(lp, lp_skill):
    """Ungated OPSD baseline: teacher = the same model with the skill in context, every token distilled.
    Per token: value k = sg(lp - lp_skill) (the sampled reverse-KL estimate), gradient on lp = k, so in
    expectation over a ~ pi it is the gradient of KL(pi || pi_skill). exp(lp - sg(lp)) is 1 in value and
    carries d lp.  [rows, R] -> [rows, R]
    (A literal "g = 1" in the OPD loss would give gradient -1 on every token: E_pi[-grad log pi] = 0, no teacher
    signal at all; the test suite checks both facts.)"""
    k = (lp - lp_skill).detach()                                                # [rows, R]
    return k * torch.exp(lp - lp.detach())                                      # [rows, R]


def rlsd_weights(lp, lp_skill, adv, eps=0.2, strength=1.0):
    """RLSD baseline (Yang et al. 2026, "Self-Distilled RLVR"): the reward sets each token's update
    direction, the teacher (same model, skill in context) its magnitude. Per token, no gradient:
        w = clip(exp(sign(A) * sg(lp_skill - lp)), 1 - eps, 1 + eps)
    multiplies the GRPO per-token loss: with A > 0 tokens the teacher favours are pushed up more, with A < 0
    tokens it disfavours are pushed down more. strength in [0, 1] scales w - 1 (annealed to 0, plain GRPO;
    the anneal is our reading of the SEED paper's baseline description). lp, lp_skill [rows, R], adv [rows]
    -> w [rows, R]"""
    s = torch.sign(adv).to(lp.dtype)[:, None]                                   # [rows, 1]
    w = torch.exp(s * (lp_skill - lp).detach()).clamp(1.0 - eps, 1.0 + eps)    # [rows, R]
    return 1.0 + strength * (w - 1.0)                                           # [rows, R]


TEACHER_MODES = ("step_priority", "additive")   # how a step skill and the episode skill share the teacher


def teacher_skills(episode, t, skill_mode="episode_only", teacher_mode="step_priority"):
    """The skills in step t's teacher context h~, as the authors' select_skill_teacher_sources:
    -> (episode skill or None, step skill or None), or None when the row gets no teacher (no OPD).
    episode_only: the episode skill; step_only: the step skill, where the step has one; episode_step with
    step_priority: the step skill where the step has one, else the episode skill; additive: both."""
    step = (episode.step_skills.get(t) or None) if skill_mode != "episode_only" else None
    ep_skill = (episode.skill or None) if skill_mode != "step_only" else None
    if skill_mode == "episode_step" and teacher_mode == "step_priority" and step:
        ep_skill = None
    return (ep_skill, step) if ep_skill or step else None


def row_teachers(episodes, cfg):
    """teacher_skills of every step row of `episodes` (in make_rows' order), by --skill_mode and
    --skill_teacher_mode."""
    return [teacher_skills(ep, t, cfg.skill_mode, cfg.skill_teacher_mode)
            for ep in episodes for t in range(len(ep.steps))]


def step_skill_metrics(episodes, teachers):
    """Over all ranks: step_skill_rate, the share of analyzed episodes (a skill parsed) with at least one step
    skill; step_skill_row_frac, the share of rows whose teacher context (row_teachers) holds a step skill."""
    analyzed = [ep for ep in episodes if ep.skill or ep.step_skills]
    n, with_steps, rows, step_rows = all_sum([len(analyzed), sum(bool(ep.step_skills) for ep in analyzed),
                                               len(teachers), sum(bool(k and k[1]) for k in teachers)])
    return {"step_skill_rate": with_steps / n if n else float("nan"),
            "step_skill_row_frac": step_rows / max(rows, 1)}


def skill_prompt_ids(tokenizer, step, skill):
    """The skill-augmented context h~ of one step, as chat token ids (through `rollout.chat_ids`). `skill`: the
    episode skill (a str) or an (episode skill, step skill) pair (teacher_skills). A visual step (its
    prompt_ids a vision.ImagePrompt) keeps its images; the skills are text, inserted the same way."""
    ep_skill, step_skill = skill if isinstance(skill, tuple) else (skill, None)
    text = envs.insert_skill(step.prompt_text, ep_skill, step_skill)
    if getattr(step.prompt_ids, "images", None):
        return vision.encode(vision.load_processor(step.prompt_ids.source), text, step.prompt_ids.images)
    return rollout.chat_ids(tokenizer, text)


def skill_prompts(tokenizer, steps, skills):
    """Each step's teacher context h~ as token ids (skill_prompt_ids); a step whose skill is None (or empty)
    keeps its plain prompt `step.prompt_ids` (an ImagePrompt keeps its images)."""
    return [skill_prompt_ids(tokenizer, s, k) if k else s.prompt_ids for s, k in zip(steps, skills)]


@torch.no_grad()
def rescore(model, tokenizer, rows, skills, micro_batch=8):
    """Log-probs of each row's sampled response under the skill-augmented context, no gradient.

    rows: list of rollout.Step; skills: one per row, a str (the episode skill), an (episode skill, step skill)
    pair (teacher_skills) or None. The response token ids are appended as they were sampled (never
    re-tokenized). Rows whose skill is None (or empty) are scored under their plain prompt, so their gate is
    0.5; the caller masks them out with its has-skill mask. grpo.batch_logprobs scores them (length-sorted
    micro-batches). -> lp_skill [rows, R] (R = longest response of `rows`, the layout of response_logprobs).
    """
    if len(skills) != len(rows):
        raise ValueError(f"need one skill (or None) per row: {len(rows)} rows, {len(skills)} skills")
    batch = grpo.Rows(skill_prompts(tokenizer, rows, skills), [list(s.response_ids) for s in rows])
    lps = grpo.batch_logprobs(model, batch, tokenizer.pad_token_id, micro_batch) if rows else []
    return grpo.pad(lps, max((len(r) for r in batch.responses), default=0)).to(model.device)   # [rows, R]


@torch.no_grad()
def rescore_rows(model, tokenizer, steps, skills, cfg):
    """Section 3.3: lp_skill of an update's rows that have a teacher (`skills`: one per row, as `rescore`
    takes them), sorted across the whole batch by prompt and skill characters, then response length, and
    scored by grpo.batch_logprobs; the other rows get zeros, which the has-skill mask removes from the loss."""
    todo = [i for i, k in enumerate(skills) if k]
    size = lambda k: sum(len(x or "") for x in (k if isinstance(k, tuple) else (k,)))
    order = sorted(todo, key=lambda i: (len(steps[i].prompt_text) + size(skills[i]), len(steps[i].response_ids)))
    batch = grpo.Rows(skill_prompts(tokenizer, steps, skills), [list(s.response_ids) for s in steps])
    lps = grpo.batch_logprobs(model, batch, tokenizer.pad_token_id, cfg.micro_batch_size, cfg.fsdp,
                              resolved_dtype(cfg), order)
    return [torch.zeros(len(s.response_ids)) if lp is None else lp for s, lp in zip(steps, lps)]


# ----------------------------------------------------------------------------- can the teacher teach? (diagnostics)

@torch.no_grad()
def shift_samples(lp, lp_skill, action, thought, adv, beta=5.0):
    """The teacher's shift on the student's own sampled tokens, per row: delta = lp_skill - lp on every response
    token, on the action tokens and on the thought tokens (envs.response_masks), and each row's mean gate over its
    response tokens (the tokens Eq. 7's loss weights) with its GRPO advantage. lp, lp_skill: one 1-D tensor per
    row; action, thought: one bool list per row; adv: one float per row. -> {"response": [delta], "action":
    [delta], "thought": [delta], "rows": [(gate, adv)]}, plain floats (so that ranks can gather them)."""
    out = {"response": [], "action": [], "thought": [], "rows": []}
    for p, s, am, tm, a in zip(lp, lp_skill, action, thought, adv):
        d = s.detach().float().cpu() - p.detach().float().cpu()                   # [tokens]
        am, tm = torch.tensor(am, dtype=torch.bool), torch.tensor(tm, dtype=torch.bool)
        out["response"] += d.tolist()
        out["action"] += d[am].tolist()
        out["thought"] += d[tm].tolist()
        if len(d):
            out["rows"].append((float(gates(torch.zeros_like(d), d, beta).mean()), float(a)))
    return out


def shift_metrics(samples, beta=5.0, big=0.5):
    """shift_samples (merged over ranks) -> delta_{action,thought}_{p5,p50,p95,mean}; gate_std_{action,response}
    (the std of g = sigmoid(beta delta) over action tokens, and over every response token: 0 when the skill
    changes nothing); action_shift_share (share of action tokens with |delta| > big); gate_adv_cov (covariance
    over rows of the row's mean gate and its advantage: > 0 when the teacher favours what won, the sample form of
    Eq. 8); action_tokens. nan where there is nothing to measure. Where the env's thought already names the move
    (EZPoints: "... so the next token is 8"), the action token is a copy and its delta is ~0 whatever the skill
    does: the skill's effect sits on the thought, and gate_std_response sees it."""
    nan = float("nan")
    out = {}
    for part in ("action", "thought"):
        d = torch.tensor(samples[part], dtype=torch.float64)                       # [tokens]
        q = torch.quantile(d, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist() if len(d) else [nan] * 3
        out |= {f"delta_{part}_p5": q[0], f"delta_{part}_p50": q[1], f"delta_{part}_p95": q[2],
                f"delta_{part}_mean": float(d.mean()) if len(d) else nan}
    for part in ("action", "response"):
        g = torch.sigmoid(beta * torch.tensor(samples.get(part, []), dtype=torch.float64))   # [tokens]
        out[f"gate_std_{part}"] = float(g.std(unbiased=False)) if len(g) else nan
    d = torch.tensor(samples["action"], dtype=torch.float64)                       # [action tokens]
    out["action_shift_share"] = float((d.abs() > big).double().mean()) if len(d) else nan
    rows = torch.tensor(samples["rows"], dtype=torch.float64).reshape(-1, 2)       # [rows, (gate, adv)]
    dev = rows - rows.mean(0) if len(rows) else rows                               # [rows, 2]
    out["gate_adv_cov"] = float((dev[:, 0] * dev[:, 1]).mean()) if len(rows) > 1 else nan
    out["action_tokens"] = len(d)
    return out


def teacher_diagnostics(tok, cfg, rows, lp_old, steps, teachers, groups):
    """Per update, over all ranks, after the update: diag/tied_groups (share of groups whose rewards all tie:
    GRPO's gradient is zero there) and, where a teacher was scored (`teachers` not None), shift_metrics of
    rows.lp_skill against the snapshot's `lp_old` on the rows with a teacher, under "diag/": delta percentiles on
    action and thought tokens, the gate's std on action tokens and on all response tokens, the share of action
    tokens with |delta| > 0.5, and the gate-advantage covariance."""
    tied, n = all_sum(list(grpo.tied_groups(rows.adv, groups)))
    out = {"diag/tied_groups": tied / n if n else float("nan")}
    if teachers is None:
        return out
    todo = [i for i, k in enumerate(teachers) if k]
    masks = [envs.response_masks(tok, steps[i].response_ids, cfg.env) for i in todo]
    local = shift_samples([lp_old[i] for i in todo], [rows.lp_skill[i] for i in todo], [m[0] for m in masks],
                          [m[1] for m in masks], [float(rows.adv[i]) for i in todo], cfg.beta_opd)
    merged = {k: [x for part in gather(local) for x in part[k]] for k in local}
    return out | {f"diag/{k}": v for k, v in shift_metrics(merged, cfg.beta_opd).items()}


def shown_rows(tok, rows, lp_old, steps, episodes, row_episode, beta=5.0, max_episodes=2):
    """A few rows of an update to show (runfolder.write_token_page, the demo's last lines): every step of up to
    `max_episodes` episodes with a skill (a won one and a lost one where both exist, each the one whose skill moved
    a token most), each response token with its text, the snapshot's lp, the teacher's lp_skill and the gate
    g = sigmoid(beta (lp_skill - lp)). -> [{"episode", "task", "won", "skill", "step", "action", "adv",
    "tokens": [[text, lp, lp_skill, g]]}], plain values (JSON); [] when nothing was re-scored."""
    if rows.lp_skill is None:
        return []
    moved = {}   # episode index -> the largest |lp_skill - lp| over its rows
    for i, e in enumerate(row_episode):
        if episodes[e].skill and len(rows.lp_skill[i]):
            d = (rows.lp_skill[i].float().cpu() - lp_old[i].detach().float().cpu()).abs()   # [tokens]
            moved[e] = max(moved.get(e, 0.0), float(d.max()))
    pick = []
    for won in (True, False):   # the episode of each outcome whose skill moved a token most
        best = sorted((e for e in moved if episodes[e].won == won), key=lambda e: -moved[e])
        pick += best[:1]
    out = []
    for e in pick[:max_episodes]:
        for i in (i for i, r in enumerate(row_episode) if r == e):
            lp, ls = lp_old[i].detach().float().cpu(), rows.lp_skill[i].float().cpu()   # [tokens] each
            g = gates(lp, ls, beta)                                                      # [tokens]
            text, spans = envs.token_spans(tok, list(steps[i].response_ids))
            out.append({"episode": e, "task": episodes[e].task, "won": bool(episodes[e].won),
                        "skill": episodes[e].skill, "step": i - row_episode.index(e), "action": steps[i].action,
                        "adv": float(rows.adv[i]),
                        "tokens": [[text[s:t], round(float(a), 4), round(float(b), 4), round(float(c), 4)]
                                   for (s, t), a, b, c in zip(spans, lp, ls, g)]})
    return out
