"""SEED Stage 2: on-policy skill generation and the joint objective (Section 3.3), one update of
Algorithm 1 (Appendix B.3) at a time.

    for update u = 0 .. updates-1:
        tasks      <- B tasks from the data-order RNG; each rank plays its share, N episodes per task
        episodes   <- collect(pi_old)                                  # multi-turn rollouts
        skills     <- analyze(pi_old, episodes)                        # the same snapshot, greedy (Section 3.3)
        A          <- group advantages of the step rows                # GRPO's group-normalized advantage
        lp_ref, lp_old <- one no-grad pass each over the rows
        lp_skill   <- rescore(pi_old, rows, skill inserted)            # dual-context re-scoring (Section 3.3)
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
everything lands in `runs/<name>/` (DESIGN section 8).
"""
import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import analyzer
import envs
import grpo
import opd
import rollout

ALGOS = ("seed", "grpo", "vanilla", "skill_prompt", "skill_grpo", "skill_grpo_star", "static_skills", "opsd",
         "grpo_opsd", "rlsd", "skill_sd")
LIVE_ANALYZER = ("seed", "opsd", "grpo_opsd", "rlsd")   # skills from the live analyzer (the snapshot itself)
LIBRARY = ("skill_prompt", "skill_grpo", "skill_grpo_star", "static_skills", "skill_sd")   # Stage-1 skill library
IN_CONTEXT = ("skill_grpo", "skill_grpo_star")          # the library skill in the actor's own context
DISTILL = ("seed", "static_skills", "opsd", "grpo_opsd", "skill_sd")   # an OPD / OPSD term in the loss
RESCORE = DISTILL + ("rlsd",)                           # needs lp_skill (the teacher: skill in context)
NO_TRAINING = ("vanilla", "skill_prompt")               # evaluate the starting model, no update
RLSD_EPS = 0.2   # RLSD's bound on its per-token weight, w in [1 - eps, 1 + eps] (value not given: PPO's clip)
EVAL_SPLITS = {"alfworld": ("valid_seen", "valid_unseen"), "webshop": ("test",), "search": ("test",),
               "sokoban": ("test",), "ezpoints": ("test",)}
SKILL_FILE = "skills.jsonl"    # the skill library that sft.py writes next to its checkpoint


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
    # -- tasks and episodes (DESIGN section 3, one column per env)
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


# The env columns of DESIGN section 3 (ALFWorld = the dataclass defaults).
ENV_DEFAULTS = {
    "alfworld": dict(),
    "webshop": dict(max_steps=15, history_length=2, max_prompt_tokens=4096, adv_norm="mean_norm"),
    "search": dict(tasks_per_update=128, max_steps=4, history_length=4, max_prompt_tokens=4096,
                   kl_coef=0.001, ent_coef=0.0),
    "sokoban": dict(max_steps=15, history_length=2, max_prompt_tokens=1024, max_tokens=256),
    "ezpoints": dict(max_steps=5, history_length=2, max_prompt_tokens=1024, max_tokens=256),
}


# ----------------------------------------------------------------------------- config

def parse_config(argv=None, cls=Config, env_defaults=ENV_DEFAULTS, doc=__doc__):
    """Every dataclass field is a flag (its comment is the help). Precedence: flag > --env column > default."""
    import inspect
    import re
    comments = dict(re.findall(r"^\s+(\w+): .*?# (.*)$", inspect.getsource(cls), flags=re.M))
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    for f in dataclasses.fields(cls):
        help = f"{comments.get(f.name, '')} (default: {f.default})"
        if f.type in (bool, "bool"):
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            p.add_argument(f"--{f.name}", type=typ, default=argparse.SUPPRESS, help=help)
    given = vars(p.parse_args(argv))
    env = given.get("env", cls.env)
    return cls(**{**env_defaults.get(env, {}), **given})


def fail(msg):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def validate(cfg):
    """Stop at start-up, naming the problem, before any model is loaded."""
    if cfg.env not in envs.NAMES:
        fail(f"unknown --env {cfg.env!r}; choose one of {', '.join(envs.NAMES)}")
    if cfg.algo not in ALGOS:
        fail(f"unknown --algo {cfg.algo!r}; choose one of {', '.join(ALGOS)}")
    if cfg.engine not in ("vllm", "hf"):
        fail(f"unknown --engine {cfg.engine!r}; choose vllm or hf")
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        fail(f"unknown --dtype {cfg.dtype!r}; choose auto, float32, bfloat16 or float16")
    if cfg.adv_norm not in ("std", "mean_norm") or cfg.adv_level not in ("step", "trajectory"):
        fail("--adv_norm must be std|mean_norm and --adv_level step|trajectory")
    if cfg.data_dir and not os.path.isdir(cfg.data_dir) and not os.path.isfile(cfg.data_dir):
        fail(f"--data_dir {cfg.data_dir} does not exist")
    if cfg.env == "alfworld" and not cfg.data_dir:
        from envs.alfworld import HOW_TO_GET_GAMES, find_data_dir
        try:
            find_data_dir(None)
        except Exception:
            fail(f"no ALFWorld games found (data/alfworld or $ALFWORLD_DATA); {HOW_TO_GET_GAMES}")
    if cfg.init and not os.path.isfile(os.path.join(cfg.init, "config.json")):
        fail(f"--init {cfg.init} is not a checkpoint folder (no config.json); run sft.py first, "
             f"or pass --init '' for the no-SFT ablation")
    if cfg.algo in LIBRARY and not os.path.isfile(library_path(cfg)):
        fail(f"--algo {cfg.algo} needs the Stage-1 skill library {library_path(cfg)!r} (written by sft.py "
             f"next to its checkpoint; or pass --skill_library)")
    for name in ("updates", "tasks_per_update", "group_size", "max_steps", "max_tokens",
                 "mini_batch_size", "micro_batch_size", "analyzer_max_tokens", "analyzer_max_prompt_tokens"):
        if getattr(cfg, name) < (0 if name == "updates" else 1):
            fail(f"--{name} must be positive, got {getattr(cfg, name)}")
    if cfg.analyzer_retries < 0:
        fail(f"--analyzer_retries must be 0 or more, got {cfg.analyzer_retries}")
    if not 0.0 < cfg.train_fraction <= 1.0:
        fail(f"--train_fraction must be in (0, 1] (a share of the training tasks), got {cfg.train_fraction}")
    if cfg.image and cfg.env not in ("sokoban", "ezpoints"):
        fail(f"--image is for sokoban and ezpoints (Appendix C.3), not {cfg.env}")


