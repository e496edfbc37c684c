"""Per-update diagnostics, beside the loop and not part of the method: can the teacher teach (Section 3.3's
skill-conditioned teacher against the student)? The share of tied groups (GRPO's gradient is zero there), the
teacher's shift delta = lp_skill - lp on the student's own sampled tokens (per token, and per row for a decision of
one or two tokens), the gate's spread and its covariance with the advantage (the sample form of Appendix A, Eq. 8),
how often the analyzer wrote critical-step skills, and how far the rollout engine's log-probs are from the
trainer's. seed.py calls them after each update (metrics.jsonl's diag/*), bench/teacher_gap.py before training.
"""
import math

import torch

import envs
import grpo
from opd import gates
from parallel import all_sum, gather


def step_skill_metrics(episodes, teachers):
    """Over all ranks: step_skill_rate, the share of analyzed episodes (a skill parsed) with at least one step
    skill; step_skill_row_frac, the share of rows whose teacher context (row_teachers) holds a step skill."""
    analyzed = [ep for ep in episodes if ep.skill or ep.step_skills]
    n, with_steps, rows, step_rows = all_sum([len(analyzed), sum(bool(ep.step_skills) for ep in analyzed),
                                               len(teachers), sum(bool(k and k[1]) for k in teachers)])
    return {"step_skill_rate": with_steps / n if n else float("nan"),
            "step_skill_row_frac": step_rows / max(rows, 1)}


def engine_gap(engine_lp, lp_old):
    """diag/engine_lp_diff_{mean,max}: |engine log-prob - the trainer's log pi_old| over every response token of
    every rank. The engine sampled with the same weights: 0 up to rounding in float32, about 0.1-0.3 in bf16; a
    larger gap makes the ratio off-policy (--tis_cap corrects it)."""
    d = [(e.float() - o.detach().float().cpu()).abs() for e, o in zip(engine_lp, lp_old) if len(e)]   # [tokens] each
    total, n = all_sum([float(sum(x.sum() for x in d)), float(sum(len(x) for x in d))])
    top = max(gather(max((float(x.max()) for x in d), default=0.0)))
    return {"diag/engine_lp_diff_mean": total / n if n else float("nan"),
            "diag/engine_lp_diff_max": top if n else float("nan")}


@torch.no_grad()
def shift_samples(lp, lp_skill, action, thought, adv, beta=5.0):
    """The teacher's shift on the student's own sampled tokens, per row: delta = lp_skill - lp on every response
    token, on the action tokens and on the thought tokens (envs.response_masks), and each row's mean gate over its
    response tokens (the tokens Eq. 7's loss weights) with its GRPO advantage; for a decision made in one or two
    tokens, which percentiles over all tokens miss, each row's largest |delta| over its response and over its
    thought tokens, and delta on the tokens where the student was unsure (its own probability below 0.5). lp,
    lp_skill: one 1-D tensor per row; action, thought: one bool list per row; adv: one float per row.
    -> {"response", "action", "thought", "unsure": [delta], "rows": [(gate, adv)], "row_max", "row_max_thought":
    [max |delta|], "lp", "adv": [the student's lp, the row's advantage] per response token}, plain floats (so that
    ranks can gather them)."""
    out = {"response": [], "action": [], "thought": [], "unsure": [], "rows": [], "row_max": [], "row_max_thought": [],
           "lp": [], "adv": []}
    for p, s, am, tm, a in zip(lp, lp_skill, action, thought, adv):
        p = p.detach().float().cpu()                                               # [tokens]
        d = s.detach().float().cpu() - p                                           # [tokens]
        am, tm = torch.tensor(am, dtype=torch.bool), torch.tensor(tm, dtype=torch.bool)
        out["response"] += d.tolist()
        out["action"] += d[am].tolist()
        out["thought"] += d[tm].tolist()
        out["unsure"] += d[p < math.log(0.5)].tolist()
        out["lp"] += p.tolist()
        out["adv"] += [float(a)] * len(d)
        if len(d):
            out["rows"].append((float(gates(torch.zeros_like(d), d, beta).mean()), float(a)))
            out["row_max"].append(float(d.abs().max()))
            out["row_max_thought"] += [float(d[tm].abs().max())] if tm.any() else []
    return out


