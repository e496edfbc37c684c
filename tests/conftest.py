"""Shared fixtures: the embedded model, ONE vLLM engine for the whole session (starting several in
one process is slow), an HF engine, and a small multi-turn env that follows the env contract of
`envs/__init__.py`, so rollouts can be tested without the benchmarks."""
import os
import re

import gymnasium as gym
import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; keep the test engine small
# The suite runs on 2 shared cores. With OpenMP threads > 1 every op waits for a descheduled
# sibling thread: at load 8, vLLM decoding measured 8x slower with 2 threads than with 1.
torch.set_num_threads(1)

import rollout  # noqa: E402


class ToyEnv(gym.Env):
    """The template for a new environment (README, "Adding an environment"): every attribute and method of the
    contract in envs/__init__.py, nothing more. Guess a secret number in 1..9 (task id -> number). After each guess the observation gives the
    range still possible. Follows the env contract: `<think>..</think><action>guess N</action>`;
    anything else (no tag, two tags, non-ASCII, not admissible) is an invalid step, never an error.
    Families: "low" (1-4) and "high" (5-9). `received` keeps every text `step` was given."""

    name = "toy"
    reward_scale = 10.0
    invalid_penalty = 0.1
    num_tasks = 9
    task_line = "Your task is to:"     # the prompt's task line (envs.insert_skill puts the episode skill after it)
    eval_splits = ("test",)            # held-out splits seed.py evaluates on
    response_format = "tags"           # <think>...</think><action>...</action> (envs.RESPONSE_SPANS)
    observation_in_task_key = False    # the library files a skill under the task text (analyzer.task_key)
    defaults = dict(max_steps=4, history_length=2)   # its column of seed.py's and sft.py's flags

    def __init__(self, max_steps=4, history_length=2):
        self.max_steps, self.history_length = max_steps, history_length
        self.received = []

    def reset(self, seed=None, options=None):
        self.secret = int(seed or 0) % self.num_tasks + 1
        self.lo, self.hi, self.t, self.history = 1, 9, 0, []
        self.task = "find the secret number between 1 and 9"
        self.family = "low" if self.secret <= 4 else "high"
        self.obs = self._range()
        return self.obs, {"task": self.task, "family": self.family, "admissible": self.admissible(),
                          "expert_plan": None}

    def _range(self):
        return f"The secret number is between {self.lo} and {self.hi}."

    def admissible(self):
        return [f"guess {n}" for n in range(1, 10)]

    def prompt(self):
        past = "".join(f"\nObservation: {o}\nAction: {a}" for o, a in self.history[-self.history_length:])
        return (f"You are playing a number guessing game.\nYour task is to: {self.task}.\n"
                f"Your last steps:{past or ' none'}\nCurrent observation: {self.obs}\n"
                f"Admissible actions: {', '.join(self.admissible())}\n"
                "Think inside <think> </think>, then give exactly one action inside <action> </action>.")

    def parse(self, text):
        if not text.isascii():
            return ""
        found = re.findall(r"<action>(.*?)</action>", text, flags=re.S)
        action = found[0].strip().lower() if len(found) == 1 else ""
        return action if action in self.admissible() else ""

    def step(self, text):
        self.received.append(text)
        self.t += 1
        action = self.parse(text)
        won = False
        if not action:
            obs = "Invalid action. Reply with <think>...</think><action>guess N</action>. " + self._range()
        else:
            n = int(action.split()[1])
            won = n == self.secret
            if n < self.secret:
                self.lo = max(self.lo, n + 1)
            elif n > self.secret:
                self.hi = min(self.hi, n - 1)
            obs = "Correct!" if won else f"Wrong: {n} is too {'low' if n < self.secret else 'high'}. " + self._range()
        self.history.append((self.obs, action or "(invalid)"))
        self.obs = obs
        reward = self.reward_scale if won else 0.0
        info = {"won": won, "valid": bool(action), "action": action, "admissible": self.admissible()}
        return obs, reward, won, (not won and self.t >= self.max_steps), info

    def expert_action(self):
        return f"guess {(self.lo + self.hi) // 2}"


@pytest.fixture(scope="session")
def model_path():
    return rollout.resolve_model(rollout.EMBEDDED)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def vllm_engine(model_path):
    """The session's one float32 vLLM engine. Tests that change its weights must push them back.
    bm25s (numba, llvmlite) is imported first, as in a training process that uses the skill library or
    the retriever: vLLM's start-up scan used to crash on llvmlite (see rollout.shield_llvmlite)."""
    import bm25s  # noqa: F401
    return rollout.make_engine("vllm", model_path, dtype="float32", seed=0, max_model_len=2048)


@pytest.fixture(scope="session")
def hf_engine(model_path):
    return rollout.make_engine("hf", model_path, dtype="float32", seed=0, max_model_len=2048)


@pytest.fixture(scope="session")
def smol():
    """The embedded model as a plain transformers module in eval mode, and its tokenizer (the
    process runs torch on one thread, set above)."""
    model, tok, _ = rollout.load_model("smollm2-135m")
    return model.eval(), tok


@pytest.fixture
def toy_env_factory():
    return ToyEnv