def train_subset(num_tasks, fraction, seed):
    """The training task ids a run draws from (the sample-efficiency study, Table 6): the first
    ceil(fraction * num_tasks) (at least 1) of a permutation seeded by `seed`, sorted; 1 -> every task."""
    perm = np.random.default_rng([seed, 1]).permutation(num_tasks)   # a stream apart from the data order's
    k = max(1, math.ceil(round(fraction * num_tasks, 6)))            # round: 0.6 * 5 is 3.0000000000000004
    return np.sort(perm[:k])


def library_path(cfg):
    return cfg.skill_library or os.path.join(cfg.init, SKILL_FILE)


# ----------------------------------------------------------------------------- distributed

_own_group = False   # setup_dist made the process group (not a vLLM engine of this process): ours to destroy


def setup_dist(seed):
    """torchrun -> one process group (nccl on GPU, gloo on CPU); plain python -> world of one.
    -> (rank, world, device). Seeds python/numpy/torch with seed + rank."""
    global _own_group
    rank, world = 0, 1
    device = torch.device("cpu")
    if "RANK" in os.environ and not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
        _own_group = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    return rank, world, device


def teardown_dist():
    """Destroy the process group setup_dist made; a group an engine made for itself is left alone."""
    global _own_group
    if _own_group and dist.is_initialized():
        dist.destroy_process_group()
    _own_group = False


