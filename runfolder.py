"""A run's start and its folder (README: the run folder), shared by seed.py and sft.py: flags -> config, start-up
errors, and everything a run writes and reads back in `runs/<name>/`:

    config.json                    the flags (+ world_size)
    metrics.jsonl                  one line per update (write_metrics, read_metrics)
    episodes/update_XXXX.jsonl     every episode of an update, with its summary and skill (episode_record)
    curves.png                     success, length, invalid rate, OPD loss, gate, KL, teacher diagnostics (plot_curves)
    tokens.json, tokens.html       a few rows of the last update, each response token with its OPD gate (write_token_page)
    checkpoint/                    HF weights + tokenizer + trainer_state.pt (save_checkpoint; --resume: resume)
"""
import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

import envs
import vision
from parallel import gather, rank_world, teardown_dist, unwrap

CHECKPOINT = "checkpoint"   # the run's last checkpoint, inside the run folder


# ----------------------------------------------------------------------------- flags

def parse_config(argv, cls, env_defaults=None, doc=""):
    """Every field of the dataclass `cls` is a flag (its comment is the help). Precedence: flag > the --env column
    of `env_defaults` ({env: {field: value}}) > the dataclass default. argv None = the command line."""
    import inspect
    import re
    comments = {}   # a subclass's fields after its bases' (bench/teacher_gap.py extends seed.Config)
    for c in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        comments |= dict(re.findall(r"^\s+(\w+): .*?# (.*)$", inspect.getsource(c), flags=re.M))
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
    return cls(**{**(env_defaults or {}).get(env, {}), **given})


