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
from parallel import autocast, chunked, resolved_dtype


def gates(lp_skill, lp, beta=5.0):
    """The OPD gate: g = sigmoid(beta * (lp_skill - lp)), no gradient.  [rows, R] -> [rows, R]"""
    return torch.sigmoid(beta * (lp_skill - lp)).detach()


def opd_loss(lp, lp_skill, beta=5.0):
    """The gated OPD loss per token: g * (sg(lp_skill) - lp). Its gradient on lp is -g (a gate-weighted NLL of the
    policy's own sampled tokens); nothing flows into lp_skill or the gate.  [rows, R] -> [rows, R]"""
    g = gates(lp_skill, lp, beta)                                               # [rows, R]
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


def skill_prompt_ids(tokenizer, step, skill, env_name):
    """The skill-augmented context h~ of one step, as chat token ids (through `rollout.chat_ids`). A visual
    step (its prompt_ids a vision.ImagePrompt) keeps its images; the skill is text, inserted the same way."""
    text = envs.insert_skill(step.prompt_text, skill, env_name)
    if getattr(step.prompt_ids, "images", None):
        return vision.encode(vision.load_processor(step.prompt_ids.source), text, step.prompt_ids.images)
    return rollout.chat_ids(tokenizer, text)


@torch.no_grad()
def rescore(model, tokenizer, rows, skills, env_names, micro_batch=8):
    """Log-probs of each row's sampled response under the skill-augmented context, no gradient.

    rows: list of rollout.Step; skills: one str or None per row; env_names: one env name per row (or one
    str for all). The response token ids are appended as they were sampled (never re-tokenized). Rows
    whose skill is None (or empty) are scored under their plain prompt `step.prompt_ids`, so their gate is
    0.5; the caller masks them out with its has-skill mask. Rows are sorted by length and scored in
    micro-batches through `grpo.response_logprobs`.
    -> lp_skill [rows, R] (R = longest response of `rows`, the same layout as response_logprobs on them).
    """
    if len(skills) != len(rows):
        raise ValueError(f"need one skill (or None) per row: {len(rows)} rows, {len(skills)} skills")
    names = [env_names] * len(rows) if isinstance(env_names, str) else list(env_names)
    prompts = [skill_prompt_ids(tokenizer, s, k, n) if k else s.prompt_ids   # an ImagePrompt keeps its images
               for s, k, n in zip(rows, skills, names)]
    responses = [list(s.response_ids) for s in rows]
    R = max((len(r) for r in responses), default=0)
    out = torch.zeros(len(rows), R, device=model.device)                        # [rows, R]
    order = sorted(range(len(rows)), key=lambda i: (len(prompts[i]), len(responses[i])))
    for b in range(0, len(order), micro_batch):
        idx = order[b:b + micro_batch]
        lp, _, _ = grpo.response_logprobs(model, [prompts[i] for i in idx], [responses[i] for i in idx],
                                          tokenizer.pad_token_id)              # [mb, R_mb]
        out[idx, :lp.shape[1]] = lp
    return out


@torch.no_grad()
def rescore_rows(model, tokenizer, steps, skills, cfg, device):
    """Section 3.3: lp_skill of an update's rows whose episode has a skill (rescore, one forward per chunk);
    the other rows get zeros, which the has-skill mask removes from the loss."""
    out = [torch.zeros(len(s.response_ids)) for s in steps]
    todo = [i for i, k in enumerate(skills) if k]
    # sorted across the whole batch (prompt + skill characters, then response): chunks of similar lengths
    todo = sorted(todo, key=lambda i: (len(steps[i].prompt_text) + len(skills[i]), len(steps[i].response_ids)))
    for idx in chunked(len(todo), cfg.micro_batch_size, cfg.fsdp):
        rows = [todo[j] for j in idx] if idx else [0]   # FSDP filler forward; result dropped
        with autocast(device, resolved_dtype(cfg)):
            lp = rescore(model, tokenizer, [steps[i] for i in rows], [skills[i] for i in rows], cfg.env,
                         micro_batch=cfg.micro_batch_size)                                # [mb, R]
        if idx:
            for i, t in zip(rows, grpo.trim(lp, [len(steps[i].response_ids) for i in rows])):
                out[i] = t
    return out