def all_sum(x):
    """Sum a python number (or list of numbers) over ranks; float64 so counts stay exact."""
    t = torch.tensor(x, dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
    return t.cpu().tolist()


def all_max(x):
    t = torch.tensor(x, dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def gather(obj):
    """-> list of every rank's obj (a python object), on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def wrap(model, cfg, device, world, trainable=True):
    """DDP (gradients averaged over ranks) or FSDP2 (`fully_shard` per decoder layer, then the root).
    On GPU, FSDP2 gathers parameters in the compute dtype and reduces gradients in float32; DDP's
    gradients are views into its buckets (one gradient copy, not two)."""
    model.to(device)
    if cfg.fsdp and world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy()
        if device.type == "cuda":
            mp = MixedPrecisionPolicy(param_dtype=getattr(torch, resolved_dtype(cfg)), reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    if trainable and world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        ddp.device = device   # grpo.response_logprobs reads `model.device`
        return ddp
    return model


def unwrap(model):
    return model.module if hasattr(model, "module") else model


@contextlib.contextmanager
def grad_sync(model, enabled):
    """Accumulate micro-batch gradients locally; reduce them over ranks only on the last backward."""
    if hasattr(model, "no_sync"):                                   # DDP
        with (contextlib.nullcontext() if enabled else model.no_sync()):
            yield
    else:
        if hasattr(model, "set_requires_gradient_sync"):            # FSDP2
            model.set_requires_gradient_sync(enabled)
        yield


def autocast(device, dtype):
    """bf16 compute on GPU (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda" and dtype != "float32":
        return torch.autocast("cuda", dtype=getattr(torch, dtype))
    return contextlib.nullcontext()


def chunked(n, size, same_count):
    """Index chunks [0:size], [size:2 size], ... With same_count every rank gets the same number of chunks
    (the max over ranks; the missing ones are None and the caller runs a throw-away forward): FSDP
    all-gathers shards in every forward, and DDP reduces gradients in the last backward of a step."""
    count = math.ceil(n / size)
    if same_count:
        count = int(all_max(count))
    return [list(range(i * size, min(n, (i + 1) * size))) if i * size < n else None for i in range(count)]


# ----------------------------------------------------------------------------- rows and log-probs

@dataclass
class Rows:
    """The training rows of one update on one rank: one per step. Per-token fields are
    lists of 1-D tensors (response length each), re-padded per micro-batch."""
    prompts: list        # prompt token ids the actor saw
    responses: list      # sampled response token ids
    adv: torch.Tensor    # [rows] GRPO group advantage
    has_skill: torch.Tensor   # [rows] 1.0 where the row's episode has a skill (OPD applies)
    old: list = None     # log pi_old per token
    ref: list = None     # log pi_ref per token
    skill: list = None   # log pi_old per token under the skill-augmented context

    def __len__(self):
        return len(self.prompts)

    def take(self, idx):
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]
        return Rows([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.adv[idx],
                    self.has_skill[idx], pick(self.old), pick(self.ref), pick(self.skill))


def pad(seqs, R):
    """list of 1-D tensors -> [rows, R], zero right-padding."""
    out = torch.zeros(len(seqs), R)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s[:R]
    return out


def trim(lp, lengths):
    """[rows, R] -> list of 1-D cpu tensors, one per row, of its response length."""
    lp = lp.detach().float().cpu()
    return [lp[i, :n].clone() for i, n in enumerate(lengths)]


def by_length(idx, prompts, responses):
    """Rows sorted by (prompt, response) length: the [left-padded prompt | right-padded response] layout
    pads the two parts separately, so this key leaves the least padding in each micro-batch
    (bench/RESULTS.md: 0.094 -> 0.015 padded/real tokens on 256 ALFWorld rows)."""
    return sorted(idx, key=lambda i: (len(prompts[i]), len(responses[i])))


@torch.no_grad()
def batch_logprobs(model, rows, pad_id, cfg, device):
    """One no-grad pass over the rows (old or reference log-probs) -> list of 1-D tensors."""
    out = [None] * len(rows)
    order = by_length(range(len(rows)), rows.prompts, rows.responses)
    for idx in chunked(len(rows), cfg.micro_batch_size, cfg.fsdp):
        batch = [order[j] for j in idx] if idx else [0]   # FSDP filler forward; result dropped
        with autocast(device, resolved_dtype(cfg)):
            lp, _, _ = grpo.response_logprobs(model, [rows.prompts[i] for i in batch],
                                              [rows.responses[i] for i in batch], pad_id)   # [mb, R]
        if idx:
            for i, t in zip(batch, trim(lp, [len(rows.responses[i]) for i in batch])):
                out[i] = t
    return out


@torch.no_grad()
def rescore_rows(model, tokenizer, steps, skills, cfg, device):
    """Section 3.3: lp_skill of the rows whose episode has a skill (opd.rescore, one forward per chunk);
    the other rows get zeros, which the has-skill mask removes from the loss."""
    out = [torch.zeros(len(s.response_ids)) for s in steps]
    todo = [i for i, k in enumerate(skills) if k]
    # sorted across the whole batch (prompt + skill characters, then response): chunks of similar lengths
    todo = sorted(todo, key=lambda i: (len(steps[i].prompt_text) + len(skills[i]), len(steps[i].response_ids)))
    for idx in chunked(len(todo), cfg.micro_batch_size, cfg.fsdp):
        rows = [todo[j] for j in idx] if idx else [0]   # FSDP filler forward; result dropped
        with autocast(device, resolved_dtype(cfg)):
            lp = opd.rescore(model, tokenizer, [steps[i] for i in rows], [skills[i] for i in rows], cfg.env,
                             micro_batch=cfg.micro_batch_size)                            # [mb, R]
        if idx:
            for i, t in zip(rows, trim(lp, [len(steps[i].response_ids) for i in rows])):
                out[i] = t
    return out


def resolved_dtype(cfg):
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"


# ----------------------------------------------------------------------------- the joint objective (Section 3.3)

def micro_loss(model, mb, cfg, pad_id, n_tok, n_skill, world, device, progress=0.0):
    """The joint loss of one micro-batch as its share of the global token means. n_tok / n_skill = response
    tokens / tokens of rows with a skill, in the whole mini-batch over all ranks; progress = the share of
    the run's updates done (RLSD's anneal). -> (loss, sums for the metrics)."""
    with autocast(device, resolved_dtype(cfg)):
        lp, mask, ent = grpo.response_logprobs(model, mb.prompts, mb.responses, pad_id, grad=True,
                                               entropy=cfg.ent_coef > 0)          # [rows, R]
    R = lp.shape[1]
    padded = lambda x: None if x is None else pad(x, R).to(lp.device)
    old, ref, lps = padded(mb.old), padded(mb.ref), padded(mb.skill)               # [rows, R]
    if old is None:   # one mini-batch: pi_old is exactly the weights of this forward
        old = lp.detach()
    adv = mb.adv.to(lp.device)                                                     # [rows]
    skill_mask = mb.has_skill.to(lp.device)[:, None] * mask                        # [rows, R]
    pg = grpo.policy_loss(lp, old, adv, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip)   # [rows, R]
    w = None
    if cfg.algo == "opsd":
        pg = torch.zeros_like(pg)                       # pure self-distillation: no reward term
    elif cfg.algo == "rlsd":                            # teacher gap = per-token magnitude, A = direction
        w = 1.0 + skill_mask * (opd.rlsd_weights(lp, lps, adv, RLSD_EPS, 1.0 - progress) - 1.0)   # [rows, R]
        pg = pg * w
    kl = grpo.kl_k3(lp, ref) if ref is not None else None                          # [rows, R] k3 KL
    use_opd = cfg.algo in DISTILL
    if cfg.algo in ("opsd", "grpo_opsd", "skill_sd"):
        od = opd.opsd_loss(lp, lps)                                                # [rows, R] ungated
    else:
        od = opd.opd_loss(lp, lps, cfg.beta_opd) if use_opd else None              # [rows, R] gated OPD
    lam = 1.0 if cfg.algo == "opsd" else cfg.lambda_opd
    # DDP and FSDP average gradients over ranks: divide by the global counts / world (grpo.masked_mean).
    loss, _ = grpo.joint_loss(pg, kl, ent, od, mask, skill_mask, n_tok / world, n_skill / world,
                              cfg.kl_coef, cfg.ent_coef, lam if use_opd else 0.0)
    with torch.no_grad():
        g = opd.gates(lps, lp, cfg.beta_opd) if use_opd else torch.zeros_like(lp)  # [rows, R]
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))                          # [rows, R]
        A = adv[:, None]
        clipped = ((A > 0) & (ratio > 1 + cfg.clip_high)) | ((A < 0) & (ratio < 1 - cfg.clip_low))
        sums = {"pg": (pg * mask).sum(), "kl": (kl * mask).sum() if kl is not None else 0.0,
                "entropy": (ent * mask).sum() if ent is not None else 0.0,
                "opd": (od * skill_mask).sum() if od is not None else 0.0,
                "gate": (g * skill_mask).sum(), "gate_sq": (g * g * skill_mask).sum(),
                "rlsd_weight": (w * skill_mask).sum() if w is not None else 0.0,
                "skill_tokens": skill_mask.sum(), "clipped": (clipped * mask).sum(), "tokens": mask.sum()}
    return loss, {k: float(v) for k, v in sums.items()}


def update_policy(model, opt, rows, cfg, pad_id, world, device, order=None, progress=False, done=0.0):
    """One pass over the rows in mini-batches (ppo_epochs = 1); each mini-batch is one AdamW step on the
    token-mean joint loss over all ranks' rows. `order`: this rank's row order (shuffled by the caller);
    `done`: the share of the run's updates done (micro_loss's progress).
    Returns the summed statistics of every micro-batch (summed over ranks) and the grad norms."""
    order = list(range(len(rows))) if order is None else list(order)
    n_mb = max(1, math.ceil(all_sum(len(rows)) / cfg.mini_batch_size))
    totals, norms = {}, []
    bar = tqdm(total=n_mb, desc="update", disable=not progress, leave=False)
    for part in np.array_split(np.array(order, dtype=np.int64), n_mb):
        part = by_length(part.tolist(), rows.prompts, rows.responses)   # same gradient, less padding
        mbrows = rows.take(part)
        # global counts of this mini-batch: response tokens, and tokens of rows with a skill (the OPD mean)
        n_tok, n_skill = all_sum([sum(len(r) for r in mbrows.responses),
                                  sum(len(r) * float(h) for r, h in zip(mbrows.responses, mbrows.has_skill))])
        micros = chunked(len(mbrows), cfg.micro_batch_size, same_count=True)
        opt.zero_grad(set_to_none=True)
        for k, idx in enumerate(micros):
            with grad_sync(model, k == len(micros) - 1):
                mb = mbrows.take(idx) if idx else rows.take([0])  # filler: a row with zero weight
                loss, sums = micro_loss(model, mb, cfg, pad_id, max(n_tok, 1.0), n_skill, world, device, done)
                (loss if idx else loss * 0.0).backward()
            if idx:
                for key, v in sums.items():
                    totals[key] = totals.get(key, 0.0) + v
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        bar.update(1)
    bar.close()
    keys = sorted(totals) or ["tokens"]
    summed = dict(zip(keys, all_sum([totals.get(k, 0.0) for k in keys])))
    return summed, norms


def loss_metrics(s, norms, algo):
    """Sums over the update -> every loss term as it enters L: pg, kl, entropy over all response tokens; OPD
    over the tokens of rows with a skill (0 when there were none, as in L). The gate and RLSD weight
    statistics are over the skill tokens too (nan when there were none)."""
    n, ns = max(s.get("tokens", 0.0), 1.0), s.get("skill_tokens", 0.0)
    per_skill = lambda k: s.get(k, 0.0) / ns if ns else float("nan")
    out = {"loss/pg": s.get("pg", 0.0) / n, "loss/kl": s.get("kl", 0.0) / n, "loss/entropy": s.get("entropy", 0.0) / n,
           "clip_frac": s.get("clipped", 0.0) / n, "grad_norm": float(np.mean(norms)) if norms else 0.0,
           "tokens": s.get("tokens", 0.0)}
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


# ----------------------------------------------------------------------------- one update (Algorithm 1)

def make_rows(episodes, steps, penalty, cfg):
    """GRPO's inputs: step rows, rewards with the invalid-action penalty, group-normalized advantages."""
    ep_of = [e for e, ep in enumerate(episodes) for _ in ep.steps]
    valid = [s.valid for s in steps]
    if cfg.adv_level == "trajectory":
        r = grpo.row_rewards([episodes[e].reward for e in ep_of], [True] * len(steps), penalty)
        adv = grpo.group_advantages(r, [episodes[e].group_id for e in ep_of], norm=cfg.adv_norm, episode_ids=ep_of)
    else:
        r = grpo.row_rewards([episodes[e].reward for e in ep_of], valid, penalty)
        adv = grpo.group_advantages(r, [episodes[e].group_id for e in ep_of], norm=cfg.adv_norm)
    has = torch.tensor([1.0 if episodes[e].skill else 0.0 for e in ep_of])
    return Rows([s.prompt_ids for s in steps], [list(s.response_ids) for s in steps], adv, has), ep_of   # ImagePrompts keep their images


def analyze(engine, tok, episodes, cfg, progress, chunk=32):
    """Section 3.3: the snapshot analyzes every episode (one greedy generation, optional retries on a parse
    failure), each read whole up to --analyzer_max_prompt_tokens (capped by what the engine holds), `chunk`
    episodes per batched call. -> {"episodes", "parse_failures", "first_try_failures"} summed over the chunks."""
    stats = {"episodes": 0, "parse_failures": 0, "first_try_failures": 0}
    for i in tqdm(range(0, len(episodes), chunk), desc="analyze", disable=not progress, leave=False):
        st = analyzer.analyze(engine, tok, episodes[i:i + chunk], max_tokens=cfg.analyzer_max_tokens,
                              retries=cfg.analyzer_retries, max_prompt_tokens=cfg.analyzer_max_prompt_tokens)
        stats = {k: stats[k] + st[k] for k in stats}
    return stats


def analysis_budget(model_path, max_prompt_tokens, max_tokens, retries=0):
    """-> (the analyzer's prompt budget, the context one analysis needs: that budget + analyzer.answer_room).
    The model's own context (config.max_position_embeddings; 8192 for the embedded SmolLM2-135M) caps it:
    vLLM refuses a longer max_model_len, so the prompt budget shrinks to fit, with a notice."""
    from transformers import AutoConfig
    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    room = analyzer.answer_room(max_tokens, retries)
    if limit and max_prompt_tokens + room > limit:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"[analyzer] the model's context is {limit} tokens: the analyzer's prompt budget is "
                  f"{limit - room} (asked {max_prompt_tokens}, plus {room} for its answers)", flush=True)
        max_prompt_tokens = limit - room
    if max_prompt_tokens < 256:
        fail(f"the analyzer's answers ({room} tokens) leave {max_prompt_tokens} of the model's context for the "
             f"episode; lower --analyzer_max_tokens or --analyzer_retries")
    return max_prompt_tokens, max_prompt_tokens + room


