"""SEED Stage 2: on-policy skill generation and the joint objective (Section 3.3), one update of
Algorithm 1 (Appendix B.3) at a time.

    for update u = 0 .. updates-1:
        tasks      <- B tasks from the data-order RNG; each rank plays its share, N episodes per task
        episodes   <- collect(pi_old)                                  # multi-turn rollouts
        skills     <- analyze(pi_old, episodes)                        # the same snapshot, greedy (Section 3.3):
                                                                       # episode skill, step skills (--skill_mode)
        A          <- group advantages of the step rows                # GRPO's group-normalized advantage
        lp_old     <- a no-grad pass, only when the rows span several mini-batches (else the update's own)
        lp_ref     <- a no-grad pass, only when kl_coef > 0
        lp_skill   <- rescore(pi_old, rows, skill inserted)            # dual-context re-scoring (Section 3.3):
                                                                       # step or episode skill (opd.teacher_skills)
        for each mini-batch:  L = L_pg + kl_coef L_kl - ent_coef H + lambda_opd L_opd   (the joint objective)
        AdamW step; push the new weights into the rollout engine (pi_old <- pi_theta)

Baselines (Section 4.1, Appendix B.2; README's table says which are our interpretations) are switches on
the same loop (`--algo`): grpo (no analyzer, no OPD), vanilla (the starting model evaluated, no update),
skill_prompt (frozen model, library skill only at evaluation), skill_grpo / skill_grpo_star (library skill
in the actor's context; evaluated without / with it), static_skills (OPD with library skills instead of the
live analyzer), opsd / grpo_opsd (ungated self-distillation, without / with GRPO), rlsd (the teacher gap as
a bounded per-token weight on GRPO), skill_sd (GRPO + ungated distillation from a library-skill teacher).
`--init ""` is the no-SFT ablation, `--train_fraction` the sample-efficiency study (Table 6). Runs:
`torchrun --nproc_per_node=8 seed.py ...` (DDP, or FSDP2 with --fsdp) or plain `python seed.py ...`;
everything lands in `runs/<name>/` (README: the run folder).

Reading order: Config, Run (what a run holds), rl_update (the loop above), micro_loss and update_policy (the
joint objective), evaluation, then the set-up (validate, build_run) and main. The plumbing shared with sft.py
is in parallel.py (process group, collectives, DDP / FSDP2) and runfolder.py (flags, run folder, checkpoints).
"""
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import analyzer
import envs
import grpo
import opd
import rollout
import runfolder
from parallel import (all_sum, autocast, chunked, gather, grad_sync, resolved_dtype, setup_dist,
                      teardown_dist, unwrap, wrap)
from runfolder import fail, timed

if TYPE_CHECKING:
    import transformers

ALGOS = ("seed", "grpo", "vanilla", "skill_prompt", "skill_grpo", "skill_grpo_star", "static_skills", "opsd",
         "grpo_opsd", "rlsd", "skill_sd")
LIVE_ANALYZER = ("seed", "opsd", "grpo_opsd", "rlsd")   # skills from the live analyzer (the snapshot itself)
LIBRARY = ("skill_prompt", "skill_grpo", "skill_grpo_star", "static_skills", "skill_sd")   # Stage-1 skill library
IN_CONTEXT = ("skill_grpo", "skill_grpo_star")          # the library skill in the actor's own context
DISTILL = ("seed", "static_skills", "opsd", "grpo_opsd", "skill_sd")   # an OPD / OPSD term in the loss
RESCORE = DISTILL + ("rlsd",)                           # needs lp_skill (the teacher: skill in context)
NO_TRAINING = ("vanilla", "skill_prompt")               # evaluate the starting model, no update
EVAL_BATCH = 64   # held-out episodes played at once per rank (at least as many as in training): one env each
MAX_SKIPS = 3     # optimizer steps in a row with a non-finite grad norm before the run stops (update_policy)
RLSD_EPS = 0.2   # RLSD's bound on its per-token weight, w in [1 - eps, 1 + eps] (value not given: PPO's clip)


