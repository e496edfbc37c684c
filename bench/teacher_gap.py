"""Can the teacher teach? The pre-flight check of a SEED run (Section 3.3: the skill-conditioned teacher and
the gated OPD term). SEED distills the gap between the policy with its own hindsight skill in context (the
teacher) and the same policy without it (the student); where that gap is zero, OPD has nothing to distill.
From one checkpoint, on the first --tasks tasks of --split, --group_size samples each at --temperature:

    (a) student   the policy plays, no skill
    (b) own       the same snapshot analyzes each episode of (a) exactly as Stage 2 does (analyzer.self_analyze: greedy,
                  the whole episode), then plays that episode's task again with the skill in its actor prompt
    (c) oracle    envs with an expert: the same with the scripted annotator's skill (analyzer.scripted_analysis),
                  which separates "cannot read a skill" from "writes useless skills"
    (d) shift     teacher-forced on (a)'s own sampled responses: delta = lp_skill - lp on action and thought
                  tokens (envs.response_masks), the gate's std (beta_opd) on action tokens and on all response
                  tokens, the share of action tokens with |delta| > 0.5, and cov(row's mean gate, its GRPO
                  advantage);
                  on a seeded sample of --shift_rows step rows (a CPU forward per row and context is slow);
                  each row under the teacher context Stage 2 re-scores it with (opd.row_teachers: by
                  --skill_mode and --skill_teacher_mode, a step's own critical-step skill first)

Gaps are paired over tasks: d_t = success_b(t) - success_a(t), gap = mean d_t, SE = std(d_t) / sqrt(tasks).
(b) and (c) are also split by how the episode of (a) they replay ended ("after won / lost"): a won episode's
own skill can name what worked, a lost one's only what that episode saw (the hidden-object rooms' own gap is
made of the two, bench/RESULTS.md section 8).
Verdict: "OPD has a signal" when the own-skill gap - 2 SE > 0 AND the gate's std over all response tokens
(the tokens Eq. 7 weights) is at least --min_gate_std (0.1: runs whose teacher changed nothing measured
0.04-0.08); else "OPD has no signal". The rule reads all response tokens, not only the action's: where the
thought already names the move (EZPoints: "... so the next token is 8"), the action token is a copy whose
delta is ~0 whatever the skill does.
The flags are seed.py's (engine, dtype, max_tokens, max_steps, history_length, temperature, analyzer_*).

    python bench/teacher_gap.py --env ezpoints --init runs/demo-sft --tasks 64 --split test \\
        --max_steps 5 --history_length 0 --max_tokens 48 --analyzer_max_tokens 256

Writes <out>/teacher_gap.json (every number of the table, per-task successes, seconds per phase) and
<out>/episodes.jsonl ((a)'s episodes with their own skills); --out defaults to runs/teacher_gap-<env>.
"""
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import analyzer  # noqa: E402
import diagnostics  # noqa: E402
import envs  # noqa: E402
import grpo  # noqa: E402
import opd  # noqa: E402
import rollout  # noqa: E402
import runfolder  # noqa: E402
import seed  # noqa: E402
from parallel import autocast, resolved_dtype  # noqa: E402
from runfolder import fail, timed  # noqa: E402


@dataclass
class GapConfig(seed.Config):
    tasks: int = 64                    # N: the first N tasks of --split (the ids seed.py evaluates)
    split: str = ""                    # task split ("" = the env's first held-out split, its eval_splits)
    group_size: int = 4                # samples per task (>= 2: the GRPO advantage of the covariance needs a group)
    min_gate_std: float = 0.1          # the verdict's threshold on the gate's std over response tokens
    min_row_share: float = 0.1         # ... or on the share of rows whose largest |delta| exceeds 0.5 (a sparse decision)
    shift_rows: int = 256              # (d) on a seeded sample of this many step rows (0 = all; each costs 3 forwards)


# ----------------------------------------------------------------------------- the measurement

def replay(engine, tok, cfg, student, teachers, progress):
    """Each episode of (a) played again once per teacher, its task with that teacher's skill for the episode in
    the actor prompt (None: the plain prompt); all in one collect (one batch per turn). teachers: {name: [skill
    per episode of (a)]} -> {name: [Episode], in (a)'s order}."""
    names = list(teachers)
    play_envs = [envs.from_config(cfg, cfg.split) for _ in range(len(student) * len(names))]
    eps = rollout.collect(engine, tok, play_envs, [ep.task_id for ep in student] * len(names), 1,
                          temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                          skills=[k for n in names for k in teachers[n]], progress=progress)
    return {n: eps[i * len(student):(i + 1) * len(student)] for i, n in enumerate(names)}


