"""The paper's benchmarks (Section 5.1) as gymnasium environments with text observations.

Every env follows one small contract, which `rollout.py` and `analyzer.py` rely on:

    env = envs.make(name, **kwargs)       # kwargs: split, data paths, history_length, max_steps, ...
    obs, info = env.reset(seed=task_id)   # the same task_id always gives the same task
    obs, reward, terminated, truncated, info = env.step(raw_model_response)
    env.prompt()                          # the actor prompt for the current turn (a user message)

Attributes: `name`, `task` (the task text), `family` (task family, e.g. "heat" for ALFWorld),
`max_steps`, `reward_scale` (episode reward of a win), `invalid_penalty`, `num_tasks` (how many
distinct task ids the split holds). The prompt contains one line starting with `task_line(name)`
(below), after which a skill is inserted. `info` holds `won`, `valid`, `action` (the parsed action, "" when
invalid), `admissible` (list of actions, when the env has such a list) and, from `reset`,
`expert_plan` where the env can compute one (used by the scripted analyzer of Stage 1).
`step` never raises on bad text: the response is then an invalid action with an explanatory
observation. Rewards: `reward_scale * won` on the step that ends the episode with a win (search QA:
exact match), 0 otherwise; the invalid-action penalty is applied by the trainer (grpo.py).
"""

NAMES = ("alfworld", "sokoban", "ezpoints", "search", "webshop")


def make(name, **kwargs):
    """Build one environment by name (plain if-chain: the five benchmarks and nothing else)."""
    if name == "alfworld":
        from envs.alfworld import AlfWorldEnv
        return AlfWorldEnv(**kwargs)
    if name == "sokoban":
        from envs.sokoban import SokobanEnv
        return SokobanEnv(**kwargs)
    if name == "ezpoints":
        from envs.ezpoints import EZPointsEnv
        return EZPointsEnv(**kwargs)
    if name == "search":
        from envs.search import SearchEnv
        return SearchEnv(**kwargs)
    if name == "webshop":
        from envs.webshop import WebShopEnv
        return WebShopEnv(**kwargs)
    raise ValueError(f"unknown env {name!r}; choose one of {', '.join(NAMES)}")


def task_line(name):
    """The prompt-line prefix after which `analyzer.insert_skill` puts the skill block."""
    return {"alfworld": "Your task is to:", "sokoban": "Your task is to:", "ezpoints": "Your task is to:",
            "search": "Your question:", "webshop": "Your task is to:"}[name]


def history_lines(history, steps, history_length, header=None, obs_sep=" "):
    """The actor prompt's memory block: the last `history_length` (observation, action) pairs of
    `history`, numbered by step, after a header line; [] when there is nothing to show."""
    recent = history[-history_length:] if history_length > 0 else []
    if not recent:
        return []
    header = header or f"Your last {len(recent)} observation(s) and action(s):"
    first = steps - len(recent) + 1
    return [f"Prior to this step you have taken {steps} step(s). {header}"] + [
        f"[Observation {first + k}]{obs_sep}{obs}\n[Action {first + k}] {act}" for k, (obs, act) in enumerate(recent)]


def action_text(text):
    """The stripped text inside exactly one <action>...</action>, or None when the tag is missing,
    repeated, unclosed or holds non-ASCII text. Never raises: any model output is fine input."""
    if not isinstance(text, str) or text.count("<action>") != 1 or text.count("</action>") != 1:
        return None
    start, end = text.index("<action>") + len("<action>"), text.index("</action>")
    action = text[start:end].strip() if end >= start else ""
    return action if action and action.isascii() else None