def engine_context(cfg, model_path):
    """The rollout engine's max_model_len: the longest actor turn and, for the algorithms that analyze live,
    the longest analysis (its own prompt budget + answers; the larger of the two)."""
    context = cfg.max_prompt_tokens + cfg.max_tokens
    if cfg.algo in LIVE_ANALYZER:
        context = max(context, analysis_budget(model_path, cfg.analyzer_max_prompt_tokens, cfg.analyzer_max_tokens,
                                               cfg.analyzer_retries)[1])
    return context


def library_skills(library, env, env_name, task_ids):
    """One library skill per task (reset an env once to read the task text and family)."""
    out = []
    for t in task_ids:
        env.reset(seed=int(t))
        out.append(library.retrieve(env_name, env.family, env.task))
    return out


def rl_update(u, S):
    """Algorithm 1, one iteration. S: the run state (see main). -> metrics dict."""
    cfg, rank, world = S["cfg"], S["rank"], S["world"]
    main_rank = rank == 0
    sec = {}
    t = time.time()
    ids = S["train_ids"]                    # every training task, or the --train_fraction subset
    tasks = S["data_rng"].choice(ids, size=cfg.tasks_per_update, replace=len(ids) < cfg.tasks_per_update).tolist()
    mine = tasks[rank::world]
    ctx_skills = (library_skills(S["library"], S["train_envs"][0], cfg.env, mine)
                  if cfg.algo in IN_CONTEXT else None)
    # 1. collect with the snapshot pi_old
    episodes = rollout.collect(S["engine"], S["tok"], S["train_envs"], mine, cfg.group_size,
                               temperature=cfg.temperature, max_tokens=cfg.max_tokens, skills=ctx_skills,
                               progress=main_rank)
    sec["collect"] = time.time() - t
    # 2. analyze with the same snapshot (greedy) -> episode.skill
    t = time.time()
    stats = {}
    if cfg.algo in LIVE_ANALYZER:
        stats = analyze(S["engine"], S["tok"], episodes, cfg, main_rank)
    elif cfg.algo in ("static_skills", "skill_sd"):   # a library skill for the teacher's context only
        for ep in episodes:
            ep.skill = S["library"].retrieve(cfg.env, ep.family, ep.task)
    sec["analyze"] = time.time() - t
    S["episode_records"] = [r for part in gather([episode_record(ep) for ep in episodes]) for r in part]
    S["engine"].sleep()
    # 3. rows, rewards, advantages
    t = time.time()
    steps = [s for ep in episodes for s in ep.steps]
    rows, ep_of = make_rows(episodes, steps, S["train_envs"][0].invalid_penalty, cfg)
    model, pad_id = S["model"], S["tok"].pad_token_id
    # 4. reference and old log-probs: one no-grad pass each
    if all_sum(len(rows)) > cfg.mini_batch_size:   # later mini-batches need log pi_old; one mini-batch does not
        rows.old = batch_logprobs(S["fwd"], rows, pad_id, cfg, S["device"])
    if cfg.kl_coef > 0:
        rows.ref = batch_logprobs(S["ref"], rows, pad_id, cfg, S["device"])
    sec["logprobs"] = time.time() - t
    # 5. re-score under the skill-augmented context (only rows with a skill are distilled)
    t = time.time()
    if cfg.algo in RESCORE:
        rows.skill = rescore_rows(S["fwd"], S["tok"], steps, [episodes[e].skill for e in ep_of], cfg, S["device"])
    sec["rescore"] = time.time() - t
    # 6. mini-batch updates of the joint objective, one pass, rows shuffled
    t = time.time()
    order = np.random.default_rng([cfg.seed, u, rank]).permutation(len(rows))
    sums, norms = update_policy(model, S["opt"], rows, cfg, pad_id, world, S["device"], order, main_rank,
                                u / max(cfg.updates, 1))
    sec["update"] = time.time() - t
    # 7. the new weights become the next snapshot pi_old (actor and analyzer)
    t = time.time()
    push(S["engine"], model, S["opt"])
    sec["push"] = time.time() - t
    return episode_metrics(episodes, stats) | loss_metrics(sums, norms, cfg.algo) | {f"sec/{k}": v for k, v in sec.items()}