def per_task(episodes, n, group):
    """Episode j*group+i belongs to task j -> success per task [n]."""
    return np.array([float(ep.won) for ep in episodes]).reshape(n, group).mean(1)


def paired_gap(b, a):
    """-> (mean of b - a, its standard error over tasks; nan with one task)."""
    d = np.asarray(b) - np.asarray(a)
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")


def scores(model, tok, steps, rows, skills, cfg, device):
    """Teacher-forced log-probs of the sampled responses of steps[rows] (opd.rescore: no new tokens), each
    under its prompt with skills[k] inserted (None: the plain prompt). -> {row: 1-D tensor}"""
    if not rows:
        return {}
    with autocast(device, resolved_dtype(cfg)):
        lp = opd.rescore(model, tok, [steps[i] for i in rows], skills, cfg.micro_batch_size)   # [rows, R]
    return dict(zip(rows, grpo.trim(lp, [len(steps[i].response_ids) for i in rows])))


@torch.no_grad()
def shift(model, tok, steps, skills, adv, plain, cfg, device):
    """(d) for one teacher, over the step rows that have a teacher context (skills: one opd.teacher_skills pair
    or None per row): lp (`plain`, {row: lp}) against lp_skill; a row whose prompt the skills do not change has
    lp_skill = lp (the same context).
    -> diagnostics.shift_metrics | {"rows"}."""
    todo = [i for i, k in enumerate(skills) if k]
    changed = [i for i in todo if envs.insert_skill(steps[i].prompt_text, skills[i][0], skills[i][1])
               != steps[i].prompt_text]
    lps = plain | scores(model, tok, steps, changed, [skills[i] for i in changed], cfg, device)
    masks = [envs.response_masks(tok, steps[i].response_ids, cfg.env) for i in todo]
    samples = diagnostics.shift_samples([plain[i] for i in todo], [lps[i] for i in todo], [m[0] for m in masks],
                                [m[1] for m in masks], [float(adv[i]) for i in todo], cfg.beta_opd)
    return diagnostics.shift_metrics(samples, cfg.beta_opd) | {"rows": len(todo)}