@dataclass
class Config:
    # -- run
    env: str = "alfworld"              # benchmark: alfworld | webshop | search | sokoban | ezpoints
    model: str = "smollm2-135m"        # base model: "smollm2-135m" (embedded), a local folder or a cached HF name
    init: str = ""                     # Stage-1 checkpoint (sft.py --out); "" = the no_sft ablation (RL from --model)
    algo: str = "seed"                 # seed, or a baseline of README's table (seed.ALGOS)
    out: str = ""                      # run folder ("" = runs/<algo>-<env>)
    resume: bool = False               # continue the run in --out from its last checkpoint
    seed: int = 0                      # seed of everything (rank r samples with seed + r)
    updates: int = 150                 # RL updates (the paper trains 150)
    train_fraction: float = 1.0        # share of the training tasks used, a fixed subset per seed (Table 6)
    # -- tasks and episodes (docs/design-notes.md#defaults, one column per env)
    tasks_per_update: int = 16         # B: tasks per update, over all ranks
    group_size: int = 8                # N: episodes per task (a GRPO group)
    max_steps: int = 30                # env steps per episode
    history_length: int = 5            # past (observation, action) pairs in the actor prompt
    image: bool = False                # image observations for a vision-language model (sokoban, ezpoints; Appendix C.3)
    max_prompt_tokens: int = 2048      # longest actor prompt the engine accepts (its context = this + max_tokens)
    max_tokens: int = 512              # response tokens per turn
    temperature: float = 1.0           # rollout temperature
    data_dir: str = ""                 # env data folder ("" = the env's default: data/alfworld, envs/data/...)
    retriever_url: str = "http://127.0.0.1:8000/retrieve"   # search QA retriever (Search-R1 protocol)
    # -- engine and model
    engine: str = "vllm"               # rollout engine: vllm | hf (the transformers fallback)
    dtype: str = "auto"                # engine dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    fsdp: bool = False                 # shard the policy and reference with FSDP2 (fully_shard) instead of DDP
    gradient_checkpointing: bool = False   # recompute activations in the backward (large models)
    gpu_memory_utilization: float = 0.3    # the vLLM engine's share of each GPU while awake (bench/memory.py)
    # -- analyzer (Section 3.3, on-policy skill generation)
    analyzer_max_prompt_tokens: int = 16384   # the analyzer's own prompt budget (authors'): episodes are read whole
    analyzer_max_tokens: int = 1024    # new tokens per analysis (authors' cap 4096; the JSON needs a few hundred)
    analyzer_retries: int = 0          # corrective re-asks on a parse failure (authors: none; ours rescued nothing)
    skill_library: str = ""            # Stage-1 skill library ("" = <init>/skills.jsonl)
    skill_mode: str = "episode_step"   # skills the analyzer writes: episode_step | episode_only | step_only
    skill_teacher_mode: str = "step_priority"   # a step with a step skill: step_priority (it alone) | additive (both)
    max_step_skills: int = 5           # step skills per episode at most (authors' launchers: 5; Search 2)
    selector: str = "llm"              # who picks the critical steps: llm (the analyzer itself, the authors' SEED)
    # -- objective (the joint objective, Section 3.3; values of Appendix B.4 and the official launchers)
    lr: float = 1e-6                   # AdamW learning rate, constant
    weight_decay: float = 0.01         # AdamW weight decay
    grad_clip: float = 1.0             # max global grad norm
    mini_batch_size: int = 256         # step rows per optimizer step, over all ranks (one pass over the batch)
    micro_batch_size: int = 8          # rows per forward pass on one rank
    clip_low: float = 0.2              # PPO ratio clip, low side
    clip_high: float = 0.2             # PPO ratio clip, high side
    dual_clip: float = 3.0             # dual-clip bound for A < 0
    kl_coef: float = 0.01              # k3 KL to the reference
    ent_coef: float = 0.001            # entropy bonus
    lambda_opd: float = 0.01           # weight of the OPD term in the joint objective
    beta_opd: float = 5.0              # OPD gate sharpness: g = sigmoid(beta * (lp_skill - lp))
    adv_norm: str = "std"              # std | mean_norm (no division by the std; official WebShop launcher)
    adv_level: str = "step"            # step (every step row counts, official code) | trajectory (the paper's formula)
    # -- evaluation (no skill, temperature 0.4)
    eval_every: int = 10               # evaluate every this many updates (and after the last); 0 = never
    eval_tasks: int = 0                # held-out tasks per split (0 = the whole split)
    eval_temperature: float = 0.4      # sampling temperature at evaluation
    eval_greedy: bool = False          # also evaluate greedily (temperature 0), logged as eval_greedy/<split>/...
    eval_first: bool = False           # also evaluate the starting policy, before update 0 (a line with update -1)
    # -- checkpoints
    save_every: int = 10               # checkpoint every this many updates (and after the last)
    track: str = ""                    # also log each metrics.jsonl line and the config to tensorboard | wandb ("" = off)
    webshop_small: bool = True         # WebShop: the 1,000-product catalogue (authors' use_small); no: every product
    webshop_human_goals: bool = False  # WebShop: human-written goals (authors: False, synthetic goals)
    webshop_train_from: int = 500      # WebShop: first training goal index (authors 500; test = goals [0, 500))


# The env columns of docs/design-notes.md#defaults (ALFWorld = the dataclass defaults); the skill modes are the
# authors' launchers' (examples/seed_trainer/_common/*.sh): critical-step skills on ALFWorld, WebShop and Search.
ENV_DEFAULTS = {
    "alfworld": dict(),
    "webshop": dict(max_steps=15, history_length=2, max_prompt_tokens=4096, adv_norm="mean_norm"),
    "search": dict(tasks_per_update=128, max_steps=4, history_length=4, max_prompt_tokens=4096,
                   kl_coef=0.001, ent_coef=0.0, max_step_skills=2),
    "sokoban": dict(max_steps=15, history_length=2, max_prompt_tokens=1024, max_tokens=256,
                    skill_mode="episode_only", max_step_skills=2),
    "ezpoints": dict(max_steps=5, history_length=2, max_prompt_tokens=1024, max_tokens=256,
                     skill_mode="episode_only", max_step_skills=0),
}


