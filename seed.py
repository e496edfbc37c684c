"""SEED Stage 2: on-policy skill generation and the joint objective (Section 3.3), one update of
Algorithm 1 (Appendix B.3) at a time.

    for update u = 0 .. updates-1:
        tasks      <- B tasks from the data-order RNG; each rank plays its share, N episodes per task
        episodes   <- collect(pi_old)                                  # multi-turn rollouts
        skills     <- analyze(pi_old, episodes)                        # the same snapshot, greedy (Section 3.3)
        A          <- group advantages of the step rows                # GRPO's group-normalized advantage
        lp_old     <- a no-grad pass, only when the rows span several mini-batches (old_logprobs)
        lp_ref     <- a no-grad pass, only when kl_coef > 0
        lp_skill   <- rescore(pi_old, rows, skill inserted)            # dual-context re-scoring (Section 3.3):
                                                                       # step or episode skill (opd.teacher_skills)
        for each mini-batch:  L = L_pg + kl_coef L_kl - ent_coef H + lambda_opd L_opd   (the joint objective)
        AdamW step; push the new weights into the rollout engine (pi_old <- pi_theta)

Baselines (Section 4.1, Appendix B.2) are entries of ALGOS, read by the same loop. Reading order: Algo, Config,
Run, rl_update (the loop above), micro_loss and update_policy (the joint objective), validate, build_run, main.
"""
import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

import analyzer
import diagnostics
import envs
import grpo
import opd
import rollout
import runfolder
from parallel import all_sum, autocast, chunked, gather, grad_sync, resolved_dtype, setup_dist
from runfolder import fail, timed

if TYPE_CHECKING:
    import transformers


@dataclass(frozen=True)
class Algo:
    """What an --algo is made of (Section 4.1, Appendix B.2; README's table): the loop reads these, never a name."""
    skills: str = "none"               # skill source (teacher_skills): live (the snapshot's analyses) | library | none
    in_context: bool = False           # the skill in the actor's own prompt, in rollout and update
    eval_skill: bool = False           # evaluated with the library skill in the prompt
    pg: bool = True                    # GRPO's policy-gradient term in the loss
    distill: str = "none"              # teacher term: none | opd (gated) | opsd (ungated) | rlsd (a weight on pg)
    lambda_opd: float | None = None    # weight of an opd / opsd term (None: --lambda_opd)
    train: bool = True                 # False: the starting model evaluated, no update


ALGOS = {
    "seed": Algo(skills="live", distill="opd"),
    "grpo": Algo(),
    "vanilla": Algo(train=False),
    "skill_prompt": Algo(skills="library", eval_skill=True, train=False),
    "skill_grpo": Algo(skills="library", in_context=True),
    "skill_grpo_star": Algo(skills="library", in_context=True, eval_skill=True),
    "static_skills": Algo(skills="library", distill="opd"),
    "opsd": Algo(skills="live", pg=False, distill="opsd", lambda_opd=1.0),
    "grpo_opsd": Algo(skills="live", distill="opsd"),
    "rlsd": Algo(skills="live", distill="rlsd"),
    "skill_sd": Algo(skills="library", distill="opsd"),
    "opd_only": Algo(skills="live", pg=False, distill="opd", lambda_opd=1.0),   # pure distillation: no GRPO term
}
TEACHERS = ("live", "oracle", "hindsight")   # --teacher: the analyzer, or the scripted annotator (testbed)
MAX_SKIPS = 3     # optimizer steps in a row with a non-finite grad norm before the run stops (update_policy)
RLSD_EPS = 0.2   # RLSD's bound on its per-token weight, w in [1 - eps, 1 + eps] (value not given: PPO's clip)


