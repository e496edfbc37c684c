"""SEED Stage 1: teach the model to analyze its own episodes (Section 3.5; DESIGN section 1).

    episodes <- collect(base model, M tasks, K0 episodes each)            # rollout.collect, temperature 1
    labels   <- annotate(episodes)    the external analyzer (any OpenAI-compatible endpoint, temperature 0)
                                      or, for the offline envs, the scripted one (the env's expert plan)
    keep the labels that parse as {"episode_summary", "episode_skill"}
    fine-tune N epochs on  analysis_prompt(episode) -> JSON  with the loss on the JSON only
    save an HF checkpoint + tokenizer (what `seed.py --init` takes) and the skill library next to it

Collection and annotation are cached under <out>/stage1/ (one JSON line per episode and per label):
a restarted run reuses the episodes and sends nothing twice to the analyzer. Runs under plain python or
torchrun (each rank collects and annotates its share of the tasks; training is DDP or FSDP2 as in seed.py).
"""
import dataclasses
import gc
import glob
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import analyzer
import envs
import grpo
import rollout
import seed
from rollout import Episode, Step


@dataclass
class SFTConfig:
    env: str = "alfworld"              # benchmark: alfworld | webshop | search | sokoban | ezpoints
    model: str = "smollm2-135m"        # base model: "smollm2-135m" (embedded), a local folder or a cached HF name
    out: str = ""                      # checkpoint folder ("" = runs/sft-<env>)
    seed: int = 0                      # seed of the task draw, the sampling and the data order
    tasks: int = 180                   # M: training tasks to play (the paper: 180)
    k0: int = 8                        # K0: episodes per task
    collect_batch: int = 16            # tasks played at once (k0 envs each)
    max_steps: int = 30                # env steps per episode
    history_length: int = 5            # past (observation, action) pairs in the actor prompt
    max_prompt_tokens: int = 2048      # longest actor prompt the engine accepts
    max_tokens: int = 512              # response tokens per turn
    temperature: float = 1.0           # rollout temperature
    data_dir: str = ""                 # env data folder ("" = the env's default)
    retriever_url: str = "http://127.0.0.1:8000/retrieve"   # search QA retriever
    engine: str = "vllm"               # rollout engine: vllm | hf
    dtype: str = "auto"                # engine dtype: auto | float32 | bfloat16
    analyzer_url: str = ""             # external analyzer API root (e.g. http://127.0.0.1:8001/v1); "" = scripted
    analyzer_model: str = ""           # model name the endpoint serves (GLM-5.2 in the paper)
    analyzer_key_env: str = "SEED_ANALYZER_KEY"   # environment variable holding the API key (never logged)
    annotate_batch: int = 32           # episodes per annotation round (each round is cached)
    epochs: int = 3                    # SFT epochs
    lr: float = 5e-6                   # AdamW learning rate, constant
    weight_decay: float = 0.01         # AdamW weight decay
    grad_clip: float = 1.0             # max global grad norm
    batch_size: int = 16               # examples per optimizer step, over all ranks
    micro_batch_size: int = 4          # examples per forward on one rank
    fsdp: bool = False                 # FSDP2 instead of DDP under torchrun
    gradient_checkpointing: bool = False   # recompute activations in the backward (large models)


ENV_DEFAULTS = {env: {k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(SFTConfig)}}
                for env, d in seed.ENV_DEFAULTS.items()}


def validate(cfg):
    if cfg.env not in envs.NAMES:
        seed.fail(f"unknown --env {cfg.env!r}; choose one of {', '.join(envs.NAMES)}")
    if cfg.engine not in ("vllm", "hf"):
        seed.fail(f"unknown --engine {cfg.engine!r}; choose vllm or hf")
    if cfg.data_dir and not os.path.exists(cfg.data_dir):
        seed.fail(f"--data_dir {cfg.data_dir} does not exist")
    if cfg.env == "alfworld" and not cfg.data_dir:
        from envs.alfworld import HOW_TO_GET_GAMES, find_data_dir
        try:
            find_data_dir(None)
        except Exception:
            seed.fail(f"no ALFWorld games found (data/alfworld or $ALFWORLD_DATA); {HOW_TO_GET_GAMES}")
    if bool(cfg.analyzer_url) != bool(cfg.analyzer_model):
        seed.fail("the external analyzer needs both --analyzer_url and --analyzer_model")
    if cfg.env == "webshop" and not cfg.analyzer_url:
        seed.fail("WebShop has no expert plan for the scripted annotator; pass --analyzer_url/--analyzer_model")
    for name in ("tasks", "k0", "epochs", "batch_size", "micro_batch_size", "collect_batch", "annotate_batch"):
        if getattr(cfg, name) < 1:
            seed.fail(f"--{name} must be positive, got {getattr(cfg, name)}")