# ----------------------------------------------------------------------------- the run state

@dataclass
class Run:
    """Everything a run holds, built once by build_run; the loop's functions read what they use."""
    cfg: Config                        # the flags, after the --env column
    rank: int                          # this process's rank (0 under plain python)
    world: int                         # number of ranks
    device: torch.device               # this rank's device: cuda:<local rank>, or cpu
    run_dir: str                       # the run folder (--out): config.json, metrics.jsonl, episodes/, checkpoint/
    tok: "transformers.PreTrainedTokenizerBase"   # the policy's tokenizer (chat template, pad id)
    model: torch.nn.Module             # pi_theta, wrapped (DDP or FSDP2): what AdamW steps
    no_grad_model: torch.nn.Module     # the same weights for no-grad passes (unwrapped under DDP: no hooks)
    ref: torch.nn.Module               # pi_ref, frozen (the --init checkpoint); no_grad_model itself when kl_coef = 0
    opt: torch.optim.Optimizer         # AdamW on model's parameters
    engine: "rollout.VLLMEngine | rollout.HFEngine"   # this rank's rollout engine, holding pi_old
    data_rng: np.random.Generator      # the data order: the tasks of each update (saved in checkpoints)
    library: "analyzer.SkillLibrary | None"   # the Stage-1 skill library (the LIBRARY algos), else None
    train_envs: list                   # this rank's training envs, one per episode of an update
    train_ids: np.ndarray              # the training task ids updates draw from (all, or --train_fraction's)
    eval_ids: dict                     # split -> this rank's held-out task ids
    eval_envs: dict = field(default_factory=dict)   # split -> its envs, made at the first evaluation
    start: int = 0                     # the first update to run (the checkpoint's next one when resuming)
    skip_streak: list = field(default_factory=lambda: [0])   # optimizer steps skipped in a row (update_policy)


# ----------------------------------------------------------------------------- one update (Algorithm 1)

def rl_update(u, run):
    """Algorithm 1, one iteration. -> (metrics, every rank's episode records)."""
    cfg, rank, world = run.cfg, run.rank, run.world
    main_rank, sec = rank == 0, {}
    with timed(sec, "collect"):   # 1. collect with the snapshot pi_old
        ids = run.train_ids                    # every training task, or the --train_fraction subset
        tasks = run.data_rng.choice(ids, size=cfg.tasks_per_update, replace=len(ids) < cfg.tasks_per_update).tolist()
        mine = tasks[rank::world]
        ctx_skills = run.library.for_tasks(run.train_envs[0], mine) if cfg.algo in IN_CONTEXT else None
        episodes = rollout.collect(run.engine, run.tok, run.train_envs, mine, cfg.group_size,
                                   temperature=cfg.temperature, max_tokens=cfg.max_tokens, skills=ctx_skills,
                                   progress=main_rank)
    with timed(sec, "analyze"):   # 2. analyze with the same snapshot (greedy) -> episode.skill
        stats = {}
        if cfg.algo in LIVE_ANALYZER:
            stats = analyze(run.engine, run.tok, episodes, cfg, main_rank)
        elif cfg.algo in ("static_skills", "skill_sd"):   # a library skill for the teacher's context only
            for ep in episodes:
                ep.skill = run.library.retrieve(cfg.env, ep.family, analyzer.episode_key(ep))
    records = [r for part in gather([runfolder.episode_record(ep) for ep in episodes]) for r in part]
    run.engine.sleep()
    with timed(sec, "logprobs"):
        # 3. rows, rewards, advantages
        steps = [s for ep in episodes for s in ep.steps]
        rows, row_episode = grpo.make_rows(episodes, steps, run.train_envs[0].invalid_penalty, cfg)
        model, pad_id = run.model, run.tok.pad_token_id
        # 4. old and reference log-probs, each a no-grad pass only when needed
        if all_sum(len(rows)) > cfg.mini_batch_size:   # later mini-batches need log pi_old; one mini-batch does not
            rows.old = grpo.batch_logprobs(run.no_grad_model, rows, pad_id, cfg, run.device)
        if cfg.kl_coef > 0:
            rows.ref = grpo.batch_logprobs(run.ref, rows, pad_id, cfg, run.device)
    with timed(sec, "rescore"):   # 5. re-score under the skill-augmented context (rows with a skill are distilled)
        teachers = opd.row_teachers(episodes, cfg)        # per row: (episode skill, step skill) or None
        if cfg.algo in RESCORE:
            rows.has_skill = torch.tensor([1.0 if k else 0.0 for k in teachers])
            rows.skill_lp = opd.rescore_rows(run.no_grad_model, run.tok, steps, teachers, cfg, run.device)
    with timed(sec, "update"):    # 6. mini-batch updates of the joint objective, one pass, rows shuffled
        order = np.random.default_rng([cfg.seed, u, rank]).permutation(len(rows))
        sums, norms = update_policy(model, run.opt, rows, cfg, pad_id, world, run.device, order, main_rank,
                                    u / max(cfg.updates, 1), run.skip_streak, u)   # fills rows.old if it was None
    with timed(sec, "diagnostics"):   # can the teacher teach? (tie share; the skill's shift on action tokens)
        diag = teacher_diagnostics(run, rows, steps, teachers, [episodes[e].group_id for e in row_episode])
    with timed(sec, "push"):      # 7. the new weights become the next snapshot pi_old (actor and analyzer)
        rollout.push(run.engine, model, run.opt)
    return (rollout.episode_metrics(episodes, stats) | step_skill_metrics(episodes, teachers, cfg)
            | loss_metrics(sums, norms, cfg.algo) | diag | sec, records)