@dataclass
class Config:
    # -- run
    env: str = "alfworld"              # benchmark: alfworld | webshop | search | sokoban | ezpoints
    model: str = "smollm2-135m"        # base model: "smollm2-135m" (embedded), a local folder or a cached HF name
    init: str = ""                     # Stage-1 checkpoint (sft.py --out); "" = the no_sft ablation (RL from --model)
    algo: str = "seed"                 # seed, or a baseline of README's table (an entry of seed.ALGOS)
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
    dtype: str = "auto"                # engine and autocast dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    fsdp: bool = False                 # shard the policy and reference with FSDP2 (fully_shard) instead of DDP
    gradient_checkpointing: bool = False   # recompute activations in the backward (large models)
    gpu_memory_utilization: float = 0.3    # the vLLM engine's share of each GPU while awake (bench/memory.py)
    # -- analyzer (Section 3.3, on-policy skill generation)
    analyzer_max_prompt_tokens: int = 16384   # the analyzer's own prompt budget (authors'): episodes are read whole
    analyzer_max_tokens: int = 1024    # new tokens per analysis (authors' cap 4096; the JSON needs a few hundred)
    analyzer_retries: int = 0          # corrective re-asks on a parse failure (authors: none; ours rescued nothing)
    skill_library: str = ""            # Stage-1 skill library ("" = <init>/skills.jsonl)
    teacher: str = "live"              # a live algo's skill writer: live (the snapshot: the method) | oracle | hindsight
                                       # (the scripted annotator knowing the game / what the episode saw: README)
    skill_mode: str = "episode_only"   # skills the analyzer writes: episode_only (the authors' SEED launchers) |
                                       # episode_step | step_only (critical-step skills, their _common default)
    skill_teacher_mode: str = "step_priority"   # a step with a step skill: step_priority (it alone) | additive (both)
    max_step_skills: int = 5           # step skills per episode at most (authors' launchers: 5; Search 2)
    # -- objective (the joint objective, Section 3.3; values of Appendix B.4 and the official launchers)
    lr: float = 1e-6                   # AdamW learning rate, constant after the warm-up
    lr_warmup: float = 0.0             # share of the updates with a linear lr warm-up from 0 (Search 0.1)
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
    tis_cap: float = 0.0               # GRPO's loss x min(pi_old / pi_engine, cap) per token (0 = off, as the authors)
    adv_norm: str = "std"              # std | mean_norm (no division by the std; official WebShop launcher)
    adv_level: str = "step"            # step (every step row counts, official code) | trajectory (the paper's formula)
    # -- evaluation (no skill, temperature 0.4)
    eval_every: int = 5                # evaluate every this many updates (and after the last); 0 = never
    eval_tasks: int = 128              # held-out tasks per split, one episode each (0 = the whole split)
    eval_temperature: float = 0.4      # sampling temperature at evaluation
    eval_greedy: bool = False          # also evaluate greedily (temperature 0), logged as eval_greedy/<split>/...
    eval_first: bool = False           # also evaluate the starting policy, before update 0 (a line with update -1)
    # -- checkpoints
    save_every: int = 10               # checkpoint every this many updates (and after the last)
    track: str = ""                    # also log each metrics.jsonl line and the config to tensorboard | wandb ("" = off)
    webshop_small: bool = True         # WebShop: the 1,000-product catalogue (authors' use_small); no: every product
    webshop_human_goals: bool = False  # WebShop: human-written goals (authors: False, synthetic goals)
    webshop_train_from: int = 500      # WebShop: first training goal index (authors 500; test = goals [0, 500))


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
    library: "analyzer.SkillLibrary | None"   # the Stage-1 skill library (algos whose skills are "library"), else None
    train_envs: list                   # this rank's training envs, one per episode of an update
    train_ids: np.ndarray              # the training task ids updates draw from (all, or --train_fraction's)
    eval_ids: dict                     # split -> this rank's held-out task ids
    eval_envs: dict = field(default_factory=dict)   # split -> its envs, made at the first evaluation
    start: int = 0                     # the first update to run (the checkpoint's next one when resuming)
    skip_streak: int = 0               # optimizer steps skipped in a row (update_policy)


# ----------------------------------------------------------------------------- one update (Algorithm 1)