def measure(engine, model, tok, cfg, progress=False):
    """(a)-(d) on the first cfg.tasks tasks of cfg.split. `engine`: any object with generate(prompt_ids_list,
    temperature, max_tokens, n) and max_model_len (rollout's engines, or a test's scripted one); `model`: the
    same weights as a torch module, for the teacher-forced scores. -> the results dict (teacher_gap.json)."""
    sec, n0 = {}, envs.from_config(cfg, cfg.split).num_tasks
    n, G, device = min(cfg.tasks, n0), cfg.group_size, next(model.parameters()).device
    play_envs = [envs.from_config(cfg, cfg.split) for _ in range(n * G)]
    with timed(sec, "student"):
        student = rollout.collect(engine, tok, play_envs, list(range(n)), G, temperature=cfg.temperature,
                                  max_tokens=cfg.max_tokens, progress=progress)
    with timed(sec, "analyze"):
        stats = analyzer.self_analyze(engine, tok, student, cfg, progress)
    own = [ep.skill for ep in student]
    has_expert = all(ep.info.get("expert_plan") for ep in student)
    hidden = has_expert and any(ep.info.get("hidden") for ep in student)   # where the two scripted teachers differ
    scripted = {name: [analyzer.scripted_analysis(ep, cfg.max_steps, cfg.max_step_skills, oracle=name == "oracle")
                       for ep in student] for name in (("oracle", "hindsight") if hidden else ("oracle",)) if has_expert}
    skills = {"own": own} | {name: [a["episode_skill"] for a in s] for name, s in scripted.items()}
    with timed(sec, "replay"):
        again = replay(engine, tok, cfg, student, skills, progress)
    with timed(sec, "shift"):
        steps = [s for ep in student for s in ep.steps]
        rows, row_episode = grpo.make_rows(student, steps, play_envs[0].invalid_penalty, cfg)
        tied, groups = grpo.tied_groups(rows.adv, [student[e].group_id for e in row_episode])
        teachers = {"own": opd.row_teachers(student, cfg)}                        # per row: (episode, step) or None
        for name, s in scripted.items():   # the scripted annotation as the live one's fields
            teachers[name] = opd.row_teachers([SimpleNamespace(skill=a["episode_skill"], steps=ep.steps,
                                                               step_skills=a["step_skills"]) for a, ep in zip(s, student)], cfg)
        need = [i for i in range(len(steps)) if any(ks[i] for ks in teachers.values())]
        if cfg.shift_rows and len(need) > cfg.shift_rows:   # a seeded sample; the other rows count for no teacher
            need = sorted(np.random.default_rng([cfg.seed, 4]).choice(need, cfg.shift_rows, replace=False).tolist())
            keep = set(need)
            teachers = {name: [k if i in keep else None for i, k in enumerate(ks)] for name, ks in teachers.items()}
        plain = scores(model, tok, steps, need, [None] * len(need), cfg, device)      # lp, once for both teachers
        shifts = {name: shift(model, tok, steps, ks, rows.adv, plain, cfg, device) for name, ks in teachers.items()}
    a = per_task(student, n, G)
    res = {"config": asdict(cfg), "tasks": n, "samples": G, "student": float(a.mean()), "per_task": {"student": a.tolist()},
           "skill_rate": {"own": 1 - stats["parse_failures"] / max(stats["episodes"], 1)} | {k: 1.0 for k in scripted},
           "tied_groups": tied / groups, "shift": shifts}
    won = np.array([ep.won for ep in student], bool)                                        # [n * G]
    for name, eps in again.items():
        b = per_task(eps, n, G)
        res[name], res["per_task"][name] = float(b.mean()), b.tolist()
        res[f"gap_{name}"], res[f"se_{name}"] = paired_gap(b, a)
        r = np.array([float(ep.won) for ep in eps])                                         # [n * G], (a)'s order
        res[f"after_{name}"] = {k: float(r[m].mean()) if m.any() else float("nan") for k, m in (("won", won), ("lost", ~won))}
    res["signals"] = {name: has_signal(res, name, cfg) for name in again}
    res["signal"] = res["signals"]["own"]
    res["verdict"] = verdict(res, cfg)
    res["sec"] = {k.split("/")[-1]: v for k, v in sec.items()} | {"total": sum(sec.values())}
    return res, student


def has_signal(res, name, cfg):
    """A teacher gives OPD a signal when its gap is above 0 by 2 SE and the skill moves the student's tokens: the
    gate's std over response tokens >= --min_gate_std (a skill that shifts many tokens), or the share of rows whose
    largest |delta| > 0.5 >= --min_row_share (a decision of one or two tokens a row, which the std cannot see)."""
    sh = res["shift"].get(name, {})
    moved = sh.get("gate_std_response", 0) >= cfg.min_gate_std or sh.get("row_shift_share", 0) >= cfg.min_row_share
    return bool(res[f"gap_{name}"] - 2 * res[f"se_{name}"] > 0 and moved)


def verdict(res, cfg):
    g, se = res["gap_own"], res["se_own"]
    sh = res["shift"].get("own", {})
    std, share = sh.get("gate_std_response", float("nan")), sh.get("row_shift_share", float("nan"))
    others = "; ".join(f"{n}: {'signal' if s else 'no signal'}" for n, s in res["signals"].items() if n != "own")
    return (f"teacher gap (own skill) {g:+.3f} +- {se:.3f} (SE over {res['tasks']} tasks), gate std on response "
            f"tokens {std:.3f}, rows moved > 0.5 {share:.3f}: OPD has {'a' if res['signal'] else 'no'} signal "
            f"(rule: gap - 2 SE > 0 and (gate std >= {cfg.min_gate_std:g} or rows moved >= {cfg.min_row_share:g}))"
            + (f"; {others}" if others else ""))


# ----------------------------------------------------------------------------- the table