def step_skill_metrics(episodes, teachers, cfg):
    """Over all ranks: step_skill_rate, the share of analyzed episodes (a skill parsed) with at least one step
    skill; step_skill_row_frac, the share of rows whose teacher context holds a step skill."""
    if cfg.skill_mode == "episode_only" or cfg.algo not in LIVE_ANALYZER:
        return {}
    analyzed = [ep for ep in episodes if ep.skill or ep.step_skills]
    n, with_steps, rows, step_rows = all_sum([len(analyzed), sum(bool(ep.step_skills) for ep in analyzed),
                                               len(teachers), sum(bool(k and k[1]) for k in teachers)])
    return {"step_skill_rate": with_steps / n if n else float("nan"),
            "step_skill_row_frac": step_rows / max(rows, 1)}


def teacher_diagnostics(run, rows, steps, skills, groups):
    """Per update, over all ranks: diag/tied_groups (share of groups whose rewards all tie: GRPO's gradient is
    zero there) and, where the teacher is scored (RESCORE algos), opd.shift_metrics of lp_skill against the
    snapshot's lp = log pi_old on the skill rows (rows.old: the no-grad pass of several mini-batches, or the
    one mini-batch's own forward, kept by update_policy), under "diag/": delta percentiles on action and
    thought tokens, the gate's std on action tokens and on all response tokens, the share of action tokens with
    |delta| > 0.5, and the gate-advantage covariance."""
    cfg = run.cfg
    tied, n = all_sum(list(grpo.tied_groups(rows.adv, groups)))
    out = {"diag/tied_groups": tied / n if n else float("nan")}
    if cfg.algo not in RESCORE:
        return out
    todo = [i for i, k in enumerate(skills) if k]
    lp = [rows.old[i] for i in todo]
    masks = [envs.response_masks(run.tok, steps[i].response_ids, cfg.env) for i in todo]
    local = opd.shift_samples(lp, [rows.skill_lp[i] for i in todo], [m[0] for m in masks], [m[1] for m in masks],
                              [float(rows.adv[i]) for i in todo], cfg.beta_opd)
    merged = {k: [x for part in gather(local) for x in part[k]] for k in local}
    return out | {f"diag/{k}": v for k, v in opd.shift_metrics(merged, cfg.beta_opd).items()}


def analyze(engine, tok, episodes, cfg, progress, chunk=32):
    """Section 3.3: the snapshot analyzes every episode (one greedy generation, optional retries on a parse
    failure), each read whole up to --analyzer_max_prompt_tokens (capped by what the engine holds), `chunk`
    episodes per batched call. -> {"episodes", "parse_failures", "first_try_failures"} summed over the chunks."""
    stats = {"episodes": 0, "parse_failures": 0, "first_try_failures": 0}
    for i in tqdm(range(0, len(episodes), chunk), desc="analyze", disable=not progress, leave=False):
        st = analyzer.analyze(engine, tok, episodes[i:i + chunk], max_tokens=cfg.analyzer_max_tokens,
                              retries=cfg.analyzer_retries, max_prompt_tokens=cfg.analyzer_max_prompt_tokens,
                              skill_mode=cfg.skill_mode, max_step_skills=cfg.max_step_skills)
        stats = {k: stats[k] + st[k] for k in stats}
    return stats


# ----------------------------------------------------------------------------- the joint objective (Section 3.3)