def rl_update(u, run):
    """Algorithm 1, one iteration. -> (metrics, every rank's episode records)."""
    cfg, algo, rank, sec = run.cfg, ALGOS[run.cfg.algo], run.rank, {}
    with timed(sec, "collect"):   # 1. collect with the snapshot pi_old
        ids = run.train_ids                    # every training task, or the --train_fraction subset
        tasks = run.data_rng.choice(ids, size=cfg.tasks_per_update, replace=len(ids) < cfg.tasks_per_update).tolist()
        mine = tasks[rank::run.world]
        ctx_skills = run.library.for_tasks(run.train_envs[0], mine) if algo.in_context else None
        episodes = rollout.collect(run.engine, run.tok, run.train_envs, mine, cfg.group_size, cfg.temperature,
                                   cfg.max_tokens, skills=ctx_skills, progress=rank == 0)
    with timed(sec, "analyze"):   # 2. the teacher's skills -> episode.skill (and step skills)
        stats = teacher_skills(run, algo, episodes)
    records = [r for part in gather([runfolder.episode_record(ep) for ep in episodes]) for r in part]
    run.engine.sleep()
    with timed(sec, "logprobs"):
        steps = [s for ep in episodes for s in ep.steps]   # 3. rows, rewards, advantages (has_skill: a teacher)
        teachers = opd.row_teachers(episodes, cfg)        # per row: (episode skill, step skill) or None
        rescored = algo.distill != "none"
        rows, row_episode = grpo.make_rows(episodes, steps, run.train_envs[0].invalid_penalty, cfg,
                                           teachers if rescored else None)
        # 4. log pi_old and log pi_ref, each a no-grad pass only when needed
        rows.old = old_logprobs(run, rows)
        if cfg.kl_coef > 0:
            rows.ref = grpo.batch_logprobs(run.ref, rows, run.tok.pad_token_id, cfg.micro_batch_size, cfg.fsdp,
                                           resolved_dtype(cfg))
    with timed(sec, "rescore"):   # 5. re-score under the skill-augmented context
        if rescored:
            rows.lp_skill = opd.rescore_rows(run.no_grad_model, run.tok, steps, teachers, cfg)
    with timed(sec, "update"):    # 6. mini-batch updates of the joint objective, one pass, rows shuffled
        order = np.random.default_rng([cfg.seed, u, rank]).permutation(len(rows))
        for group in run.opt.param_groups:
            group["lr"] = learning_rate(cfg, u)
        sums, norms, own_lp = update_policy(run, rows, order, u)
    with timed(sec, "diagnostics"):   # can the teacher teach? (tie share; the skill's shift on action tokens)
        lp_old = rows.old if rows.old is not None else own_lp
        diag = (diagnostics.teacher_diagnostics(run.tok, cfg, rows, lp_old, steps, teachers if rescored else None,
                                                [episodes[e].group_id for e in row_episode])
                | diagnostics.engine_gap(rows.engine, lp_old))
        if rank == 0:   # tokens.json / tokens.html: a few rows, each token with its gate
            runfolder.write_token_page(run.run_dir, u, diagnostics.shown_rows(run.tok, rows, lp_old, steps, episodes,
                                                                              row_episode, cfg.beta_opd))
    with timed(sec, "push"):      # 7. the new weights become the next snapshot pi_old (actor and analyzer)
        rollout.push(run.engine, run.model, run.opt)
    step_skills = algo.skills == "live" and cfg.skill_mode != "episode_only"   # the analyzer wrote step skills
    return (rollout.episode_metrics(episodes, stats) | (diagnostics.step_skill_metrics(episodes, teachers) if step_skills
            else {}) | loss_metrics(sums, norms, algo) | {"lr": run.opt.param_groups[0]["lr"]} | diag | sec, records)


def teacher_skills(run, algo, episodes):
    """Each episode's skill by the algo's skill source: live, the snapshot analyzes it (greedy, Section 3.3), or
    with --teacher oracle / hindsight the scripted annotator does (the testbed's oracle teacher, not the method);
    library, a Stage-1 skill by family then BM25, where a teacher is scored (static skills, Skill-SD).
    -> the analyzer's counts ({} when it did not run)."""
    if algo.skills == "live" and run.cfg.teacher != "live":   # a scripted teacher in the analyzer's place
        for ep in episodes:
            a = analyzer.scripted_analysis(ep, run.cfg.max_steps, run.cfg.max_step_skills, run.cfg.teacher == "oracle")
            ep.summary, ep.skill, ep.step_skills = a["episode_summary"], a["episode_skill"], a["step_skills"]
        return {}
    if algo.skills == "live":
        return analyzer.self_analyze(run.engine, run.tok, episodes, run.cfg, run.rank == 0)
    if algo.skills == "library" and algo.distill != "none":
        for ep in episodes:
            ep.skill = run.library.retrieve(run.cfg.env, ep.family, analyzer.episode_key(ep))
    return {}