def table(res, cfg):
    """One table: success of (a)-(c) with gaps, (d) per teacher, and the verdict line."""
    f = lambda x: "  nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.3f}"
    lines = [f"teacher gap: {cfg.env} {cfg.split}, {res['tasks']} tasks x {res['samples']} samples, "
             f"T={cfg.temperature:g}, checkpoint {cfg.init or cfg.model}",
             f"{'':34s}{'success':>9s}{'gap':>9s}{'SE':>8s}{'skills':>8s}{'after won':>11s}{'lost':>7s}",
             f"{'(a) student, no skill':34s}{res['student']:9.3f}"]
    for key, label in (("own", "(b) own hindsight skill"), ("oracle", "(c) oracle (scripted, knows the game)"),
                       ("hindsight", "(c') scripted, what the episode saw")):
        if key in res:
            after = res["after_" + key]
            lines.append(f"{label:34s}{res[key]:9.3f}{f(res['gap_' + key]):>9s}{res['se_' + key]:8.3f}"
                         f"{res['skill_rate'][key]:8.2f}{after['won']:11.3f}{after['lost']:7.3f}")
    names = list(res["shift"])
    lines.append(f"(d) teacher-forced on (a)'s responses{''.join(f'{n:>12s}' for n in names)}")
    for k, label in (("delta_action_p5", "delta action p5"), ("delta_action_p50", "delta action p50"),
                     ("delta_action_p95", "delta action p95"), ("delta_action_mean", "delta action mean"),
                     ("delta_thought_p5", "delta thought p5"), ("delta_thought_p50", "delta thought p50"),
                     ("delta_thought_p95", "delta thought p95"), ("delta_thought_mean", "delta thought mean"),
                     ("gate_std_action", f"gate std, action (beta {cfg.beta_opd:g})"),
                     ("gate_std_response", "gate std, all response tokens"),
                     ("action_shift_share", "share |delta| > 0.5, action"),
                     ("row_shift_share", "rows with max |delta| > 0.5"),
                     ("row_max_delta_p50", "row max |delta|, median"),
                     ("thought_row_shift_share", "rows, thought max |delta| > 0.5"),
                     ("unsure_shift_share", "unsure tokens (p<0.5) |delta|>0.5"),
                     ("delta_unsure_abs_mean", "unsure tokens, mean |delta|"),
                     ("gate_adv_cov", "cov(row gate, advantage)")):
        lines.append(f"    {label:34s}" + "".join(f"{f(res['shift'][n][k]):>12s}" for n in names))
    lines.append(f"    {'rows / action tokens':34s}" + "".join(
        f"{str(res['shift'][n]['rows']) + ' / ' + str(res['shift'][n]['action_tokens']):>12s}" for n in names))
    lines += [f"tied groups in (a): {res['tied_groups']:.2f}   seconds: {res['sec']['total']:.0f} "
              f"({', '.join(f'{k} {v:.0f}' for k, v in res['sec'].items() if k != 'total')})",
              f"verdict: {res['verdict']}"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_config(argv=None):
    cfg = runfolder.parse_config(argv, GapConfig, envs.defaults(), __doc__)
    cfg.split = cfg.split or envs.env_class(cfg.env).eval_splits[0]
    cfg.out = cfg.out or os.path.join("runs", f"teacher_gap-{cfg.env}")
    runfolder.check_common(cfg, ("tasks", "max_steps", "max_tokens", "micro_batch_size", "analyzer_max_tokens",
                                 "analyzer_max_prompt_tokens"))
    if cfg.group_size < 2:
        fail(f"--group_size must be at least 2 (a GRPO group for the gate-advantage covariance), got {cfg.group_size}")
    if cfg.init and not os.path.isfile(os.path.join(cfg.init, "config.json")):
        fail(f"--init {cfg.init} is not a checkpoint folder (no config.json); pass --init '' for --model")
    try:
        envs.from_config(cfg, cfg.split)
    except (ValueError, KeyError, FileNotFoundError) as e:
        fail(f"--split {cfg.split!r} for --env {cfg.env}: {e}")
    return cfg


def main(argv=None):
    cfg = parse_config(argv)
    torch.manual_seed(cfg.seed)
    model, tok, path = rollout.load_model(cfg.init or cfg.model)
    engine = rollout.make_engine(cfg.engine, path, dtype=resolved_dtype(cfg), seed=cfg.seed,
                                 max_model_len=seed.engine_context(cfg, path),
                                 gpu_memory_utilization=cfg.gpu_memory_utilization)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res, student = measure(engine, model.to(device).eval(), tok, cfg, progress=True)
    engine.close()
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "teacher_gap.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(cfg.out, "episodes.jsonl"), "w") as f:
        f.writelines(json.dumps(runfolder.episode_record(ep)) + "\n" for ep in student)
    print(table(res, cfg), flush=True)
    print(f"[teacher_gap] {os.path.join(cfg.out, 'teacher_gap.json')}", flush=True)
    return res


if __name__ == "__main__":
    main()