def push(engine, model, opt=None):
    """Weight push into this rank's engine, one tensor at a time (rollout.stream_weights: under FSDP2
    every rank gathers each tensor in turn, never a full state dict). The gradients are freed first:
    a sleeping engine wakes into that memory."""
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.push_weights(unwrap(model))


def episode_metrics(episodes, stats):
    """Rollout statistics over all ranks: success, reward, length, invalid rate, skills, parse failures."""
    local = [(float(ep.won), ep.reward, ep.length, sum(not s.valid for s in ep.steps), bool(ep.skill))
             for ep in episodes]
    allep = [x for part in gather(local) for x in part]
    n, steps = len(allep), max(sum(x[2] for x in allep), 1)
    fails, first, tries = all_sum([stats.get(k, 0) for k in ("parse_failures", "first_try_failures", "episodes")])
    return {"success": sum(x[0] for x in allep) / n, "reward": sum(x[1] for x in allep) / n,
            "length": sum(x[2] for x in allep) / n, "invalid_rate": sum(x[3] for x in allep) / steps,
            "skill_rate": sum(x[4] for x in allep) / n, "episodes": n, "rows": steps,
            "parse_failure_rate": fails / tries if tries else float("nan"),      # after the retries
            "first_try_failure_rate": first / tries if tries else float("nan")}  # before them


