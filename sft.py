"""SEED Stage 1: teach the model to analyze its own episodes (Section 3.2, hindsight-skill SFT;
docs/design-notes.md: the method, its defaults).

    tasks    <- M tasks, seeded; ALFWorld: M/6 of each task family              # draw_tasks
    episodes <- collect(base model, tasks, K0 episodes each)      # rollout.collect, temperature 0.4
    labels   <- annotate(episodes)    the external analyzer (any OpenAI-compatible endpoint, temperature 0,
                                      one request per episode) or, for the offline envs, the scripted one
    keep the labels whose "episode_skill" is a non-empty string
    pairs    <- fit_prompt(episode) -> JSON    (the very prompt Stage 2's analyzer reads); 10% held out
    fine-tune N epochs (AdamW betas (0.9, 0.95), cosine lr with 10% linear warm-up, batch 8), loss on the
    JSON only; validation loss after every epoch
    save an HF checkpoint + tokenizer (what `seed.py --init` takes) and the skill library next to it

Collection and annotation are cached under <out>/stage1/ (one JSON line per episode and per label):
a restarted run reuses the episodes and sends nothing twice to the analyzer. Runs under plain python or
torchrun (each rank collects and annotates its share of the tasks; training is DDP or FSDP2 as in seed.py).

`--stage warmup`, `--replay` and `--skill_tasks` are not part of the method: the CPU testbed (testbed.py) for
a model too small to write the action format (the embedded 135M model; the paper's backbones start from the
instruct model). They reuse this file's task draw, split and fine-tuning loop.
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
import parallel
import rollout
import runfolder
from rollout import Episode, Step


@dataclass
class SFTConfig:
    env: str = "alfworld"              # benchmark: alfworld | webshop | search | sokoban | ezpoints
    stage: str = "analyzer"            # analyzer (Stage 1) | warmup (the CPU testbed's warm start: clone the expert)
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
    temperature: float = 0.4           # rollout temperature (authors' Stage 1; Sokoban / EZPoints 1.0)
    data_dir: str = ""                 # env data folder ("" = the env's default)
    retriever_url: str = "http://127.0.0.1:8000/retrieve"   # search QA retriever
    engine: str = "vllm"               # rollout engine: vllm | hf
    image: bool = False                # image observations (a vision-language model; sokoban, ezpoints)
    dtype: str = "auto"                # engine and autocast dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    analyzer_url: str = ""             # external analyzer API root (e.g. http://127.0.0.1:8001/v1); "" = scripted
    analyzer_model: str = ""           # model name the endpoint serves (GLM-5.2 in the paper)
    analyzer_key_env: str = "SEED_ANALYZER_KEY"   # environment variable holding the API key (never logged)
    annotate_batch: int = 32           # episodes per annotation round (each round is cached)
    analyzer_max_prompt_tokens: int = 16384   # analysis prompt budget, as seed.py's (the same prompt in both stages)
    analyzer_max_tokens: int = 1024    # new tokens per external analysis (authors' 1,024), kept free in the context
    skill_mode: str = "episode_only"   # skills the labels hold, as seed.py's (the per-env defaults are shared)
    max_step_skills: int = 5           # step skills per label at most, as seed.py's
    epochs: int = 3                    # SFT epochs
    val_fraction: float = 0.1          # share of the (prompt, JSON) pairs held out for the validation loss (seeded)
    lr: float = 5e-6                   # AdamW peak learning rate (Sokoban / EZPoints 2e-6)
    warmup_ratio: float = 0.1          # linear warm-up over this share of the steps, then cosine to 0 (warm start: constant)
    weight_decay: float = 0.01         # AdamW weight decay (betas (0.9, 0.95), as the authors' SFT trainer)
    grad_clip: float = 1.0             # max global grad norm
    batch_size: int = 8                # examples per optimizer step, over all ranks
    micro_batch_size: int = 4          # examples per forward on one rank
    fsdp: bool = False                 # FSDP2 instead of DDP under torchrun
    gradient_checkpointing: bool = False   # recompute activations in the backward (large models)
    replay: int = 0                    # CPU testbed: expert tasks whose warm-start pairs join Stage 1's training
    skill_tasks: int = 0               # CPU testbed: N more expert tasks taught with their skill in the prompt (warm start, or Stage 1 beside --replay; not the method)
    webshop_small: bool = True         # WebShop: the 1,000-product catalogue (authors' use_small), as seed.py's
    webshop_human_goals: bool = False  # WebShop: human-written goals (authors: False, synthetic goals), as seed.py's
    webshop_train_from: int = 500      # WebShop: first training goal index (authors 500), as seed.py's


ENV_DEFAULTS = {env: {k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(SFTConfig)}}
                for env, d in envs.defaults().items()}   # each env class's column, as seed.py's
for _env in ("sokoban", "ezpoints"):          # the authors' Sokoban / EZPoints Stage 1
    ENV_DEFAULTS[_env].update(temperature=1.0, lr=2e-6)
BETAS = (0.9, 0.95)                           # AdamW betas of the authors' SFT trainer


def validate(cfg):
    runfolder.check_common(cfg, ("tasks", "k0", "epochs", "batch_size", "micro_batch_size", "collect_batch",
                                 "annotate_batch", "analyzer_max_tokens", "analyzer_max_prompt_tokens"))
    if cfg.stage not in ("analyzer", "warmup"):
        runfolder.fail(f"unknown --stage {cfg.stage!r}; choose analyzer or warmup")
    if cfg.stage == "warmup" or cfg.replay or cfg.skill_tasks:
        import testbed   # the CPU testbed (not the method): imported only where its flags ask for it
        if cfg.env not in testbed.EXPERT_THOUGHTS:
            runfolder.fail(f"--stage warmup (and --replay, --skill_tasks) needs an env with an expert: "
                           f"{', '.join(testbed.EXPERT_THOUGHTS)}")
    if bool(cfg.analyzer_url) != bool(cfg.analyzer_model):
        runfolder.fail("the external analyzer needs both --analyzer_url and --analyzer_model")
    if cfg.skill_mode not in analyzer.SKILL_MODES or cfg.max_step_skills < 0:
        runfolder.fail(f"--skill_mode must be {'|'.join(analyzer.SKILL_MODES)} and --max_step_skills 0 or more")
    if cfg.env == "webshop" and not cfg.analyzer_url:
        runfolder.fail("WebShop has no expert plan for the scripted annotator; pass --analyzer_url/--analyzer_model")
    if cfg.skill_tasks < 0 or cfg.replay < 0:
        runfolder.fail(f"--skill_tasks and --replay must be 0 or more, got {cfg.skill_tasks}, {cfg.replay}")
    if not (0 <= cfg.val_fraction < 1 and 0 <= cfg.warmup_ratio < 1):
        runfolder.fail(f"--val_fraction and --warmup_ratio must be in [0, 1), got {cfg.val_fraction}, {cfg.warmup_ratio}")


# ----------------------------------------------------------------------------- the cache (resumable)

def episode_to_json(key, ep):
    return {"key": key, "episode": dataclasses.asdict(ep)}


def episode_from_json(d):
    e = dict(d["episode"])
    e["steps"] = [Step(**{"engine_logprobs" if k == "old_logprobs" else k: v for k, v in s.items()})   # older caches
                  for s in e["steps"]]
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

def draw_tasks(probe, m, rng):
    """The M Stage-1 tasks. An env whose games carry a family (ALFWorld) is drawn stratified, as the authors:
    M/6 tasks of each of its six families (30 each for M = 180; a remainder goes to the first families),
    at random within a family, repeating a family's games only when it has fewer than its share. Other envs:
    M distinct tasks at random (with repeats only when M exceeds the tasks there are)."""
    if probe.name != "alfworld":
        return (rng.permutation(probe.num_tasks)[:m] if m <= probe.num_tasks
                else rng.integers(probe.num_tasks, size=m)).tolist()
    from envs.alfworld import FAMILIES, family_of
    pools = [[i for i, g in enumerate(probe.games) if family_of(g) == f] for f in FAMILIES.values()]
    pools = [p for p in pools if p]                        # task ids of each family present
    out = []
    for k, pool in enumerate(pools):
        share = m // len(pools) + (k < m % len(pools))
        while share > 0:
            take = rng.permutation(pool)[:share].tolist()
            out, share = out + take, share - len(take)
    return out


def split_pairs(examples, fraction, rng):
    """-> (train, validation): `fraction` of the pairs held out at random (at least one when fraction > 0
    and there are two or more, as the authors' split)."""
    n = len(examples)
    k = int(round(n * fraction))
    if fraction > 0 and n > 1:
        k = max(1, min(k, n - 1))
    order = rng.permutation(n)
    return [examples[i] for i in order[k:]], [examples[i] for i in order[:k]]


def collect_episodes(cfg, cache, rank, world, tasks):
    """Play K0 episodes of each of this rank's tasks (cached: tasks already played are skipped).
    -> {key: Episode} for every task of every rank played so far."""
    done = {d["key"]: d for d in read_jsonl(os.path.join(cache, "episodes.rank*.jsonl"))}
    mine = [j for j in range(rank, len(tasks), world) if f"{j}:{cfg.k0 - 1}" not in done]
    if mine:
        engine = rollout.make_engine(cfg.engine, rollout.resolve_model(cfg.model), dtype=parallel.resolved_dtype(cfg),
                                     seed=cfg.seed, max_model_len=cfg.max_prompt_tokens + cfg.max_tokens)
        tok = _tokenizer(cfg.model)
        pool = [envs.from_config(cfg, "train") for _ in range(min(cfg.collect_batch, len(mine)) * cfg.k0)]
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
    parallel.gather(None)   # barrier (gloo-safe)
    return {d["key"]: episode_from_json(d) for d in read_jsonl(os.path.join(cache, "episodes.rank*.jsonl"))}


def _tokenizer(model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(rollout.resolve_model(model))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def prompt_budget(cfg):
    """The analysis prompt budget, computed as seed.py computes it (the model's context caps it)."""
    return analyzer.analysis_budget(rollout.resolve_model(cfg.model), cfg.analyzer_max_prompt_tokens,
                                cfg.analyzer_max_tokens)[0]


def annotate(cfg, cache, rank, world, episodes, tok, budget):
    """Label every episode (external endpoint, reading the `fit_prompt` of the episode at `budget` tokens, or
    scripted), caching each round: labels already in the cache are never requested again. Keeps a label
    whose episode_skill is a non-empty string (the authors' filter; step_only: one step skill), its step
    skills by --skill_mode / --max_step_skills.
    -> {key: {"episode_summary", "episode_skill", "step_skills"} or None}."""
    labels = {d["key"]: d["analysis"] for d in read_jsonl(os.path.join(cache, "labels.rank*.jsonl"))}
    keys = sorted(episodes)
    todo = [k for n, k in enumerate(keys) if n % world == rank and k not in labels]
    mode, k = cfg.skill_mode, cfg.max_step_skills if cfg.skill_mode != "episode_only" else 0
    client = (analyzer.ExternalAnalyzer(cfg.analyzer_url, cfg.analyzer_model, api_key_env=cfg.analyzer_key_env,
                                        max_tokens=cfg.analyzer_max_tokens, skill_mode=mode, max_step_skills=k)
              if cfg.analyzer_url else None)
    bar = tqdm(total=len(todo), desc="annotate", disable=runfolder.progress_off(rank == 0))
    for i in range(0, len(todo), cfg.annotate_batch):
        batch = todo[i:i + cfg.annotate_batch]
        eps = [episodes[k] for k in batch]
        raw = (client.annotate([analyzer.fit_prompt(ep, tok, budget, mode, k) for ep in eps], progress=False)
               if client else [analyzer.scripted_analysis(ep, max_step_skills=k) for ep in eps])
        parsed = [analyzer.parse_analysis(json.dumps(a), True, mode, k, ep.length) if a else None
                  for a, ep in zip(raw, eps)]
        append_jsonl(os.path.join(cache, f"labels.rank{rank}.jsonl"),
                     [{"key": k, "analysis": p} for k, p in zip(batch, parsed)])
        bar.update(len(batch))
    bar.close()
    parallel.gather(None)
    return {d["key"]: d["analysis"] for d in read_jsonl(os.path.join(cache, "labels.rank*.jsonl"))}


def label_json(lab, skill_mode="episode_only"):
    """A label as the compact JSON the analyzer is taught to write, with the fields its prompt asks for."""
    out = {"episode_summary": lab["episode_summary"]}
    if skill_mode != "step_only":
        out["episode_skill"] = lab["episode_skill"]
    if skill_mode != "episode_only":   # 0-based step keys, in step order ({} when the label has none)
        steps = sorted((lab.get("step_skills") or {}).items(), key=lambda x: int(x[0]))
        out["step_skills"] = {str(t): k for t, k in steps}
    return json.dumps(out)


def make_examples(tok, episodes, labels, budget, skill_mode="episode_only", max_step_skills=0):
    """The analysis prompt Stage 2 would feed (fit_prompt at `budget` tokens, in the same skill mode; chat ids)
    -> the label as compact JSON (label_json) + end-of-turn token."""
    out = []
    for key in sorted(labels):
        lab = labels[key]
        if lab and key in episodes:
            msgs = analyzer.fit_prompt(episodes[key], tok, budget, skill_mode, max_step_skills)
            prompt = rollout.chat_ids(tok, msgs)
            target = label_json(lab, skill_mode)
            out.append((prompt, tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    return out


def nll_sum(model, batch, pad_id, cfg, device, grad):
    """-> (summed NLL of the completion tokens [scalar tensor], their count) of (prompt, completion) pairs."""
    with parallel.autocast(device, parallel.resolved_dtype(cfg)):
        lp, mask, _ = grpo.response_logprobs(model, [p for p, _ in batch], [c for _, c in batch], pad_id,
                                             grad=grad)   # [rows, R]
    return -(lp * mask).sum(), float(mask.sum())


def val_loss(model, val, rank, world, cfg, device, pad_id):
    """Token-mean NLL of the held-out pairs over all ranks (every rank runs as many forwards: FSDP)."""
    mine, total, count = val[rank::world], 0.0, 0.0
    with torch.no_grad():
        for idx in parallel.chunked(len(mine), cfg.micro_batch_size, same_count=True):
            s, n = nll_sum(model, [mine[i] for i in idx] if idx else val[:1], pad_id, cfg, device, grad=False)
            total, count = (total + float(s), count + n) if idx else (total, count)
    return parallel.all_sum(total) / max(parallel.all_sum(count), 1.0)


def finetune(cfg, examples, val, rank, world, device):
    """N epochs of token-mean NLL on the completion only (prompt masked); global token count under DDP;
    AdamW with the authors' betas; after a linear warm-up the lr decays as a cosine (Stage 1, the authors')
    or stays constant (--stage warmup); the validation loss after each epoch.
    -> (model, tokenizer, per-step log, per-epoch validation losses)."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
    model, tok, _ = rollout.load_model(cfg.model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    wrapped = parallel.wrap(model, cfg, device, world)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr, betas=BETAS, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    warm, total = int(cfg.warmup_ratio * cfg.epochs * steps_per_epoch), cfg.epochs * steps_per_epoch
    # Stage 1: the authors' cosine decay. The warm start (not theirs): a constant lr, which at the same
    # peak teaches the solver's moves in a few steps where the cosine's decay left the policy far weaker
    sched = (get_constant_schedule_with_warmup(opt, warm) if cfg.stage == "warmup"
             else get_cosine_schedule_with_warmup(opt, warm, total))
    val_log = []
    log, bar = [], tqdm(total=cfg.epochs * steps_per_epoch, desc="sft", disable=runfolder.progress_off(rank == 0))
    for epoch in range(cfg.epochs):
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(examples))   # same on every rank
        for s in range(steps_per_epoch):
            batch = [examples[i] for i in order[s * cfg.batch_size:(s + 1) * cfg.batch_size]][rank::world]
            n_tok = parallel.all_sum(sum(len(c) for _, c in batch))
            opt.zero_grad(set_to_none=True)
            micros, total = parallel.chunked(len(batch), cfg.micro_batch_size, same_count=True), 0.0
            for k, idx in enumerate(micros):
                mb = [batch[i] for i in idx] if idx else examples[:1]       # filler: weight 0
                with parallel.grad_sync(wrapped, k == len(micros) - 1):
                    nll = nll_sum(wrapped, mb, tok.pad_token_id, cfg, device, grad=True)[0] / (max(n_tok, 1.0) / world)
                    (nll if idx else nll * 0.0).backward()                  # share of the global token mean
                total += float(nll.detach()) * world if idx else 0.0
            norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            loss = parallel.all_sum(total) / world
            log.append({"epoch": epoch, "step": len(log), "loss": loss, "tokens": n_tok, "lr": lr,
                        "grad_norm": float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)})
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss:.3f}")
        if val:
            val_log.append(val_loss(wrapped, val, rank, world, cfg, device, tok.pad_token_id))
            log[-1]["val_loss"] = val_log[-1]
            if rank == 0:
                tqdm.write(f"[sft] epoch {epoch + 1}/{cfg.epochs}: train loss {loss:.4f}, "
                           f"validation loss {val_log[-1]:.4f} ({len(val)} pairs)")
    bar.close()
    return wrapped, tok, log, val_log


def main(argv=None):
    runfolder.quiet_console()   # the libraries' warnings and bars off unless SEED_VERBOSE=1
    cfg = runfolder.parse_config(argv, SFTConfig, ENV_DEFAULTS, __doc__)
    cfg.out = cfg.out or os.path.join("runs", f"{'warmup' if cfg.stage == 'warmup' else 'sft'}-{cfg.env}")
    validate(cfg)
    rank, world, device = parallel.setup_dist(cfg.seed)
    if cfg.stage == "warmup":
        import testbed
        return testbed.warmup(cfg, rank, world, device)
    cache = os.path.join(cfg.out, "stage1")
    os.makedirs(cache, exist_ok=True)
    t0 = time.time()
    probe = envs.from_config(cfg, "train")
    tasks = draw_tasks(probe, cfg.tasks, np.random.default_rng(cfg.seed))   # the same on every rank and restart
    episodes = collect_episodes(cfg, cache, rank, world, tasks)
    t_collect = time.time() - t0
    tok, budget = _tokenizer(cfg.model), prompt_budget(cfg)
    labels = annotate(cfg, cache, rank, world, episodes, tok, budget)
    t_annotate = time.time() - t0 - t_collect
    examples = make_examples(tok, episodes, labels, budget, cfg.skill_mode,
                             cfg.max_step_skills if cfg.skill_mode != "episode_only" else 0)
    if not examples:
        runfolder.fail("no annotation parsed: nothing to fine-tune on (see the labels in " + cache + ")")
    train, val = split_pairs(examples, cfg.val_fraction, np.random.default_rng([cfg.seed, 1]))
    if cfg.replay or cfg.skill_tasks:   # the CPU testbed's expert pairs (testbed.py; not the method)
        import testbed
        train = train + testbed.stage1_extras(cfg, tok, probe, rank)
    if rank == 0:
        print(f"[sft] {len(episodes)} episodes (success {np.mean([e.won for e in episodes.values()]):.2f}), "
              f"{sum(v is not None for v in labels.values())} labels kept, {len(train)} training and "
              f"{len(val)} validation pairs", flush=True)
    model, tok, log, val_log = finetune(cfg, train, val, rank, world, device)
    save(cfg, model, tok, episodes, labels, log, rank, world,
         {"train_pairs": len(train), "val_pairs": len(val), "val_loss": val_log,
          "sec/collect": t_collect, "sec/annotate": t_annotate, "sec/total": time.time() - t0})
    parallel.teardown_dist()


def save(cfg, model, tok, episodes, labels, log, rank, world, extra):
    """HF checkpoint + tokenizer + skills.jsonl (the skill library) + sft_log.jsonl (one line per step; the
    last of each epoch has its "val_loss") + stage1.json (counts, "val_loss" per epoch, timings)."""
    if not runfolder.save_model(model, tok, cfg.out, rank):
        return
    library = analyzer.SkillLibrary()
    for key in sorted(labels):
        if labels[key] and key in episodes:
            ep = episodes[key]
            library.add(cfg.env, ep.family, analyzer.episode_key(ep), labels[key]["episode_skill"])
    library.save(os.path.join(cfg.out, analyzer.SKILL_FILE))
    with open(os.path.join(cfg.out, "sft_log.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    cfg_dict = dataclasses.asdict(cfg)
    summary = {"config": cfg_dict, "world_size": world, "episodes": len(episodes),
               "success": float(np.mean([e.won for e in episodes.values()])),
               "labels": len(labels), "parsed": sum(v is not None for v in labels.values()),
               "skills": len(library.entries), "final_loss": log[-1]["loss"] if log else None, **extra}
    with open(os.path.join(cfg.out, "stage1.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[sft] saved {cfg.out} ({len(library.entries)} skills; loss {log[0]['loss']:.3f} -> "
          f"{log[-1]['loss']:.3f}; {extra['sec/total']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