# ----------------------------------------------------------------------------- the cache (resumable)

def episode_to_json(key, ep):
    return {"key": key, "episode": dataclasses.asdict(ep)}


def episode_from_json(d):
    e = dict(d["episode"])
    e["steps"] = [Step(**s) for s in e["steps"]]
    return Episode(**e)


def read_jsonl(pattern):
    """All lines of every file matching the pattern (one file per rank); a cut-off last line is skipped."""
    out = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass   # a line cut by a kill: that episode / label is redone
    return out


def append_jsonl(path, records):
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------- Stage 1

def collect_episodes(cfg, cache, rank, world, tasks):
    """Play K0 episodes of each of this rank's tasks (cached: tasks already played are skipped).
    -> {key: Episode} for every task of every rank played so far."""
    done = {d["key"]: d for d in read_jsonl(os.path.join(cache, "episodes.rank*.jsonl"))}
    mine = [j for j in range(rank, len(tasks), world) if f"{j}:{cfg.k0 - 1}" not in done]
    if mine:
        engine = rollout.make_engine(cfg.engine, rollout.resolve_model(cfg.model), dtype=seed.resolved_dtype(cfg),
                                     seed=cfg.seed, max_model_len=cfg.max_prompt_tokens + cfg.max_tokens)
        tok = _tokenizer(cfg.model)
        pool = [envs.make(cfg.env, **seed.env_kwargs(cfg, "train")) for _ in range(min(cfg.collect_batch, len(mine)) * cfg.k0)]
        for i in range(0, len(mine), cfg.collect_batch):
            js = mine[i:i + cfg.collect_batch]
            eps = rollout.collect(engine, tok, pool[:len(js) * cfg.k0], [tasks[j] for j in js], cfg.k0,
                                  temperature=cfg.temperature, max_tokens=cfg.max_tokens, progress=rank == 0)
            append_jsonl(os.path.join(cache, f"episodes.rank{rank}.jsonl"),
                         [episode_to_json(f"{js[n // cfg.k0]}:{n % cfg.k0}", ep) for n, ep in enumerate(eps)])
            if rank == 0:
                print(f"[sft] collected {min(i + cfg.collect_batch, len(mine))}/{len(mine)} tasks "
                      f"(success {np.mean([ep.won for ep in eps]):.2f})", flush=True)
        del engine, pool
        gc.collect()    # the engine's weights and KV cache are not needed for training
    seed.gather(None)   # barrier (gloo-safe)
    return {d["key"]: episode_from_json(d) for d in read_jsonl(os.path.join(cache, "episodes.rank*.jsonl"))}


def _tokenizer(model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(rollout.resolve_model(model))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def annotate(cfg, cache, rank, world, episodes):
    """Label every episode (external endpoint or scripted), caching each round: labels already in the cache
    are never requested again. Keeps what parses. -> {key: {"episode_summary", "episode_skill"} or None}."""
    labels = {d["key"]: d["analysis"] for d in read_jsonl(os.path.join(cache, "labels.rank*.jsonl"))}
    keys = sorted(episodes)
    todo = [k for n, k in enumerate(keys) if n % world == rank and k not in labels]
    client = (analyzer.ExternalAnalyzer(cfg.analyzer_url, cfg.analyzer_model, api_key_env=cfg.analyzer_key_env)
              if cfg.analyzer_url else None)
    bar = tqdm(total=len(todo), desc="annotate", disable=rank != 0)
    for i in range(0, len(todo), cfg.annotate_batch):
        batch = todo[i:i + cfg.annotate_batch]
        eps = [episodes[k] for k in batch]
        raw = client.annotate(eps, progress=False) if client else [analyzer.scripted_analysis(ep) for ep in eps]
        parsed = [analyzer.parse_analysis(json.dumps(a)) if a else None for a in raw]   # keep what parses
        append_jsonl(os.path.join(cache, f"labels.rank{rank}.jsonl"),
                     [{"key": k, "analysis": p} for k, p in zip(batch, parsed)])
        bar.update(len(batch))
    bar.close()
    seed.gather(None)
    return {d["key"]: d["analysis"] for d in read_jsonl(os.path.join(cache, "labels.rank*.jsonl"))}


def make_examples(tok, episodes, labels):
    """analysis prompt (chat ids) -> the label as compact JSON + end-of-turn token."""
    out = []
    for key in sorted(labels):
        lab = labels[key]
        if lab and key in episodes:
            prompt = rollout.chat_ids(tok, analyzer.analysis_prompt(episodes[key]))
            target = json.dumps({"episode_summary": lab["episode_summary"], "episode_skill": lab["episode_skill"]})
            out.append((prompt, tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    return out


def finetune(cfg, examples, rank, world, device):
    """N epochs of token-mean NLL on the completion only (prompt masked); global token count under DDP.
    -> (model, per-step log)."""
    model, tok, _ = rollout.load_model(cfg.model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    wrapped = seed.wrap(model, cfg, device, world)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    log, bar = [], tqdm(total=cfg.epochs * steps_per_epoch, desc="sft", disable=rank != 0)
    for epoch in range(cfg.epochs):
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(examples))   # same on every rank
        for s in range(steps_per_epoch):
            batch = [examples[i] for i in order[s * cfg.batch_size:(s + 1) * cfg.batch_size]][rank::world]
            n_tok = seed.all_sum(sum(len(c) for _, c in batch))
            opt.zero_grad(set_to_none=True)
            micros, total = seed.chunked(len(batch), cfg.micro_batch_size, same_count=True), 0.0
            for k, idx in enumerate(micros):
                mb = [batch[i] for i in idx] if idx else examples[:1]       # filler: weight 0
                with seed.grad_sync(wrapped, k == len(micros) - 1), seed.autocast(device, seed.resolved_dtype(cfg)):
                    lp, mask, _ = grpo.response_logprobs(wrapped, [p for p, _ in mb], [c for _, c in mb],
                                                         tok.pad_token_id, grad=True)   # [rows, R]
                    nll = -grpo.masked_mean(lp, mask, max(n_tok, 1.0) / world)           # share of the token mean
                    (nll if idx else nll * 0.0).backward()
                total += float(nll.detach()) * world if idx else 0.0
            norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip)
            opt.step()
            loss = seed.all_sum(total) / world
            log.append({"epoch": epoch, "step": len(log), "loss": loss, "tokens": n_tok,
                        "grad_norm": float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)})
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss:.3f}")
    bar.close()
    return wrapped, tok, log