# ----------------------------------------------------------------------------- evaluation

def env_kwargs(cfg, split):
    kw = dict(split=split, history_length=cfg.history_length, max_steps=cfg.max_steps)
    if cfg.image:
        kw["image"] = True
    if cfg.env == "alfworld":
        kw["data_dir"] = cfg.data_dir or None
    elif cfg.env == "search":
        kw.update(data=cfg.data_dir or None, retriever_url=cfg.retriever_url)
    return kw


def eval_task_ids(cfg, split, rank, world):
    n = envs.make(cfg.env, **env_kwargs(cfg, split)).num_tasks
    ids = list(range(min(cfg.eval_tasks, n) if cfg.eval_tasks else n))
    return ids[rank::world]


def run_eval(S, with_skill=False):
    """Held-out tasks at temperature 0.4, no skill (skill_prompt, skill_grpo_star: the library skill in the
    prompt, as the paper's Skill-Prompt and Skill-GRPO* rows); with --eval_greedy also at temperature 0.
    -> {"eval/<split>/success", ".../success_<family>", ".../success_macro", ".../length", ".../invalid_rate"}
    (and the same under "eval_greedy/")."""
    cfg, out = S["cfg"], {}
    runs = [("eval", cfg.eval_temperature)] + ([("eval_greedy", 0.0)] if cfg.eval_greedy else [])
    for split in EVAL_SPLITS[cfg.env]:
        for prefix, temperature in runs:
            res = [x for part in gather(eval_episodes(S, split, temperature, with_skill)) for x in part]
            fams = sorted({f for f, _, _, _ in res})
            per = {f: float(np.mean([w for g, w, _, _ in res if g == f])) for f in fams}
            mean = lambda xs: float(np.mean(xs)) if res else float("nan")
            key = f"{prefix}/{split}"
            out[f"{key}/success"] = mean([w for _, w, _, _ in res])
            out[f"{key}/success_macro"] = float(np.mean(list(per.values()))) if per else float("nan")
            out[f"{key}/length"] = mean([n for _, _, n, _ in res])
            out[f"{key}/invalid_rate"] = sum(b for *_, b in res) / max(sum(n for _, _, n, _ in res), 1)
            out.update({f"{key}/success_{f}": v for f, v in per.items()})
    return out


def eval_episodes(S, split, temperature, with_skill):
    """One episode of each of this rank's held-out tasks of `split`. -> [(family, won, length, invalid steps)]."""
    cfg, ids, local = S["cfg"], S["eval_ids"][split], []
    n = min(len(ids), len(S["train_envs"]))        # as many envs at once as in training
    if split not in S["eval_envs"]:   # made once, reused by every evaluation
        S["eval_envs"][split] = [envs.make(cfg.env, **env_kwargs(cfg, split)) for _ in range(n)]
    es = S["eval_envs"][split]
    for i in range(0, len(ids), max(n, 1)):
        chunk = ids[i:i + n]
        skills = library_skills(S["library"], es[0], cfg.env, chunk) if with_skill else None
        eps = rollout.collect(S["engine"], S["tok"], es[:len(chunk)], chunk, 1, temperature=temperature,
                              max_tokens=cfg.max_tokens, skills=skills, progress=S["rank"] == 0)
        local += [(ep.family, float(ep.won), ep.length, sum(not s.valid for s in ep.steps)) for ep in eps]
    return local


# ----------------------------------------------------------------------------- run folder

def episode_record(ep):
    return {"task_id": ep.task_id, "group_id": ep.group_id, "env": ep.env, "task": ep.task, "family": ep.family,
            "won": ep.won, "reward": ep.reward, "length": ep.length, "summary": ep.summary, "skill": ep.skill,
            "first_prompt": ep.steps[0].prompt_text if ep.steps else "",   # what the actor saw at step 1
            "steps": [{"observation": s.observation, "response": s.response_text, "action": s.action,
                       "valid": s.valid} for s in ep.steps]}