def fail(msg):
    """Stop at start-up, naming the problem (exit status 2, as argparse)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_common(cfg, positive):
    """The start-up checks both stages share: the env, the engine, the dtype, --image (sokoban and ezpoints only),
    the data folder (ALFWorld: its games found), and the count fields named in `positive` (each at least 1)."""
    if cfg.env not in envs.NAMES:
        fail(f"unknown --env {cfg.env!r}; choose one of {', '.join(envs.NAMES)}")
    if cfg.engine not in ("vllm", "hf"):
        fail(f"unknown --engine {cfg.engine!r}; choose vllm or hf")
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        fail(f"unknown --dtype {cfg.dtype!r}; choose auto, float32, bfloat16 or float16")
    if cfg.image and cfg.env not in ("sokoban", "ezpoints"):
        fail(f"--image is for sokoban and ezpoints (Appendix C.3), not {cfg.env}")
    if cfg.data_dir and not os.path.exists(cfg.data_dir):
        fail(f"--data_dir {cfg.data_dir} does not exist")
    if cfg.env == "alfworld" and not cfg.data_dir:
        from envs.alfworld import HOW_TO_GET_GAMES, find_data_dir
        try:
            find_data_dir(None)
        except Exception:
            fail(f"no ALFWorld games found (data/alfworld or $ALFWORLD_DATA); {HOW_TO_GET_GAMES}")
    for name in positive:
        if getattr(cfg, name) < 1:
            fail(f"--{name} must be positive, got {getattr(cfg, name)}")
    check_flags(cfg)


# Every numeric flag's range, one row per field name: (test on the value, what the message says it must be). A row
# applies to whichever config has that field (seed.Config, sft.SFTConfig, bench/teacher_gap.py's subclass); floats
# must also be finite. check_flags runs them all, then checks that --out can be written, before any model loads.
_count = (lambda v: v >= 1, "positive")
_zero_or_more = (lambda v: v >= 0, "0 or more")
_share = (lambda v: 0 < v <= 1, "in (0, 1]")
_fraction = (lambda v: 0 <= v < 1, "in [0, 1)")
FLAG_CHECKS = {
    # run and tasks
    "seed": _zero_or_more,                       # numpy's generators take no negative seed
    "updates": _zero_or_more,
    "train_fraction": _share,
    "tasks_per_update": _count,
    "group_size": (lambda v: v >= 2, "at least 2 (a GRPO group compares episodes of one task)"),
    "tasks": _count, "k0": _count, "collect_batch": _count, "annotate_batch": _count,
    "max_steps": _count,
    "history_length": _zero_or_more,
    "max_prompt_tokens": _count, "max_tokens": _count,
    "temperature": _zero_or_more,
    "eval_temperature": _zero_or_more,
    "gpu_memory_utilization": _share,
    # analyzer
    "analyzer_max_prompt_tokens": _count, "analyzer_max_tokens": _count,
    "analyzer_retries": _zero_or_more, "max_step_skills": _zero_or_more,
    # optimizer and objective
    "lr": (lambda v: v > 0, "positive"),
    "weight_decay": _zero_or_more,
    "grad_clip": (lambda v: v > 0, "positive"),
    "mini_batch_size": _count, "micro_batch_size": _count, "batch_size": _count, "epochs": _count,
    "clip_low": _fraction,
    "clip_high": _zero_or_more,
    "dual_clip": (lambda v: v > 1, "greater than 1 (a bound above the clipped ratio's 1 + clip)"),
    "kl_coef": _zero_or_more, "ent_coef": _zero_or_more, "lambda_opd": _zero_or_more, "beta_opd": _zero_or_more,
    "val_fraction": _fraction, "warmup_ratio": _fraction, "lr_warmup": _fraction, "tis_cap": _zero_or_more,
    "replay": _zero_or_more, "skill_tasks": _zero_or_more,
    # evaluation and checkpoints
    "eval_every": (lambda v: v >= 0, "0 (never) or more"),
    "eval_tasks": (lambda v: v >= 0, "0 (the whole split) or more"),
    "save_every": (lambda v: v >= 1, "positive (a checkpoint every this many updates)"),
    "webshop_train_from": (lambda v: v >= 500, "500 or more (goals [0, 500) are the test split)"),
}
TRACKERS = ("", "tensorboard", "wandb")


def check_flags(cfg):
    """Stop at start-up (fail: exit 2, the flag named) on the first flag of FLAG_CHECKS out of its range, an unknown
    --track, or an --out that cannot be written."""
    for name, (ok, what) in FLAG_CHECKS.items():
        if not hasattr(cfg, name):
            continue
        v = getattr(cfg, name)
        if (isinstance(v, float) and not math.isfinite(v)) or not ok(v):
            fail(f"--{name} must be {what}, got {v}")
    if getattr(cfg, "track", "") not in TRACKERS:
        fail(f"unknown --track {cfg.track!r}; choose tensorboard or wandb (or leave it out)")
    if getattr(cfg, "out", ""):
        check_writable(cfg.out)


def check_writable(out):
    """--out must be a folder this process can create and write (or one that exists and is writable)."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"--out {out} is a file, not a folder")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"--out {out}: {parent} is a file, not a folder")
    try:   # a probe file, not os.access: root passes os.access on read-only or virtual file systems
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        fail(f"--out {out} cannot be written: {parent}: {e.strerror or e}")


# ----------------------------------------------------------------------------- the folder

# The fields a resumed run may change (README: the run folder): how long it runs and how often it evaluates, saves
# and reports, and resource knobs that do not change the update (micro-batches split the global token means exactly).
# Every other field must equal the folder's config.json, or --resume stops before any model loads.
RESUME_MAY_CHANGE = ("updates", "eval_every", "eval_tasks", "eval_greedy", "eval_first", "save_every", "resume",
                     "track", "out", "micro_batch_size", "gradient_checkpointing", "gpu_memory_utilization",
                     "retriever_url")


def checkpoint_to_resume(run_dir):
    """The complete checkpoint of run_dir: checkpoint/, or checkpoint.old/ when a kill fell between
    save_checkpoint's two renames (then checkpoint/ is missing). -> its path, or None."""
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        if os.path.exists(os.path.join(run_dir, name, "trainer_state.pt")):
            return os.path.join(run_dir, name)
    return None


