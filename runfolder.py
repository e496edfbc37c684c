"""A run's start and its folder (README: the run folder), shared by seed.py and sft.py: flags -> config, start-up
errors, and everything a run writes and reads back in `runs/<name>/`:

    config.json                    the flags (+ world_size)
    metrics.jsonl                  one line per update (write_metrics, read_metrics)
    episodes/update_XXXX.jsonl     every episode of an update, with its summary and skill (episode_record)
    curves.png                     success, length, invalid rate, OPD loss, gate, KL, teacher diagnostics (plot_curves)
    checkpoint/                    HF weights + tokenizer + trainer_state.pt (save_checkpoint; --resume: resume)
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import envs
import vision
from parallel import gather, rank_world, unwrap

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


# ----------------------------------------------------------------------------- the folder

def open_folder(cfg, rank, world):
    """Check and prepare the run folder cfg.out (a finished or running run is never overwritten without
    --resume; --resume without a checkpoint starts over) and write config.json. -> whether to resume."""
    run_dir = cfg.out
    resuming = cfg.resume and os.path.exists(os.path.join(run_dir, CHECKPOINT, "trainer_state.pt"))
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
    return resuming


def write_episodes(run_dir, u, records):
    """episodes/update_XXXX.jsonl: every rank's episodes of update u (episode_record each)."""
    with open(os.path.join(run_dir, "episodes", f"update_{u:04d}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def episode_record(ep):
    return {"task_id": ep.task_id, "group_id": ep.group_id, "env": ep.env, "task": ep.task, "family": ep.family,
            "won": ep.won, "reward": ep.reward, "length": ep.length, "summary": ep.summary, "skill": ep.skill,
            "step_skills": {str(t): k for t, k in sorted(ep.step_skills.items())},
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
    gate mean +- std, KL to the reference, the teacher's shift on action tokens (delta percentiles, gate std)
    and the share of tied groups with the gate-advantage covariance (opd.teacher_diagnostics)."""
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
    ax[1, 2].plot(u, col("loss/kl"), "o-")
    ax[1, 2].set(title="KL to the reference (k3, token mean)", xlabel="update")
    for k, style in (("diag/delta_action_p5", "v:"), ("diag/delta_action_p50", "o-"), ("diag/delta_action_p95", "^:")):
        ax[0, 3].plot(u, col(k), style, label=k.split("_")[-1])
    ax[0, 3].plot(u, col("diag/gate_std_action"), "s--", label="gate std")
    ax[0, 3].plot(u, col("diag/gate_std_response"), "d--", label="gate std, all response tokens")
    ax[0, 3].set(title="teacher shift on action tokens (lp_skill - lp)", xlabel="update")
    ax[0, 3].legend(fontsize=8)
    ax[1, 3].plot(u, col("diag/tied_groups"), "o-", label="tied groups (share)")
    ax[1, 3].plot(u, col("diag/gate_adv_cov"), "s--", label="cov(row gate, advantage)")
    ax[1, 3].set(title="GRPO's zero-gradient groups; does the teacher favour winners?", xlabel="update")
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
        if os.path.exists(final):
            os.replace(final, final + ".old")
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