def main(argv=None):
    cfg = seed.parse_config(argv, cls=SFTConfig, env_defaults=ENV_DEFAULTS, doc=__doc__)
    cfg.out = cfg.out or os.path.join("runs", f"sft-{cfg.env}")
    validate(cfg)
    rank, world, device = seed.setup_dist(cfg.seed)
    cache = os.path.join(cfg.out, "stage1")
    os.makedirs(cache, exist_ok=True)
    t0 = time.time()
    probe = envs.make(cfg.env, **seed.env_kwargs(cfg, "train"))
    rng = np.random.default_rng(cfg.seed)
    tasks = (rng.permutation(probe.num_tasks)[:cfg.tasks] if cfg.tasks <= probe.num_tasks
             else rng.integers(probe.num_tasks, size=cfg.tasks)).tolist()
    episodes = collect_episodes(cfg, cache, rank, world, tasks)
    t_collect = time.time() - t0
    labels = annotate(cfg, cache, rank, world, episodes)
    t_annotate = time.time() - t0 - t_collect
    tok = _tokenizer(cfg.model)
    examples = make_examples(tok, episodes, labels)
    if not examples:
        seed.fail("no annotation parsed: nothing to fine-tune on (see the labels in " + cache + ")")
    if rank == 0:
        print(f"[sft] {len(episodes)} episodes (success {np.mean([e.won for e in episodes.values()]):.2f}), "
              f"{sum(v is not None for v in labels.values())} labels parsed, {len(examples)} examples", flush=True)
    model, tok, log = finetune(cfg, examples, rank, world, device)
    save(cfg, model, tok, episodes, labels, log, rank, world,
         {"sec/collect": t_collect, "sec/annotate": t_annotate, "sec/total": time.time() - t0})
    seed.teardown_dist()


def save(cfg, model, tok, episodes, labels, log, rank, world, times):
    """HF checkpoint + tokenizer + skills.jsonl (the skill library) + sft_log.jsonl + stage1.json."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(seed.unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    seed.unwrap(model).save_pretrained(cfg.out, state_dict=sd, safe_serialization=True)
    tok.save_pretrained(cfg.out)
    library = analyzer.SkillLibrary()
    for key in sorted(labels):
        if labels[key] and key in episodes:
            ep = episodes[key]
            library.add(cfg.env, ep.family, ep.task, labels[key]["episode_skill"])
    library.save(os.path.join(cfg.out, seed.SKILL_FILE))
    with open(os.path.join(cfg.out, "sft_log.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    cfg_dict = dataclasses.asdict(cfg)
    summary = {"config": cfg_dict, "world_size": world, "episodes": len(episodes),
               "success": float(np.mean([e.won for e in episodes.values()])),
               "labels": len(labels), "parsed": sum(v is not None for v in labels.values()),
               "skills": len(library.entries), "final_loss": log[-1]["loss"] if log else None, **times}
    with open(os.path.join(cfg.out, "stage1.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[sft] saved {cfg.out} ({len(library.entries)} skills; loss {log[0]['loss']:.3f} -> "
          f"{log[-1]['loss']:.3f}; {times['sec/total']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