def learning_rate(cfg, u):
    """Update u's lr: a linear warm-up from 0 over the first int(lr_warmup * updates) updates, then constant (the
    authors' constant schedule with warm-up, stepped once per update: update 0 of a warm-up trains at lr 0)."""
    warm = int(cfg.lr_warmup * cfg.updates)
    return cfg.lr * min(1.0, u / warm) if warm else cfg.lr


def old_logprobs(run, rows):
    """log pi_old of the rows, decided here: a no-grad pass of the snapshot when the rows span several mini-batches
    (the later ones run after AdamW steps); None with one, whose own forward runs on pi_old's weights: micro_loss
    takes the ratio against that forward, update_policy returns its log-probs (no extra pass)."""
    if all_sum(len(rows)) <= run.cfg.mini_batch_size:
        return None
    return grpo.batch_logprobs(run.no_grad_model, rows, run.tok.pad_token_id, run.cfg.micro_batch_size,
                               run.cfg.fsdp, resolved_dtype(run.cfg))


# ----------------------------------------------------------------------------- the joint objective (Section 3.3)

def micro_loss(run, mb, n_tok, n_skill, progress=0.0):
    """The joint loss of one micro-batch as its share of the global token means, with the terms of the run's
    algo (ALGOS). n_tok / n_skill: response tokens / tokens of rows with a skill in the whole mini-batch over
    all ranks; progress: the share of the run's updates done (RLSD's anneal).
    -> (loss, sums for the metrics, this forward's log-probs [rows, R], detached)."""
    cfg, algo = run.cfg, ALGOS[run.cfg.algo]
    with autocast(run.device, resolved_dtype(cfg)):
        lp, mask, ent = grpo.response_logprobs(run.model, mb.prompts, mb.responses, run.tok.pad_token_id,
                                               grad=True, entropy=cfg.ent_coef > 0)   # [rows, R]
    padded = lambda x: None if x is None else grpo.pad(x, lp.shape[1]).to(lp.device)
    ref, lp_skill = padded(mb.ref), padded(mb.lp_skill)                            # [rows, R]
    old = lp.detach() if mb.old is None else padded(mb.old)                        # [rows, R] (old_logprobs)
    adv = mb.adv.to(lp.device)                                                     # [rows]
    skill_mask = mb.has_skill.to(lp.device)[:, None] * mask                        # [rows, R]
    pg = grpo.policy_loss(lp, old, adv, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip)   # [rows, R]
    if cfg.tis_cap > 0:   # the engine sampled the tokens, not pi_old: weight by the truncated ratio (README: TIS)
        pg = pg * torch.exp(old - padded(mb.engine)).clamp(max=cfg.tis_cap).detach()  # [rows, R]
    w = None
    if algo.distill == "rlsd":                          # teacher gap = per-token magnitude, A = direction
        w = 1.0 + skill_mask * (opd.rlsd_weights(lp, lp_skill, adv, RLSD_EPS, 1.0 - progress) - 1.0)   # [rows, R]
        pg = pg * w
    terms = {"pg": pg if algo.pg else None,
             "kl": grpo.kl_k3(lp, ref) if ref is not None else None,               # [rows, R] k3 KL
             "entropy": ent,
             "opd": (opd.opd_loss(lp, lp_skill, cfg.beta_opd) if algo.distill == "opd" else   # [rows, R] gated
                     opd.opsd_loss(lp, lp_skill) if algo.distill == "opsd" else None)}        # [rows, R] ungated
    lambda_opd = cfg.lambda_opd if algo.lambda_opd is None else algo.lambda_opd
    coefs = {"kl": cfg.kl_coef, "entropy": cfg.ent_coef, "opd": lambda_opd if terms["opd"] is not None else 0.0}
    # DDP and FSDP average gradients over ranks: divide by the global counts / world (grpo.masked_mean).
    loss, _ = grpo.joint_loss(terms, mask, coefs, skill_mask, n_tok, n_skill, world=run.world)
    with torch.no_grad():
        g = opd.gates(lp, lp_skill, cfg.beta_opd) if terms["opd"] is not None else torch.zeros_like(lp)   # [rows, R]
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))                          # [rows, R]
        A = adv[:, None]
        clipped = ((A > 0) & (ratio > 1 + cfg.clip_high)) | ((A < 0) & (ratio < 1 - cfg.clip_low))
        sums = {k: (t * (skill_mask if k == "opd" else mask)).sum() for k, t in terms.items() if t is not None}
        sums |= {"gate": (g * skill_mask).sum(), "gate_sq": (g * g * skill_mask).sum(),
                 "rlsd_weight": (w * skill_mask).sum() if w is not None else 0.0,
                 "skill_tokens": skill_mask.sum(), "clipped": (clipped * mask).sum(), "tokens": mask.sum()}
    return loss, {k: float(v) for k, v in sums.items()}, lp.detach()