def shift_metrics(samples, beta=5.0, big=0.5):
    """shift_samples (merged over ranks) -> delta_{action,thought}_{p5,p50,p95,mean}; gate_std_{action,response}
    (the std of g = sigmoid(beta delta) over action tokens, and over every response token: 0 when the skill
    changes nothing); action_shift_share (share of action tokens with |delta| > big); gate_adv_cov (covariance
    over rows of the row's mean gate and its advantage: > 0 when the teacher favours what won, the sample form of
    Eq. 8); action_tokens. nan where there is nothing to measure. Where the env's thought already names the move
    (EZPoints: "... so the next token is 8"), the action token is a copy and its delta is ~0 whatever the skill
    does: the skill's effect sits on the thought, and gate_std_response sees it. Where the decision is one token
    of a row (a hidden room's receptacle name), per-token statistics miss it and per-row ones see it:
    row_shift_share (rows whose largest |delta| over response tokens > big), row_max_delta_p50 (the median of that
    largest |delta|), thought_row_shift_share (the same over thought tokens), and on the tokens where the student
    was unsure (p < 0.5): unsure_shift_share (|delta| > big), delta_unsure_abs_mean, unsure_tokens; gate_mean_response
    (the gate's mean over response tokens: Z, around which OPD promotes and suppresses, Appendix A); and
    gradient_split's keys (OPD's two parts against GRPO at the decision tokens)."""
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
    share = lambda xs: float((torch.tensor(xs, dtype=torch.float64).abs() > big).double().mean()) if len(xs) else nan
    u = torch.tensor(samples.get("unsure", []), dtype=torch.float64)               # [unsure tokens]
    m = torch.tensor(samples.get("row_max", []), dtype=torch.float64)              # [rows]
    g = torch.sigmoid(beta * torch.tensor(samples.get("response", []), dtype=torch.float64))   # [tokens]
    return out | {"row_shift_share": share(samples.get("row_max", [])), "row_max_delta_p50": float(m.median()) if
                  len(m) else nan, "thought_row_shift_share": share(samples.get("row_max_thought", [])),
                  "unsure_shift_share": share(u.tolist()), "delta_unsure_abs_mean": float(u.abs().mean()) if len(u)
                  else nan, "unsure_tokens": len(u), "gate_mean_response": float(g.mean()) if len(g) else nan} \
        | gradient_split(samples, beta, big)


def gradient_split(samples, beta=5.0, big=0.5):
    """Appendix A's two parts of OPD's gradient, on the sampled tokens, against GRPO's on the same tokens. A token's
    loss term c * lp has the derivative c (1 - p) on its own logit (p: the token's probability): GRPO's c is the
    row's advantage A, OPD's the gate g = Z + (g - Z), where Z (the gate's mean over the response tokens) reaches
    every token alike, imitation of the policy's own samples (zero in expectation, not in a sample), and g - Z is
    what the skill adds. Decision tokens: |delta| > big (the skill moved them). -> opd_skill_mass (share of OPD's
    sum of |c| (1 - p) that is g - Z's), decision_token_share, decision_opd_over_pg (at the decision tokens,
    sum |g - Z| (1 - p) over sum |A| (1 - p): OPD's skill part against GRPO at lambda_opd 1, times lambda_opd for a
    run's), decision_tied_share (decision tokens in a tied group, A = 0: GRPO gives them nothing, OPD does) and
    decision_agree (over decision tokens with A != 0, the share where g - Z and A have one sign: the teacher
    pushes where the outcome does). nan where there is nothing to measure."""
    nan = float("nan")
    d = torch.tensor(samples.get("response", []), dtype=torch.float64)           # [tokens]
    if not len(d) or len(samples.get("lp", [])) != len(d):
        return {}
    w = 1 - torch.tensor(samples["lp"], dtype=torch.float64).exp()               # [tokens] 1 - p
    a = torch.tensor(samples["adv"], dtype=torch.float64)                        # [tokens] the row's advantage
    g = torch.sigmoid(beta * d)                                                  # [tokens]
    dev = g - g.mean()                                                           # [tokens] g - Z
    skill, z = (dev.abs() * w).sum(), (g.mean() * w).sum()
    dec = d.abs() > big                                                          # [tokens] decision tokens
    pg, live = (a[dec].abs() * w[dec]).sum(), dec & (a != 0)
    return {"opd_skill_mass": float(skill / (skill + z)) if skill + z > 0 else nan,
            "decision_token_share": float(dec.double().mean()),
            "decision_opd_over_pg": float((dev[dec].abs() * w[dec]).sum() / pg) if pg > 0 else nan,
            "decision_tied_share": float((a[dec] == 0).double().mean()) if dec.any() else nan,
            "decision_agree": float((dev[live].sign() == a[live].sign()).double().mean()) if live.any()
            else nan}


def teacher_diagnostics(tok, cfg, rows, lp_old, steps, teachers, groups):
    """Per update, over all ranks, after the update: diag/tied_groups (share of groups whose rewards all tie:
    GRPO's gradient is zero there) and, where a teacher was scored (`teachers` not None), shift_metrics of
    rows.lp_skill against the snapshot's `lp_old` on the rows with a teacher, under "diag/": delta percentiles on
    action and thought tokens, the gate's std on action tokens and on all response tokens, the share of action
    tokens with |delta| > 0.5, the gate-advantage covariance, and the per-row statistics of a sparse decision."""
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