def micro_loss(model, mb, cfg, pad_id, n_tok, n_skill, world, device, done=0.0, keep=None):
    """The joint loss of one micro-batch as its share of the global token means. n_tok / n_skill = response
    tokens / tokens of rows with a skill, in the whole mini-batch over all ranks; done = the share of
    the run's updates done (RLSD's anneal); keep: a list that receives this forward's detached log-probs
    when they are pi_old's (mb.old is None). -> (loss, sums for the metrics)."""
    with autocast(device, resolved_dtype(cfg)):
        lp, mask, ent = grpo.response_logprobs(model, mb.prompts, mb.responses, pad_id, grad=True,
                                               entropy=cfg.ent_coef > 0)          # [rows, R]
    R = lp.shape[1]
    padded = lambda x: None if x is None else grpo.pad(x, R).to(lp.device)
    old, ref, lp_skill = padded(mb.old), padded(mb.ref), padded(mb.skill_lp)       # [rows, R]
    if old is None:   # one mini-batch: pi_old is exactly the weights of this forward
        old = lp.detach()
        if keep is not None:
            keep.extend(grpo.trim(old, [len(r) for r in mb.responses]))
    adv = mb.adv.to(lp.device)                                                     # [rows]
    skill_mask = mb.has_skill.to(lp.device)[:, None] * mask                        # [rows, R]
    pg = grpo.policy_loss(lp, old, adv, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip)   # [rows, R]
    w = None
    if cfg.algo == "opsd":
        pg = torch.zeros_like(pg)                       # pure self-distillation: no reward term
    elif cfg.algo == "rlsd":                            # teacher gap = per-token magnitude, A = direction
        w = 1.0 + skill_mask * (opd.rlsd_weights(lp, lp_skill, adv, RLSD_EPS, 1.0 - done) - 1.0)  # [rows, R]
        pg = pg * w
    kl = grpo.kl_k3(lp, ref) if ref is not None else None                          # [rows, R] k3 KL
    use_opd = cfg.algo in DISTILL
    if cfg.algo in ("opsd", "grpo_opsd", "skill_sd"):
        opd_tok = opd.opsd_loss(lp, lp_skill)                                      # [rows, R] ungated
    else:
        opd_tok = opd.opd_loss(lp, lp_skill, cfg.beta_opd) if use_opd else None    # [rows, R] gated OPD
    lambda_opd = 1.0 if cfg.algo == "opsd" else cfg.lambda_opd
    # DDP and FSDP average gradients over ranks: divide by the global counts / world (grpo.masked_mean).
    loss, _ = grpo.joint_loss(pg, kl, ent, opd_tok, mask, skill_mask, n_tok, n_skill,
                              cfg.kl_coef, cfg.ent_coef, lambda_opd if use_opd else 0.0, world=world)
    with torch.no_grad():
        g = opd.gates(lp_skill, lp, cfg.beta_opd) if use_opd else torch.zeros_like(lp)   # [rows, R]
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))                          # [rows, R]
        A = adv[:, None]
        clipped = ((A > 0) & (ratio > 1 + cfg.clip_high)) | ((A < 0) & (ratio < 1 - cfg.clip_low))
        sums = {"pg": (pg * mask).sum(), "kl": (kl * mask).sum() if kl is not None else 0.0,
                "entropy": (ent * mask).sum() if ent is not None else 0.0,
                "opd": (opd_tok * skill_mask).sum() if opd_tok is not None else 0.0,
                "gate": (g * skill_mask).sum(), "gate_sq": (g * g * skill_mask).sum(),
                "rlsd_weight": (w * skill_mask).sum() if w is not None else 0.0,
                "skill_tokens": skill_mask.sum(), "clipped": (clipped * mask).sum(), "tokens": mask.sum()}
    return loss, {k: float(v) for k, v in sums.items()}