def update_policy(run, rows, order=None, update=0):
    """One pass over the rows in mini-batches (ppo_epochs = 1); each mini-batch is one AdamW step of run.model on
    the token-mean joint loss over all ranks' rows (optimizer_step). `order`: this rank's row order (shuffled by the
    caller); `update`: the update's index (RLSD's anneal: update / updates). -> (the statistics of every
    micro-batch, summed over ranks; the finite grad norms; log pi_old of each row from its own forward where
    rows.old is None and the rows are one mini-batch (old_logprobs), else None)."""
    cfg, model = run.cfg, run.model
    order = list(range(len(rows))) if order is None else list(order)
    n_mb = max(1, math.ceil(all_sum(len(rows)) / cfg.mini_batch_size))
    totals, norms, skipped = {}, [], 0
    own = [None] * len(rows) if rows.old is None and n_mb == 1 else None   # pi_old = this forward's
    bar = tqdm(total=n_mb, desc="update", disable=runfolder.progress_off(run.rank == 0), leave=False)
    for part in np.array_split(np.array(order, dtype=np.int64), n_mb):
        part = grpo.by_length(part.tolist(), rows.prompts, rows.responses)   # same gradient, less padding
        # global counts of this mini-batch: response tokens, and tokens of rows with a skill (the OPD mean)
        n_tok, n_skill = all_sum([sum(len(rows.responses[i]) for i in part),
                                  sum(len(rows.responses[i]) * float(rows.has_skill[i]) for i in part)])
        micros = chunked(len(part), cfg.micro_batch_size, same_count=True)
        run.opt.zero_grad(set_to_none=True)
        for k, idx in enumerate(micros):
            ids = [part[j] for j in idx] if idx else [0]   # no rows left here: a filler forward of row 0, weight 0
            with grad_sync(model, k == len(micros) - 1):
                loss, sums, lp = micro_loss(run, rows.take(ids), max(n_tok, 1.0), n_skill, update / max(cfg.updates, 1))
                (loss if idx else loss * 0.0).backward()
            if idx:
                for i, t in zip(ids, grpo.trim(lp, [len(rows.responses[i]) for i in ids]) if own else []):
                    own[i] = t
                for key, v in sums.items():
                    totals[key] = totals.get(key, 0.0) + v
        skipped += not optimizer_step(run, norms, update)
        bar.update(1)
    bar.close()
    keys = sorted(totals) or ["tokens"]
    summed = dict(zip(keys, all_sum([totals.get(k, 0.0) for k in keys])))
    summed["skipped_steps"] = float(skipped)   # the same on every rank (the norm is global): not summed
    return summed, norms, own


def optimizer_step(run, norms, update):
    """Clip the global grad norm, step AdamW; skip a non-finite norm (the authors' dp_actor); MAX_SKIPS in a row stop."""
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)   # global: every rank agrees
    if math.isfinite(norm):
        run.opt.step()
        norms.append(norm)
        run.skip_streak = 0
        return True
    run.opt.zero_grad(set_to_none=True)
    run.skip_streak += 1
    if run.skip_streak >= MAX_SKIPS:
        raise RuntimeError(f"update {update}: {run.skip_streak} optimizer steps in a row had a non-finite gradient "
                           f"norm ({norm}); stopping with the last finite weights (check --lr, the data and the dtype)")
    return False


