"""WebShop (Section 4.1; Yao et al. 2022) through the official text environment.

This is an adapter: the shop itself (1.18M scraped Amazon products, 12k human instructions, the
search engine and the reward that scores the bought product against the instruction) is the official
`web_agent_site` package's `WebAgentTextEnv`, used when it and its data are installed:

    git clone https://github.com/princeton-nlp/WebShop && cd WebShop
    ./setup.sh -d small        # or -d all: product data, goals, search index (needs Java for pyserini)
    pip install -e .

Validity and what is executed follow the authors' WebShop projection (env_package/webshop/projection.py
at 2cf2fad), a format rule: the response holds the action tags and a think block and no CJK ideograph.
The lower-cased text inside the action tags (without the tags: the response's last 20 lower-cased
characters) goes to the official env as it is, and the official env decides what it can do with it
(`search[...]` with a non-empty query searches, `click[...]` on a clickable of the page clicks, anything
else leaves the page as it is). The history keeps what was sent. The adapter reports `score` (the
official reward in [0, 1]) and `won` (score == 1). Episode reward = 10 * won, as verl-agent trains it.

The data settings are the authors' (verl/trainer/config/ppo_trainer.yaml:372-374, env_manager.py:1174-1184 and
env_package/webshop/envs.py:141-144 at 2cf2fad), each a flag of seed.py and sft.py: the small catalogue
(`--webshop_small`, their use_small: True: data/items_shuffle_1000.json; --no-webshop_small: items_shuffle.json),
synthetic goals (`--webshop_human_goals`, their human_goals: False), and the splits test = goals [0, 500),
train = [500, end) (`--webshop_train_from 500`; the WebShop paper trains from 1500). valid = [500, 1500) is the
WebShop paper's; with training from 500 it is not held out.
One SimServer (products + search engine) is loaded per process and shared by all adapters; each
adapter has its own session prefix, so a group of envs can play the same goal at once.
"""
import itertools
import os
import re

import gymnasium as gym

import envs

SPLITS = {"test": (0, 500), "valid": (500, 1500), "train": (500, None)}   # goal indices; train's start: train_from
CATALOGUE = {True: "items_shuffle_1000.json", False: "items_shuffle.json"}   # small (1,000 products) or all
INSTALL = ("install the official WebShop environment: git clone https://github.com/princeton-nlp/WebShop; "
           "cd WebShop; ./setup.sh -d small (or -d all); pip install -e .")
_SERVERS = {}                 # (catalogue, num_products, human_goals) -> the official SimServer, loaded once
_IDS = itertools.count()      # session prefixes: one per adapter instance


def official_env(num_products=None, human_goals=False, session_prefix="", small=True):
    """An official WebAgentTextEnv in text mode on the small or the full catalogue (module docstring), sharing
    one SimServer per configuration."""
    try:
        from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
        from web_agent_site.utils import DEFAULT_FILE_PATH
    except ImportError as e:
        raise RuntimeError(f"WebShop needs the `web_agent_site` package ({e}); {INSTALL}") from None
    file_path = os.path.join(os.path.dirname(DEFAULT_FILE_PATH), CATALOGUE[bool(small)])
    if not os.path.exists(file_path):
        raise RuntimeError(f"WebShop product data missing at {file_path}; {INSTALL}"
                           + ("" if small else " (the full catalogue: ./setup.sh -d all)"))
    key = (file_path, num_products, bool(human_goals))
    env = WebAgentTextEnv(observation_mode="text", file_path=file_path, num_products=num_products,
                          human_goals=human_goals, server=_SERVERS.get(key), session_prefix=session_prefix)
    _SERVERS[key] = env.server
    return env


def parse_action(text):
    """Raw response -> (the text sent to the shop, valid), as the authors' projection (module docstring)."""
    action = envs.action_text(text)
    if action is None:
        return envs.as_text(text).lower()[-20:], False
    return action, envs.has_think(text) and not envs.has_cjk(text)