def update_policy(model, opt, rows, cfg, pad_id, world, device, order=None, show_bar=False, done=0.0,
                  streak=None, update=None):
    """One pass over the rows in mini-batches (ppo_epochs = 1); each mini-batch is one AdamW step on the
    token-mean joint loss over all ranks' rows. `order`: this rank's row order (shuffled by the caller);
    `done`: the share of the run's updates done (RLSD's anneal, micro_loss). A mini-batch whose global grad norm
    is not finite is skipped (grads zeroed, no AdamW step, counted in "skipped_steps"); `streak`, a one-item
    list the caller keeps across updates, counts the skips in a row, and MAX_SKIPS of them stop the run
    with an error naming `update`. Where rows.old is None (one mini-batch), it is set afterwards to the
    log pi_old of that mini-batch's forward (the per-update diagnostics read it; no extra pass).
    Returns the summed statistics of every micro-batch (summed over ranks) and the finite grad norms."""
    order = list(range(len(rows))) if order is None else list(order)
    n_mb = max(1, math.ceil(all_sum(len(rows)) / cfg.mini_batch_size))
    totals, norms, skipped = {}, [], 0
    streak = [0] if streak is None else streak
    bar = tqdm(total=n_mb, desc="update", disable=not show_bar, leave=False)
    old = [None] * len(rows) if rows.old is None and n_mb == 1 else None   # pi_old = this forward's
    for part in np.array_split(np.array(order, dtype=np.int64), n_mb):
        part = grpo.by_length(part.tolist(), rows.prompts, rows.responses)   # same gradient, less padding
        mbrows = rows.take(part)
        # global counts of this mini-batch: response tokens, and tokens of rows with a skill (the OPD mean)
        n_tok, n_skill = all_sum([sum(len(r) for r in mbrows.responses),
                                  sum(len(r) * float(h) for r, h in zip(mbrows.responses, mbrows.has_skill))])
        micros = chunked(len(mbrows), cfg.micro_batch_size, same_count=True)
        opt.zero_grad(set_to_none=True)
        for k, idx in enumerate(micros):
            with grad_sync(model, k == len(micros) - 1):
                mb = mbrows.take(idx) if idx else rows.take([0])  # filler: a row with zero weight
                kept = []
                loss, sums = micro_loss(model, mb, cfg, pad_id, max(n_tok, 1.0), n_skill, world, device, done, kept)
                (loss if idx else loss * 0.0).backward()
            if idx:
                for j, t in zip(idx, kept if old is not None else []):
                    old[part[j]] = t
                for key, v in sums.items():
                    totals[key] = totals.get(key, 0.0) + v
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)   # global: every rank agrees
        if math.isfinite(norm):
            opt.step()
            norms.append(norm)
            streak[0] = 0
        else:   # one NaN / inf gradient would make every weight NaN: skip the step, as the authors' dp_actor
            opt.zero_grad(set_to_none=True)
            skipped, streak[0] = skipped + 1, streak[0] + 1
            if streak[0] >= MAX_SKIPS:
                raise RuntimeError(f"update {update}: {streak[0]} optimizer steps in a row had a non-finite "
                                   f"gradient norm ({norm}); stopping with the last finite weights (check "
                                   f"--lr, the data and the dtype)")
        bar.update(1)
    bar.close()
    if old is not None:
        rows.old = old
    keys = sorted(totals) or ["tokens"]
    summed = dict(zip(keys, all_sum([totals.get(k, 0.0) for k in keys])))
    summed["skipped_steps"] = float(skipped)   # the same on every rank (the norm is global): not summed
    return summed, norms


def loss_metrics(s, norms, algo):
    """Sums over the update -> every loss term as it enters L: pg, kl, entropy over all response tokens; OPD
    over the tokens of rows with a skill (0 when there were none, as in L). The gate and RLSD weight
    statistics are over the skill tokens too (nan when there were none)."""
    n, ns = max(s.get("tokens", 0.0), 1.0), s.get("skill_tokens", 0.0)
    per_skill = lambda k: s.get(k, 0.0) / ns if ns else float("nan")
    out = {"loss/pg": s.get("pg", 0.0) / n, "loss/kl": s.get("kl", 0.0) / n, "loss/entropy": s.get("entropy", 0.0) / n,
           "clip_frac": s.get("clipped", 0.0) / n, "grad_norm": float(np.mean(norms)) if norms else 0.0,
           "tokens": s.get("tokens", 0.0), "update/skipped_steps": s.get("skipped_steps", 0.0)}
    if algo in RESCORE:
        out["skill_token_frac"] = ns / n
    if algo in DISTILL:
        gate_mean = per_skill("gate")
        gate_var = per_skill("gate_sq") - gate_mean ** 2
        out |= {"loss/opd": s.get("opd", 0.0) / ns if ns else 0.0, "gate/mean": gate_mean,
                "gate/std": math.sqrt(max(gate_var, 0.0)) if ns else float("nan")}
    if algo == "rlsd":
        out["rlsd/weight_mean"] = per_skill("rlsd_weight")
    return out


# ----------------------------------------------------------------------------- evaluation

def eval_task_ids(cfg, split, rank, world):
    n = envs.from_config(cfg, split).num_tasks
    ids = list(range(min(cfg.eval_tasks, n) if cfg.eval_tasks else n))
    return ids[rank::world]


def run_eval(run, with_skill=False):
    """Held-out tasks at temperature 0.4, no skill (skill_prompt, skill_grpo_star: the library skill in the
    prompt, as the paper's Skill-Prompt and Skill-GRPO* rows); with --eval_greedy also at temperature 0.
    -> {"eval/<split>/success", ".../success_<family>", ".../success_macro", ".../length", ".../invalid_rate"}
    (and the same under "eval_greedy/")."""
    cfg, out = run.cfg, {}
    runs = [("eval", cfg.eval_temperature)] + ([("eval_greedy", 0.0)] if cfg.eval_greedy else [])
    for split in envs.EVAL_SPLITS[cfg.env]:
        ids = run.eval_ids[split]
        if split not in run.eval_envs:   # made once, reused by every evaluation
            n = min(len(ids), max(len(run.train_envs), EVAL_BATCH))
            run.eval_envs[split] = [envs.from_config(cfg, split) for _ in range(n)]
        es = run.eval_envs[split]
        skills = run.library.for_tasks(es[0], ids) if with_skill and ids else None
        for prefix, temperature in runs:
            res = rollout.evaluate(run.engine, run.tok, es, ids, temperature, cfg.max_tokens, skills, run.rank == 0)
            out |= rollout.eval_metrics([x for part in gather(res) for x in part], f"{prefix}/{split}")
    return out