def loss_metrics(s, norms, algo):
    """Sums over the update -> every loss term the algo has, as it enters L: pg (and clip_frac), kl, entropy over
    all response tokens; OPD over the tokens of rows with a skill (0 when there were none, as in L). The gate
    and RLSD weight statistics are over the skill tokens too (nan when there were none)."""
    n, ns = max(s.get("tokens", 0.0), 1.0), s.get("skill_tokens", 0.0)
    per_skill = lambda k: s.get(k, 0.0) / ns if ns else float("nan")
    out = {"loss/kl": s.get("kl", 0.0) / n, "loss/entropy": s.get("entropy", 0.0) / n,
           "grad_norm": float(np.mean(norms)) if norms else 0.0,
           "tokens": s.get("tokens", 0.0), "update/skipped_steps": s.get("skipped_steps", 0.0)}
    if algo.pg:
        out |= {"loss/pg": s.get("pg", 0.0) / n, "clip_frac": s.get("clipped", 0.0) / n}
    if algo.distill != "none":
        out["skill_token_frac"] = ns / n
    if algo.distill in ("opd", "opsd"):
        gate_mean = per_skill("gate")
        gate_var = per_skill("gate_sq") - gate_mean ** 2
        out |= {"loss/opd": s.get("opd", 0.0) / ns if ns else 0.0, "gate/mean": gate_mean,
                "gate/std": math.sqrt(max(gate_var, 0.0)) if ns else float("nan")}
    if algo.distill == "rlsd":
        out["rlsd/weight_mean"] = per_skill("rlsd_weight")
    return out


# ----------------------------------------------------------------------------- set-up: flags, the run state, the end

def parse_config(argv=None):
    """Flags -> Config (every field a flag; precedence: flag > the env class's `defaults` > default). An algo that
    fixes lambda_opd (ALGOS) stops on an --lambda_opd of another value instead of ignoring it."""
    cfg = runfolder.parse_config(argv, Config, envs.defaults(), __doc__)
    flag = argparse.ArgumentParser(add_help=False)
    flag.add_argument("--lambda_opd", type=float)
    given = flag.parse_known_args(argv)[0].lambda_opd                  # None unless the flag was passed
    fixed = ALGOS[cfg.algo].lambda_opd if cfg.algo in ALGOS else None
    if fixed is not None and given is not None and given != fixed:
        fail(f"--algo {cfg.algo} fixes lambda_opd at {fixed:g}: drop --lambda_opd {given:g}")
    return cfg


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
    if cfg.skill_mode == "step_only" and cfg.max_step_skills == 0:   # (the ranges: runfolder.FLAG_CHECKS)
        fail("--skill_mode step_only needs --max_step_skills 1 or more")
    if cfg.teacher not in TEACHERS or (cfg.teacher != "live" and ALGOS[cfg.algo].skills != "live"):
        fail(f"--teacher must be {'|'.join(TEACHERS)}, and other than live only for an algo whose skills are live "
             f"({', '.join(k for k, a in ALGOS.items() if a.skills == 'live')}); got {cfg.teacher!r} with {cfg.algo}")
    if cfg.init and not os.path.isfile(os.path.join(cfg.init, "config.json")):
        fail(f"--init {cfg.init} is not a checkpoint folder (no config.json); run sft.py first, "
             f"or pass --init '' for the no-SFT ablation")
    if ALGOS[cfg.algo].skills == "library" and not os.path.isfile(library_path(cfg)):
        fail(f"--algo {cfg.algo} needs the Stage-1 skill library {library_path(cfg)!r} (written by sft.py "
             f"next to its checkpoint; or pass --skill_library)")


def library_path(cfg):
    return cfg.skill_library or os.path.join(cfg.init, analyzer.SKILL_FILE)


def engine_context(cfg, model_path):
    """The engine's max_model_len: the longest actor turn or, analyzing live, the longest analysis if longer."""
    context = cfg.max_prompt_tokens + cfg.max_tokens
    if ALGOS[cfg.algo].skills == "live":
        context = max(context, analyzer.analysis_budget(model_path, cfg.analyzer_max_prompt_tokens,
                                                        cfg.analyzer_max_tokens, cfg.analyzer_retries)[1])
    return context