def write_metrics(run_dir, metrics):
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}  # strict JSON
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(clean) + "\n")


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(run_dir, lines):
    """curves.png: success (train and eval), episode length, invalid-action rate (train and eval), OPD loss,
    gate mean +- std, KL to the reference."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    if not lines:
        return
    u = [m["update"] for m in lines]
    col = lambda k: [float("nan") if m.get(k) is None else m[k] for m in lines]
    fig, ax = plt.subplots(2, 3, figsize=(14, 7))
    ax[0, 0].plot(u, col("success"), "o-", label="train rollouts")
    for k in sorted({k for m in lines for k in m if k.startswith("eval") and k.endswith("/success")}):
        pts = [(m["update"], m[k]) for m in lines if m.get(k) is not None]
        ax[0, 0].plot(*zip(*pts), "s--", label=k[5:-8])
    ax[0, 0].set(title="success rate", xlabel="update", ylim=(-0.05, 1.05))
    ax[0, 0].legend(fontsize=8)
    ax[0, 1].plot(u, col("length"), "o-")
    ax[0, 1].set(title="episode length (steps)", xlabel="update")
    ax[0, 2].plot(u, col("invalid_rate"), "o-", label="train rollouts")
    for k in sorted({k for m in lines for k in m if k.startswith("eval") and k.endswith("/invalid_rate")}):
        pts = [(m["update"], m[k]) for m in lines if m.get(k) is not None]
        ax[0, 2].plot(*zip(*pts), "s--", label=k[:-len("/invalid_rate")])
    ax[0, 2].set(title="invalid-action rate (per step)", xlabel="update", ylim=(-0.05, 1.05))
    ax[0, 2].legend(fontsize=8)
    ax[1, 0].plot(u, col("loss/opd"), "o-")
    ax[1, 0].set(title="OPD loss (mean over skill tokens)", xlabel="update")
    gm, gs = np.array(col("gate/mean")), np.array(col("gate/std"))
    ax[1, 1].plot(u, gm, "o-", label="mean")
    ax[1, 1].fill_between(u, gm - gs, gm + gs, alpha=0.3, label="+- std")
    ax[1, 1].set(title="OPD gate g", xlabel="update", ylim=(-0.05, 1.05))
    ax[1, 1].legend(fontsize=8)
    ax[1, 2].plot(u, col("loss/kl"), "o-")
    ax[1, 2].set(title="KL to the reference (k3, token mean)", xlabel="update")
    for a in ax.flat:
        a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=90)
    plt.close(fig)


def rng_state():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s):
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(S, next_update):
    """checkpoint/: HF weights (safetensors) + tokenizer + trainer_state.pt (optimizer, every rank's RNG
    states, data-order RNG, next update index). Written to a temporary folder, then swapped in."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = unwrap(S["model"])
    sd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, S["opt"], options=full)
    rngs = gather(rng_state() | {"engine": getattr(S["engine"], "rng", None)})   # HF engine: its sampling RNG
    if S["rank"] == 0:
        final = os.path.join(S["run_dir"], "checkpoint")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        S["tok"].save_pretrained(tmp)
        torch.save({"update": next_update, "optimizer": osd, "rng": rngs, "world": S["world"],
                    "data_rng": S["data_rng"].bit_generator.state}, os.path.join(tmp, "trainer_state.pt"))
        if os.path.exists(final):
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_trainer_state(S, state):
    """Optimizer, RNG streams and data order from trainer_state.pt (model weights are loaded before wrapping)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(unwrap(S["model"]), S["opt"], state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    if state["world"] == S["world"]:
        set_rng_state(state["rng"][S["rank"]])
        if state["rng"][S["rank"]].get("engine") is not None and hasattr(S["engine"], "rng"):
            S["engine"].rng = state["rng"][S["rank"]]["engine"]
    elif S["rank"] == 0:
        print(f"[seed] note: resumed on {S['world']} ranks (saved on {state['world']}); "
              f"RNG streams restart from the seed", flush=True)
    S["data_rng"].bit_generator.state = state["data_rng"]


# ----------------------------------------------------------------------------- main

def main(argv=None):
    cfg = parse_config(argv)
    cfg.out = cfg.out or os.path.join("runs", f"{cfg.algo}-{cfg.env}")
    validate(cfg)
    if cfg.algo in NO_TRAINING:
        cfg.updates = 0                      # evaluation of the starting model only: no update to run
    rank, world, device = setup_dist(cfg.seed)
    if cfg.tasks_per_update % world:
        fail(f"--tasks_per_update {cfg.tasks_per_update} must be a multiple of the {world} ranks")
    run_dir = cfg.out
    ckpt = os.path.join(run_dir, "checkpoint")
    resuming = cfg.resume and os.path.exists(os.path.join(ckpt, "trainer_state.pt"))
    if read_metrics(run_dir) and not cfg.resume:
        fail(f"{run_dir} already holds a run; pass --resume to continue it or a new --out")
    if rank == 0:
        if cfg.resume and not resuming:
            print(f"[seed] --resume: no checkpoint in {run_dir}; starting at update 0", flush=True)
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):   # lines of a run killed before its
                os.remove(os.path.join(run_dir, "metrics.jsonl"))        # first checkpoint: all redone
        os.makedirs(os.path.join(run_dir, "episodes"), exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg) | {"world_size": world}, f, indent=2)

    # models: policy (the checkpoint when resuming), reference = the --init checkpoint (or the base model)
    init = cfg.init or cfg.model
    model, tok, init_path = rollout.load_model(ckpt if resuming else init)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    S = dict(cfg=cfg, rank=rank, world=world, device=device, run_dir=run_dir, tok=tok, eval_envs={})
    train = cfg.algo not in NO_TRAINING
    if train and (cfg.kl_coef > 0):
        ref, _, _ = rollout.load_model(init, dtype=resolved_dtype(cfg))   # frozen: bf16 on GPU
        ref.requires_grad_(False).eval()
        S["ref"] = wrap(ref, cfg, device, world, trainable=False)
    S["model"] = wrap(model, cfg, device, world)
    S["fwd"] = unwrap(S["model"]) if not cfg.fsdp else S["model"]   # no-grad passes skip DDP's hooks
    if "ref" not in S:
        S["ref"] = S["fwd"]                                          # kl_coef = 0: the KL term is unused
    S["opt"] = torch.optim.AdamW(S["model"].parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    S["data_rng"] = np.random.default_rng(cfg.seed)
    S["library"] = analyzer.SkillLibrary.load(library_path(cfg)) if cfg.algo in LIBRARY else None

    # one engine per rank (its own sampling seed), loaded with the policy's current weights
    model_path = ckpt if resuming else init_path
    S["engine"] = rollout.make_engine(cfg.engine, model_path, dtype=resolved_dtype(cfg), seed=cfg.seed,
                                      max_model_len=engine_context(cfg, model_path),
                                      gpu_memory_utilization=cfg.gpu_memory_utilization)

    start = 0
    if resuming:
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
        load_trainer_state(S, state)
        start = state["update"]
        if rank == 0:   # lines written after the checkpoint are recomputed: none lost, none doubled
            kept = [m for m in read_metrics(run_dir) if m["update"] < start]
            with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in kept)
            print(f"[seed] resumed {run_dir} at update {start}", flush=True)

    n_local = cfg.tasks_per_update // world * cfg.group_size
    S["train_envs"] = [envs.make(cfg.env, **env_kwargs(cfg, "train")) for _ in range(n_local)]
    S["num_tasks"] = S["train_envs"][0].num_tasks
    S["train_ids"] = train_subset(S["num_tasks"], cfg.train_fraction, cfg.seed)
    if rank == 0 and cfg.train_fraction < 1:
        print(f"[seed] --train_fraction {cfg.train_fraction}: {len(S['train_ids'])} of {S['num_tasks']} "
              f"training tasks", flush=True)
    S["eval_ids"] = {s: eval_task_ids(cfg, s, rank, world) for s in EVAL_SPLITS[cfg.env]}

    with_skill = cfg.algo in ("skill_prompt", "skill_grpo_star")    # evaluated with the library skill
    if not train:   # vanilla, skill_prompt: the starting model evaluated, no update
        metrics = {"update": 0} | run_eval(S, with_skill)
        if rank == 0:
            write_metrics(run_dir, metrics)
            print(json.dumps(metrics), flush=True)
        return finish(S)

    if cfg.eval_first and start == 0:   # the starting policy, on the same held-out tasks
        t = time.time()
        metrics = {"update": -1} | run_eval(S, with_skill) | {"sec/eval": time.time() - t}
        if rank == 0:
            write_metrics(run_dir, metrics)
    for u in range(start, cfg.updates):
        t0 = time.time()
        metrics = {"update": u} | rl_update(u, S)
        last = u == cfg.updates - 1
        if cfg.eval_every and ((u + 1) % cfg.eval_every == 0 or last):
            t = time.time()
            metrics |= run_eval(S, with_skill)
            metrics["sec/eval"] = time.time() - t
        metrics["sec/total"] = time.time() - t0
        if rank == 0:
            write_episodes(run_dir, u, S)
            write_metrics(run_dir, metrics)
            plot_curves(run_dir, read_metrics(run_dir))
            print(summary_line(metrics), flush=True)
        if (u + 1) % cfg.save_every == 0 or last:
            save_checkpoint(S, u + 1)
    return finish(S)


def write_episodes(run_dir, u, S):
    """episodes/update_XXXX.jsonl: every rank's episodes of this update, with summaries and skills."""
    with open(os.path.join(run_dir, "episodes", f"update_{u:04d}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in S["episode_records"])


def summary_line(m):
    keys = ["success", "length", "reward", "loss/pg", "loss/kl", "loss/opd", "gate/mean", "parse_failure_rate",
            "sec/total"] + [k for k in m if k.startswith("eval/") and (k.endswith("/success") or k.endswith("_macro"))]
    return f"[update {m['update']}] " + " ".join(f"{k}={m[k]:.3g}" for k in keys if k in m)


def finish(S):
    if dist.is_initialized():
        dist.barrier()
    S["engine"].close()   # first: vLLM's shutdown tears down its groups on top of the trainer's
    teardown_dist()
    if S["rank"] == 0:
        print(f"[seed] done: {os.path.join(S['run_dir'], 'metrics.jsonl')}, "
              f"{os.path.join(S['run_dir'], 'curves.png')}, {os.path.join(S['run_dir'], 'checkpoint')}", flush=True)


if __name__ == "__main__":
    main()