# ----------------------------------------------------------------------------- set-up: flags, the run state, the end

def parse_config(argv=None):
    """Flags -> Config (every field a flag; precedence: flag > the --env column of ENV_DEFAULTS > default)."""
    return runfolder.parse_config(argv, Config, ENV_DEFAULTS, __doc__)


def validate(cfg):
    """Stop at start-up, naming the problem, before any model is loaded."""
    if cfg.algo not in ALGOS:
        fail(f"unknown --algo {cfg.algo!r}; choose one of {', '.join(ALGOS)}")
    runfolder.check_common(cfg, ("tasks_per_update", "group_size", "max_steps", "max_tokens", "mini_batch_size",
                                 "micro_batch_size", "analyzer_max_tokens", "analyzer_max_prompt_tokens"))
    if cfg.adv_norm not in ("std", "mean_norm") or cfg.adv_level not in ("step", "trajectory"):
        fail("--adv_norm must be std|mean_norm and --adv_level step|trajectory")
    if cfg.skill_mode not in analyzer.SKILL_MODES or cfg.skill_teacher_mode not in opd.TEACHER_MODES:
        fail(f"--skill_mode must be {'|'.join(analyzer.SKILL_MODES)} and --skill_teacher_mode "
             f"{'|'.join(opd.TEACHER_MODES)}, got {cfg.skill_mode!r}, {cfg.skill_teacher_mode!r}")
    if cfg.selector != "llm":
        fail(f"--selector {cfg.selector!r}: only llm (the analyzer picks the critical steps; the authors' SEED "
             f"accepts no other selector)")
    if cfg.max_step_skills < 0 or (cfg.skill_mode == "step_only" and cfg.max_step_skills == 0):
        fail(f"--max_step_skills must be 0 or more (at least 1 with --skill_mode step_only), got {cfg.max_step_skills}")
    if cfg.init and not os.path.isfile(os.path.join(cfg.init, "config.json")):
        fail(f"--init {cfg.init} is not a checkpoint folder (no config.json); run sft.py first, "
             f"or pass --init '' for the no-SFT ablation")
    if cfg.algo in LIBRARY and not os.path.isfile(library_path(cfg)):
        fail(f"--algo {cfg.algo} needs the Stage-1 skill library {library_path(cfg)!r} (written by sft.py "
             f"next to its checkpoint; or pass --skill_library)")
    for name in ("updates", "analyzer_retries"):
        if getattr(cfg, name) < 0:
            fail(f"--{name} must be 0 or more, got {getattr(cfg, name)}")
    if not 0.0 < cfg.train_fraction <= 1.0:
        fail(f"--train_fraction must be in (0, 1] (a share of the training tasks), got {cfg.train_fraction}")


def train_subset(num_tasks, fraction, seed):
    """The training task ids a run draws from (the sample-efficiency study, Table 6): the first
    ceil(fraction * num_tasks) (at least 1) of a permutation seeded by `seed`, sorted; 1 -> every task."""
    perm = np.random.default_rng([seed, 1]).permutation(num_tasks)   # a stream apart from the data order's
    k = max(1, math.ceil(round(fraction * num_tasks, 6)))            # round: 0.6 * 5 is 3.0000000000000004
    return np.sort(perm[:k])


def library_path(cfg):
    return cfg.skill_library or os.path.join(cfg.init, analyzer.SKILL_FILE)


def engine_context(cfg, model_path):
    """The rollout engine's max_model_len: the longest actor turn and, for the algorithms that analyze live,
    the longest analysis (its own prompt budget + answers; the larger of the two)."""
    context = cfg.max_prompt_tokens + cfg.max_tokens
    if cfg.algo in LIVE_ANALYZER:
        context = max(context, analyzer.analysis_budget(model_path, cfg.analyzer_max_prompt_tokens,
                                                        cfg.analyzer_max_tokens, cfg.analyzer_retries)[1])
    return context


def load_models(cfg, device, world, resuming):
    """The policy pi_theta (the run's checkpoint when resuming, else --init or the base model), wrapped for DDP /
    FSDP2, and the frozen reference pi_ref (the --init checkpoint, or the base model; only with the KL term).
    -> (model, no_grad_model, ref, tok, the folder the engine loads)."""
    init, ckpt = cfg.init or cfg.model, os.path.join(cfg.out, runfolder.CHECKPOINT)
    model, tok, init_path = rollout.load_model(ckpt if resuming else init)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref = None
    if cfg.algo not in NO_TRAINING and cfg.kl_coef > 0:
        ref, _, _ = rollout.load_model(init, dtype=resolved_dtype(cfg))   # frozen: bf16 on GPU
        ref = wrap(ref.requires_grad_(False).eval(), cfg, device, world, trainable=False)
    model = wrap(model, cfg, device, world)
    no_grad_model = unwrap(model) if not cfg.fsdp else model         # no-grad passes skip DDP's hooks
    ref = no_grad_model if ref is None else ref                      # kl_coef = 0: the KL term is unused
    return model, no_grad_model, ref, tok, ckpt if resuming else init_path