class WebShopEnv(gym.Env):
    """Buy the product that matches the instruction (module docstring). `text_env`: an object with
    the official WebAgentTextEnv interface (reset(session), step(action), get_available_actions(),
    instruction_text, server.goals); built from the installed package when None."""

    name = "webshop"
    reward_scale = 10.0
    invalid_penalty = 0.1
    task_line = "Your task is to:"   # the prompt's task line (envs.insert_skill puts the episode skill after it)
    eval_splits = ("test",)          # held-out splits seed.py evaluates on
    response_format = "tags"         # <think>...</think><action>...</action> (envs.RESPONSE_SPANS)
    observation_in_task_key = False   # the library files a skill under the task text (analyzer.task_key)
    defaults = dict(max_steps=15, history_length=2, max_prompt_tokens=4096, adv_norm="mean_norm",   # the launcher
                    mini_batch_size=64)

    def __init__(self, split="train", max_steps=15, history_length=2, num_products=None,
                 human_goals=False, text_env=None, small=True, train_from=500):
        if split not in SPLITS:
            raise ValueError(f"unknown webshop split {split!r}; choose one of {', '.join(SPLITS)}")
        if train_from < SPLITS["test"][1]:
            raise ValueError(f"webshop train_from {train_from} would train on test goals [0, {SPLITS['test'][1]})")
        self.web = text_env or official_env(num_products, human_goals, f"a{next(_IDS)}-", small)
        lo, hi = (train_from, None) if split == "train" else SPLITS[split]
        self.goal_ids = list(range(lo, min(hi or 10**9, len(self.web.server.goals))))
        if not self.goal_ids:
            raise ValueError(f"WebShop split {split!r} is empty: the server holds "
                             f"{len(self.web.server.goals)} goals")
        self.split, self.max_steps, self.history_length = split, max_steps, history_length
        self.num_tasks = len(self.goal_ids)
        self.task, self.family, self.goal = "", "", None

    # -- gymnasium API
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        task_id = int(seed) if seed is not None else int(self.np_random.integers(self.num_tasks))
        self.task_id = task_id % self.num_tasks
        session = self.goal_ids[self.task_id]
        obs, _ = self.web.reset(session=session)
        self.goal = self.web.server.goals[session]
        self.task = re.sub(r"^\s*instruction:\s*", "", str(self.web.instruction_text), flags=re.I).strip()
        self.family = str(self.goal.get("category") or "webshop")
        self.steps, self.history, self.done, self.clicked = 0, [], False, set()
        self.obs = self._clean(obs)
        info = dict(task=self.task, family=self.family, admissible=self.admissible(),
                    expert_plan=self._ideal_plan(), won=False, valid=True, action="", score=0.0)
        return self.obs, info

    def admissible(self):
        avail = self.web.get_available_actions()
        acts = ["search[<your query>]"] if avail.get("has_search_bar") else []
        return acts + [f"click[{c}]" for c in avail.get("clickables", []) if c != "search"]

    def step(self, text):
        if self.goal is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return "The episode is over; call reset().", 0.0, True, False, dict(
                won=False, valid=False, action="", admissible=[], score=0.0)
        action, valid = parse_action(text)
        clickables = self.web.get_available_actions().get("clickables", [])
        raw, score, terminated, _ = self.web.step(action)
        score = float(score or 0.0)
        obs = self._clean(raw)
        if action.startswith("click[") and action.endswith("]") and action[6:-1] in clickables:
            self.clicked.add(action[6:-1])
        won = bool(terminated and score >= 1.0)
        self.history.append((self.obs, action))
        self.steps += 1
        truncated = not terminated and self.steps >= self.max_steps
        self.done, self.obs = bool(terminated or truncated), obs
        info = dict(won=won, valid=valid, action=action, score=score,
                    admissible=[] if self.done else self.admissible())
        return obs, self.reward_scale if won else 0.0, bool(terminated), truncated, info

    def _clean(self, obs):
        """Drop the page header and instruction that the text observation repeats on every page."""
        parts = [p.strip() for p in str(obs).split("[SEP]")]
        if len(parts) > 3 and parts[0] == "WebShop" and parts[1].lower().startswith("instruction"):
            parts = parts[3:]
        return " [SEP] ".join(p for p in parts if p)

    # -- scripted expert (from the goal record: its product asin and options)
    def _options(self):
        opts = self.goal.get("goal_options") or []
        return [str(o).lower() for o in (opts.values() if isinstance(opts, dict) else opts)]

    def _ideal_plan(self):
        query = self.goal.get("query") or self.task
        asin = str(self.goal.get("asin", "")).lower()
        return [f"search[{query}]", f"click[{asin}]"] + [f"click[{o}]" for o in self._options()] + ["click[buy now]"]

    def expert_action(self):
        """Search the goal's query, open the goal product (paging through results), pick its
        options, buy. None when the product is not reachable from this page."""
        if self.goal is None or self.done:
            return None
        avail = self.web.get_available_actions()
        clickables = avail.get("clickables", [])
        asin = str(self.goal.get("asin", "")).lower()
        if avail.get("has_search_bar"):
            return f"search[{self.goal.get('query') or self.task}]"
        if "buy now" in clickables:
            todo = [o for o in self._options() if o in clickables and o not in self.clicked]
            return f"click[{todo[0]}]" if todo else "click[buy now]"
        if asin in clickables:
            return f"click[{asin}]"
        if "next >" in clickables:
            return "click[next >]"
        return None

    def prompt(self):
        """The authors' WebShop template structure: role and task; at the first step the page, later the
        steps taken, the last `history_length` page/action pairs and the current step and page; the
        available actions; the turn instruction with the format rules."""
        lines = [
            "You are an expert autonomous agent shopping in the WebShop online store.",
            f"{self.task_line} {self.task}",
        ]
        if self.steps == 0:
            lines.append(f"Current page: {self.obs}")
        else:
            lines += envs.history_lines(self.history, self.steps, self.history_length)
            lines.append(f"You are now at step {self.steps + 1}. Current page: {self.obs}")
        lines.append(f"Your admissible actions are: {', '.join(self.admissible())}.")
        lines.append("Now it's your turn to act. First think step by step inside <think> </think> about which "
                     "admissible action best advances the shopping goal, then give exactly one admissible "
                     "action inside <action> </action>, for example <action>search[red cotton t-shirt]"
                     "</action> or <action>click[buy now]</action>.")
        return "\n".join(lines)