def config_changes(saved, cfg):
    """The fields of cfg that differ from the saved config.json (a dict), less RESUME_MAY_CHANGE; a field the
    saved file lacks (added to the code since) is not compared. -> [(name, saved value, new value)]."""
    now = dataclasses.asdict(cfg)
    return [(k, saved[k], v) for k, v in now.items()
            if k not in RESUME_MAY_CHANGE and k in saved and saved[k] != v]


def open_folder(cfg, rank, world):
    """Check and prepare the run folder cfg.out and write config.json. -> whether to resume.
    A folder holding a run (metric lines or a checkpoint) is never overwritten: without --resume the run stops;
    with it, every field outside RESUME_MAY_CHANGE must equal the saved config.json (else a stop naming each one),
    and the run continues from checkpoint/ (or checkpoint.old/, restored, after a kill between the two renames of
    save_checkpoint). --resume without a checkpoint starts over at update 0. Rank 0 opens the --track tracker."""
    run_dir = cfg.out
    ckpt = checkpoint_to_resume(run_dir)
    holds_run = bool(read_metrics(run_dir)) or ckpt is not None
    if holds_run and not cfg.resume:
        fail(f"{run_dir} already holds a run; pass --resume to continue it or a new --out")
    saved_path = os.path.join(run_dir, "config.json")
    if cfg.resume and holds_run and os.path.exists(saved_path):
        with open(saved_path) as f:
            changes = config_changes(json.load(f), cfg)
        if changes:
            fail(f"--resume: {run_dir} holds a run with other settings: "
                 + "; ".join(f"--{k} {a!r} there, {b!r} now" for k, a, b in changes)
                 + f". A resumed run may change only {', '.join('--' + k for k in RESUME_MAY_CHANGE)}; "
                 f"pass the folder's values or a new --out")
    resuming = cfg.resume and ckpt is not None
    if rank == 0:
        if resuming and ckpt != os.path.join(run_dir, CHECKPOINT):   # killed mid-swap: the old one is whole
            print(f"[seed] --resume: {CHECKPOINT}/ is missing, continuing from {os.path.basename(ckpt)}/", flush=True)
            os.replace(ckpt, os.path.join(run_dir, CHECKPOINT))
        if cfg.resume and not resuming:
            print(f"[seed] --resume: no checkpoint in {run_dir}; starting at update 0", flush=True)
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):   # lines of a run killed before its
                os.remove(os.path.join(run_dir, "metrics.jsonl"))        # first checkpoint: all redone
        os.makedirs(os.path.join(run_dir, "episodes"), exist_ok=True)
        config = dataclasses.asdict(cfg) | {"world_size": world}
        with open(saved_path, "w") as f:
            json.dump(config, f, indent=2)
        if getattr(cfg, "track", ""):
            open_tracker(run_dir, cfg.track, config)
    if dist.is_initialized():
        dist.barrier()   # the other ranks load checkpoint/ only after rank 0 restored it
    return resuming


# ----------------------------------------------------------------------------- tracking (--track)

_TRACKERS = {}   # run folder -> its open tracker (rank 0 only): write_metrics logs every line to it


class _TensorBoard:
    """Event files in <run>/tensorboard/: the config as text, every numeric metric as a scalar at step = update."""

    def __init__(self, run_dir, config):
        from torch.utils.tensorboard import SummaryWriter   # needs the tensorboard package; imported only here
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        self.writer.flush()

    def log(self, metrics, step):
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class _WandB:
    """A wandb run (project $WANDB_PROJECT or "seed", named after the folder, files in <run>/wandb/; offline with
    WANDB_MODE=offline): the config, every numeric metric against the "update" axis. A resumed run continues the
    same wandb run (its id is kept in <run>/wandb_id)."""

    def __init__(self, run_dir, config):
        import wandb   # imported only with --track wandb
        id_file = os.path.join(run_dir, "wandb_id")
        run_id = open(id_file).read().strip() if os.path.exists(id_file) else os.urandom(6).hex()
        with open(id_file, "w") as f:
            f.write(run_id)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "seed"), dir=run_dir, id=run_id,
                              resume="allow", name=os.path.basename(os.path.normpath(run_dir)), config=config)
        self.run.define_metric("update")
        self.run.define_metric("*", step_metric="update")

    def log(self, metrics, step):
        self.run.log(metrics | {"update": step})

    def close(self):
        self.run.finish()