def build_run(cfg):
    """The run state, in an order a resumed run repeats exactly: process group, run folder, models, optimizer,
    data order, skill library, engine, the checkpoint's trainer state (--resume), envs. -> Run."""
    rank, world, device = setup_dist(cfg.seed)
    if cfg.tasks_per_update % world:
        fail(f"--tasks_per_update {cfg.tasks_per_update} must be a multiple of the {world} ranks")
    resuming = runfolder.open_folder(cfg, rank, world)
    model, no_grad_model, ref, tok, model_path = load_models(cfg, device, world, resuming)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data_rng = np.random.default_rng(cfg.seed)
    library = analyzer.SkillLibrary.load(library_path(cfg)) if cfg.algo in LIBRARY else None
    # one engine per rank (its own sampling seed), loaded with the policy's current weights
    engine = rollout.make_engine(cfg.engine, model_path, dtype=resolved_dtype(cfg), seed=cfg.seed,
                                 max_model_len=engine_context(cfg, model_path),
                                 gpu_memory_utilization=cfg.gpu_memory_utilization)
    start = runfolder.resume(cfg.out, model, opt, data_rng, engine) if resuming else 0
    n_local = cfg.tasks_per_update // world * cfg.group_size
    train_envs = [envs.from_config(cfg, "train") for _ in range(n_local)]
    train_ids = train_subset(train_envs[0].num_tasks, cfg.train_fraction, cfg.seed)
    if rank == 0 and cfg.train_fraction < 1:
        print(f"[seed] --train_fraction {cfg.train_fraction}: {len(train_ids)} of {train_envs[0].num_tasks} "
              f"training tasks", flush=True)
    eval_ids = {s: eval_task_ids(cfg, s, rank, world) for s in envs.EVAL_SPLITS[cfg.env]}
    return Run(cfg, rank, world, device, cfg.out, tok, model, no_grad_model, ref, opt, engine, data_rng, library,
               train_envs, train_ids, eval_ids, start=start)


def finish(run):
    if dist.is_initialized():
        dist.barrier()
    run.engine.close()   # first: vLLM's shutdown tears down its groups on top of the trainer's
    teardown_dist()
    if run.rank == 0:
        print(f"[seed] done: {os.path.join(run.run_dir, 'metrics.jsonl')}, {os.path.join(run.run_dir, 'curves.png')}, "
              f"{os.path.join(run.run_dir, runfolder.CHECKPOINT)}", flush=True)


# ----------------------------------------------------------------------------- main: Algorithm 1's loop

def main(argv=None):
    cfg = parse_config(argv)
    cfg.out = cfg.out or os.path.join("runs", f"{cfg.algo}-{cfg.env}")
    validate(cfg)
    if cfg.algo in NO_TRAINING:
        cfg.updates = 0                      # evaluation of the starting model only: no update to run
    run = build_run(cfg)
    with_skill = cfg.algo in ("skill_prompt", "skill_grpo_star")    # evaluated with the library skill
    if cfg.algo in NO_TRAINING:   # vanilla, skill_prompt: the starting model evaluated, no update
        metrics = {"update": 0} | run_eval(run, with_skill)
        if run.rank == 0:
            runfolder.write_metrics(run.run_dir, metrics)
            print(json.dumps(metrics), flush=True)
        return finish(run)

    if cfg.eval_first and run.start == 0:   # the starting policy, on the same held-out tasks
        t = time.time()
        metrics = {"update": -1} | run_eval(run, with_skill) | {"sec/eval": time.time() - t}
        if run.rank == 0:
            runfolder.write_metrics(run.run_dir, metrics)
    for u in range(run.start, cfg.updates):
        t0 = time.time()
        metrics, records = rl_update(u, run)
        metrics = {"update": u} | metrics
        last = u == cfg.updates - 1
        if cfg.eval_every and ((u + 1) % cfg.eval_every == 0 or last):
            t = time.time()
            metrics |= run_eval(run, with_skill)
            metrics["sec/eval"] = time.time() - t
        metrics["sec/total"] = time.time() - t0
        if run.rank == 0:
            runfolder.write_episodes(run.run_dir, u, records)
            runfolder.write_metrics(run.run_dir, metrics)
            runfolder.plot_curves(run.run_dir, runfolder.read_metrics(run.run_dir))
            print(runfolder.summary_line(metrics), flush=True)
        if (u + 1) % cfg.save_every == 0 or last:
            runfolder.save_checkpoint(run.run_dir, u + 1, run.model, run.opt, run.tok, run.data_rng, run.engine)
    return finish(run)


if __name__ == "__main__":
    main()