def build_run(cfg):
    """The run state, in an order a resumed run repeats exactly: process group, run folder, models, optimizer,
    data order, skill library, engine, the checkpoint's trainer state (--resume), envs. -> Run."""
    rank, world, device = setup_dist(cfg.seed)
    if cfg.tasks_per_update % world:
        fail(f"--tasks_per_update {cfg.tasks_per_update} must be a multiple of the {world} ranks")
    resuming = runfolder.open_folder(cfg, rank, world)
    ckpt = os.path.join(cfg.out, runfolder.CHECKPOINT) if resuming else None
    model, no_grad_model, ref, tok, model_path = rollout.load_policy(cfg, device, world, ckpt,
                                                                     ALGOS[cfg.algo].train and cfg.kl_coef > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data_rng = np.random.default_rng(cfg.seed)
    library = analyzer.SkillLibrary.load(library_path(cfg)) if ALGOS[cfg.algo].skills == "library" else None
    # one engine per rank (its own sampling seed), loaded with the policy's current weights
    engine = rollout.make_engine(cfg.engine, model_path, dtype=resolved_dtype(cfg), seed=cfg.seed,
                                 max_model_len=engine_context(cfg, model_path),
                                 gpu_memory_utilization=cfg.gpu_memory_utilization)
    start = runfolder.resume(cfg.out, model, opt, data_rng, engine) if resuming else 0
    n_local = cfg.tasks_per_update // world * cfg.group_size
    train_envs = [envs.from_config(cfg, "train") for _ in range(n_local)]
    train_ids = envs.train_subset(train_envs[0].num_tasks, cfg.train_fraction, cfg.seed)
    if rank == 0 and cfg.train_fraction < 1:
        print(f"[seed] --train_fraction {cfg.train_fraction}: {len(train_ids)} of {train_envs[0].num_tasks} "
              f"training tasks", flush=True)
    eval_ids = {s: envs.eval_task_ids(cfg, s, rank, world) for s in envs.env_class(cfg.env).eval_splits}
    return Run(cfg, rank, world, device, cfg.out, tok, model, no_grad_model, ref, opt, engine, data_rng, library,
               train_envs, train_ids, eval_ids, start=start)


# ----------------------------------------------------------------------------- main: Algorithm 1's loop

def main(argv=None):
    runfolder.quiet_console()   # the libraries' warnings and bars off unless SEED_VERBOSE=1
    cfg = parse_config(argv)
    cfg.out = cfg.out or os.path.join("runs", f"{cfg.algo}-{cfg.env}")
    validate(cfg)
    algo = ALGOS[cfg.algo]
    cfg.updates = cfg.updates if algo.train else 0   # vanilla, skill_prompt: the starting model evaluated, no update
    run = build_run(cfg)
    if not algo.train or (cfg.eval_first and run.start == 0):   # the starting policy, on the held-out tasks
        t = time.time()
        metrics = {"update": -1 if algo.train else 0} | rollout.run_eval(run, algo.eval_skill)
        metrics |= {"sec/eval": time.time() - t} if algo.train else {}
        if run.rank == 0:
            runfolder.write_metrics(run.run_dir, metrics)
            if not algo.train:
                print(json.dumps(metrics), flush=True)
    for u in range(run.start, cfg.updates):
        t0 = time.time()
        metrics, records = rl_update(u, run)
        metrics = {"update": u} | metrics
        last = u == cfg.updates - 1
        if cfg.eval_every and ((u + 1) % cfg.eval_every == 0 or last):
            t = time.time()
            metrics |= rollout.run_eval(run, algo.eval_skill)
            metrics["sec/eval"] = time.time() - t
        metrics["sec/total"] = time.time() - t0
        if run.rank == 0:
            runfolder.write_episodes(run.run_dir, u, records)
            runfolder.write_metrics(run.run_dir, metrics)
            runfolder.plot_curves(run.run_dir, runfolder.read_metrics(run.run_dir))
            print(runfolder.summary_line(metrics), flush=True)
        if (u + 1) % cfg.save_every == 0 or last:
            runfolder.save_checkpoint(run.run_dir, u + 1, run.model, run.opt, run.tok, run.data_rng, run.engine)
    return runfolder.finish(run)


if __name__ == "__main__":
    main()