def open_tracker(run_dir, kind, config):
    """Start logging run_dir's metric lines to `kind` (tensorboard | wandb) with the run's config; closed at exit."""
    import atexit
    close_tracker(run_dir)
    tracker = {"tensorboard": _TensorBoard, "wandb": _WandB}[kind](run_dir, config)
    _TRACKERS[run_dir] = tracker
    atexit.register(close_tracker, run_dir)
    return tracker


def close_tracker(run_dir):
    tracker = _TRACKERS.pop(run_dir, None)
    if tracker is not None:
        tracker.close()


def write_episodes(run_dir, u, records):
    """episodes/update_XXXX.jsonl: every rank's episodes of update u (episode_record each)."""
    with open(os.path.join(run_dir, "episodes", f"update_{u:04d}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def episode_record(ep):
    return {"task_id": ep.task_id, "group_id": ep.group_id, "env": ep.env, "task": ep.task, "family": ep.family,
            "won": ep.won, "reward": ep.reward, "score": ep.score, "length": ep.length, "summary": ep.summary, "skill": ep.skill,
            "step_skills": {str(t): k for t, k in sorted(ep.step_skills.items())},
            "first_prompt": ep.steps[0].prompt_text if ep.steps else "",   # what the actor saw at step 1
            "steps": [{"observation": s.observation, "response": s.response_text, "action": s.action,
                       "valid": s.valid} for s in ep.steps]}


def write_metrics(run_dir, metrics):
    """One line of metrics.jsonl; the same numbers go to the run's open tracker (--track), at step = update."""
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}  # strict JSON
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(clean) + "\n")
    tracker = _TRACKERS.get(run_dir)
    if tracker is not None:
        tracker.log({k: float(v) for k, v in clean.items() if k != "update" and isinstance(v, (int, float))
                     and not isinstance(v, bool)}, int(metrics.get("update", 0)))


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(run_dir, lines):
    """curves.png: success (train and eval), episode length, invalid-action rate (train and eval), OPD loss,
    gate mean +- std, KL to the reference, the teacher's shift on action tokens (delta percentiles, gate std)
    and the share of tied groups with the gate-advantage covariance (diagnostics.teacher_diagnostics)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    if not lines:
        return
    u = [m["update"] for m in lines]
    col = lambda k: [float("nan") if m.get(k) is None else m[k] for m in lines]
    fig, ax = plt.subplots(2, 4, figsize=(18, 7))
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
    ax[1, 2].plot(u, col("loss/kl"), "o-", label="KL to the reference (k3, token mean)")
    ax[1, 2].plot(u, col("diag/engine_lp_diff_mean"), "s--", label="|engine - trainer| log-prob, mean")
    ax[1, 2].set(title="KL; engine-trainer gap", xlabel="update")
    ax[1, 2].legend(fontsize=8)
    for k, style in (("diag/delta_action_p5", "v:"), ("diag/delta_action_p50", "o-"), ("diag/delta_action_p95", "^:")):
        ax[0, 3].plot(u, col(k), style, label=k.split("_")[-1])
    ax[0, 3].plot(u, col("diag/gate_std_action"), "s--", label="gate std")
    ax[0, 3].plot(u, col("diag/gate_std_response"), "d--", label="gate std, all response tokens")
    ax[0, 3].set(title="teacher shift on action tokens (lp_skill - lp)", xlabel="update")
    ax[0, 3].legend(fontsize=8)
    ax[1, 3].plot(u, col("diag/tied_groups"), "o-", label="tied groups (share)")
    ax[1, 3].plot(u, col("diag/gate_adv_cov"), "s--", label="cov(row gate, advantage)")
    ax[1, 3].set(title="GRPO's zero-gradient groups;\ndoes the teacher favour winners?", xlabel="update")
    ax[1, 3].legend(fontsize=8)
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


@contextlib.contextmanager
def timed(sec, name):
    """sec["sec/<name>"] = the seconds the block took (the sec/* keys of metrics.jsonl)."""
    t = time.time()
    yield
    sec[f"sec/{name}"] = time.time() - t


def summary_line(m):
    """The console line of an update: its main metrics."""
    keys = ["success", "length", "reward", "loss/pg", "loss/kl", "loss/opd", "gate/mean", "parse_failure_rate",
            "sec/total"] + [k for k in m if k.startswith("eval/") and (k.endswith("/success") or k.endswith("_macro"))]
    return f"[update {m['update']}] " + " ".join(f"{k}={m[k]:.3g}" for k in keys if k in m)


# ----------------------------------------------------------------------------- checkpoints and resume

def save_model(model, tok, out, rank):
    """HF checkpoint (safetensors) + tokenizer in `out`: every rank gathers the full weights, rank 0 writes.
    -> whether this rank wrote."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return False
    unwrap(model).save_pretrained(out, state_dict=sd, safe_serialization=True)
    tok.save_pretrained(out)
    vision.save_image_processor(tok, out)   # a vision-language model's checkpoint keeps its image processor
    return True


def save_checkpoint(run_dir, next_update, model, opt, tok, data_rng, engine=None):
    """checkpoint/: HF weights (safetensors) + tokenizer + trainer_state.pt (optimizer, every rank's RNG
    states, data-order RNG, next update index). Written to a temporary folder, then swapped in."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    rank, world = rank_world()
    final = os.path.join(run_dir, CHECKPOINT)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    wrote = save_model(model, tok, tmp, rank)
    osd = get_optimizer_state_dict(unwrap(model), opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # the HF engine's sampling state (HFEngine.rng); the vLLM engine keeps none (None): it restarts from its seed
    rngs = gather(rng_state() | {"engine": getattr(engine, "rng", None)})
    if wrote:
        torch.save({"update": next_update, "optimizer": osd, "rng": rngs, "world": world,
                    "data_rng": data_rng.bit_generator.state}, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(final + ".old", ignore_errors=True)   # left by a kill after the swap: os.replace needs it gone
        if os.path.exists(final):
            os.replace(final, final + ".old")   # a kill from here to the next rename: checkpoint_to_resume takes .old
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_trainer_state(state, model, opt, data_rng, engine=None):
    """Optimizer, RNG streams and data order from trainer_state.pt (model weights are loaded before wrapping)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    rank, world = rank_world()
    set_optimizer_state_dict(unwrap(model), opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    if state["world"] == world:
        set_rng_state(state["rng"][rank])
        if state["rng"][rank].get("engine") is not None and hasattr(engine, "rng"):
            engine.rng = state["rng"][rank]["engine"]
    elif rank == 0:
        print(f"[seed] note: resumed on {world} ranks (saved on {state['world']}); "
              f"RNG streams restart from the seed", flush=True)
    data_rng.bit_generator.state = state["data_rng"]


def resume(run_dir, model, opt, data_rng, engine=None):
    """Continue the run in run_dir from checkpoint/ (its weights are already in the model): optimizer, RNG
    streams, data order; the metric lines written after the checkpoint are dropped, to be recomputed (none lost,
    none doubled). -> the next update."""
    state = torch.load(os.path.join(run_dir, CHECKPOINT, "trainer_state.pt"), weights_only=False)
    load_trainer_state(state, model, opt, data_rng, engine)
    start = state["update"]
    if rank_world()[0] == 0:
        kept = [m for m in read_metrics(run_dir) if m["update"] < start]
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in kept)
        print(f"[seed] resumed {run_dir} at update {start}", flush=True)
    return start


def finish(run):
    """The end of a run: every rank done, the engine closed, then the process group."""
    if dist.is_initialized():
        dist.barrier()
    run.engine.close()   # first: vLLM's shutdown tears down its groups on top of the trainer's
    teardown_dist()
    if run.rank == 0:
        print(f"[seed] done: {os.path.join(run.run_dir, 'metrics.jsonl')}, {os.path.join(run.run_dir, 'curves.png')}, "
              f"{os.path.join(run.run_dir, CHECKPOINT)}", flush=True)


# ----------------------------------------------------------------------------- a quiet console

def quiet_console():
    """The libraries' warnings, info lines and progress bars off, unless SEED_VERBOSE=1 (call at start-up, before
    vLLM is imported): vLLM logs errors only, transformers too, without its loading bars; Python's
    Future/Deprecation warnings and every warning raised inside vllm, torch or transformers are ignored. torch's
    C++ warnings (vLLM's NUMA binding) read TORCH_CPP_LOG_LEVEL when torch is imported: run.sh exports it (this
    sets it for child processes). Our own bars stay one line on a terminal and are off when stderr is a file
    (progress_off). -> False when SEED_VERBOSE asked for everything."""
    if os.environ.get("SEED_VERBOSE", "0") not in ("", "0"):
        return False
    for k, v in (("VLLM_LOGGING_LEVEL", "ERROR"), ("TRANSFORMERS_VERBOSITY", "error"),
                 ("TORCH_CPP_LOG_LEVEL", "ERROR"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
        os.environ.setdefault(k, v)
    # vLLM logs a few lines while its logging is still unset (Triton's CPU backend): they go by the "vllm" level
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", module=r"(vllm|torch|transformers|triton)(\.|$)")
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return True


def progress_off(show=True):
    """tqdm's `disable` for one of our bars: off where not shown (another rank), else None: tqdm draws it on a
    terminal (one line, redrawn) and leaves it out when stderr is a file, so a log holds no bar."""
    return None if show else True


# ----------------------------------------------------------------------------- the token picture

TOKEN_ROWS, TOKEN_PAGE = "tokens.json", "tokens.html"   # a few rows of the last update (diagnostics.shown_rows)


def _shade(g):
    """A gate g in [0, 1] -> a background colour: green where the teacher favours the token (g > 0.5), red where
    it rejects it (g < 0.5), white at 0.5 (the skill changed nothing)."""
    a = min(abs(g - 0.5) * 2.0, 1.0)
    rgb = (46, 160, 67) if g >= 0.5 else (207, 34, 46)
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{a:.2f})"


def write_token_page(run_dir, update, rows):
    """runs/<name>/tokens.json (the rows) and tokens.html: each row's task, outcome, advantage and skill, then its
    response with every token shaded by its OPD gate g = sigmoid(beta (lp_skill - lp)) (hover: the log-probs).
    rows: diagnostics.shown_rows. Self-contained (no script, no download). -> the page's path (None without rows)."""
    import html
    if not rows:
        return None
    with open(os.path.join(run_dir, TOKEN_ROWS), "w") as f:
        json.dump({"update": update, "rows": rows}, f)
    esc = lambda s: html.escape(str(s), quote=True)
    parts = [f"<!doctype html><meta charset='utf-8'><title>{esc(os.path.basename(os.path.normpath(run_dir)))}"
             f" update {update}: tokens</title><style>body{{font:14px/1.5 sans-serif;max-width:60em;margin:1em auto}}"
             ".row{border-top:1px solid #ccc;margin-top:.6em;padding-top:.5em}.skill{background:#f3f3f3;padding:.3em .5em}"
             ".resp{font-family:monospace;white-space:pre-wrap;margin-top:.3em}.tok{border-radius:2px}</style>",
             f"<h2>Update {update}: what the skill moved</h2><p>Each response token is shaded by its OPD gate "
             "g = sigmoid(5 (log pi(token | h + skill) - log pi(token | h))): <span class='tok' style='background:"
             f"{_shade(1.0)}'>teacher favours</span>, <span class='tok' style='background:{_shade(0.0)}'>teacher "
             "rejects</span>, unshaded where the skill changed nothing. Hover a token for its log-probs.</p>"]
    for k, r in enumerate(rows):
        first = k == 0 or rows[k - 1]["episode"] != r["episode"]   # the task and skill once per episode
        head = (f"<div class='ep'><b>task</b> {esc(r['task'])} &middot; <b>episode</b> {'won' if r['won'] else 'lost'}"
                f"</div><div class='skill'><b>skill</b> {esc(r['skill'])}</div>") if first else ""
        toks = "".join(f"<span class='tok' style='background:{_shade(g)}' title='student {lp:.3f}, teacher "
                       f"{ls:.3f}, gate {g:.3f}'>{esc(t)}</span>" for t, lp, ls, g in r["tokens"])
        parts.append(f"<div class='{'row' if first else 'step'}'>{head}<div class='resp'><b>step {r['step'] + 1}</b> "
                     f"(advantage {r['adv']:+.3f}, action {esc(r['action'])}) {toks}</div></div>")
    path = os.path.join(run_dir, TOKEN_PAGE)
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return path


def what_seed_did(run_dir, top=4):
    """The demo's last lines, from tokens.json and metrics.jsonl: one episode of the last update (task, actions,
    the skill the policy wrote about it), the tokens whose log-prob the skill moved most (student lp -> teacher
    lp_skill, gate), the update's loss sizes, gate, tied groups, and where the pictures are. -> [str]."""
    if not os.path.exists(os.path.join(run_dir, TOKEN_ROWS)):
        return [f"no {TOKEN_ROWS} in {run_dir}: no update re-scored a skill"]
    saved = json.load(open(os.path.join(run_dir, TOKEN_ROWS)))
    m = ([x for x in read_metrics(run_dir) if x.get("update") == saved["update"] and "success" in x] or [{}])[-1]
    ep = [r for r in saved["rows"] if r["episode"] == saved["rows"][0]["episode"]]
    moved = sorted(((abs(ls - lp), t, lp, ls, g, r["step"]) for r in ep for t, lp, ls, g in r["tokens"]),
                   key=lambda x: -x[0])[:top]
    one = lambda s, n=110: s if len(s) <= n else s[:n - 3] + "..."
    return [f"what SEED did in update {saved['update']} (a {'won' if ep[0]['won'] else 'lost'} episode of its "
            f"training rollouts):",
            f"  task    {one(ep[0]['task'])}",
            f"  actions {one(' | '.join(str(r['action']) for r in ep))}",
            f"  skill   {one(ep[0]['skill'], 300)}",
            "  moved   " + "; ".join(f"{t!r} step {s + 1}: {lp:.2f} -> {ls:.2f}, g {g:.2f}"
                                     for _, t, lp, ls, g, s in moved) + "   (student lp -> teacher lp_skill, gate)",
            f"  update  OPD loss {m.get('loss/opd', float('nan')):.3g}, GRPO loss {m.get('loss/pg', float('nan')):.3g}, "
            f"gate {m.get('gate/mean', float('nan')):.3f} +- {m.get('gate/std', float('nan')):.3f}, tied groups "
            f"{m.get('diag/tied_groups', float('nan')):.2f}, training success {m.get('success', float('nan')):.2f}",
            f"  page    {os.path.join(run_dir, TOKEN_PAGE)}   curves {os.path.join(run_dir, 'curves.png')}"]
