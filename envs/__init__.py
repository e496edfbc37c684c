"""The paper's benchmarks (Section 4.1) as gymnasium environments with text observations.

Every env follows one small contract, which `rollout.py` and `analyzer.py` rely on:

    env = envs.make(name, **kwargs)       # kwargs: split, data paths, history_length, max_steps, ...
    obs, info = env.reset(seed=task_id)   # the same task_id always gives the same task
    obs, reward, terminated, truncated, info = env.step(raw_model_response)
    env.prompt()                          # the actor prompt for the current turn (a user message)

Attributes: `name`, `task` (the task text), `family` (task family, e.g. "heat" for ALFWorld),
`max_steps`, `reward_scale` (episode reward of a win), `invalid_penalty`, `num_tasks` (how many
distinct task ids the split holds). The prompt contains one line starting with `task_line(name)`
(below), after which `insert_skill` puts a skill block. `info` holds `won`, `valid` (the env's
projection accepted the response), `action` (what the env executed: the projection's output, also for
an invalid response where the authors' projection still passes something on; "" when nothing was
executed), `admissible` (list of actions, when the env has such a list) and, from `reset`,
`expert_plan` where the env can compute one (used by the scripted analyzer of Stage 1).
Validity and what is executed follow each env's projection in the authors' code
(agent_system/environments/env_package/*/projection.py at 2cf2fad): a format rule, not admissibility
(ALFWorld sends an inadmissible command to the game, which answers "Nothing happens."). `step` never
raises on bad text. Rewards: `reward_scale * won` on the step that ends the episode with a win (search
QA: exact match), 0 otherwise; the invalid-action penalty is applied by the trainer (grpo.row_rewards).
"""
import itertools
import re

NAMES = ("alfworld", "sokoban", "ezpoints", "search", "webshop")
EVAL_SPLITS = {"alfworld": ("valid_seen", "valid_unseen"), "webshop": ("test",), "search": ("test",),
               "sokoban": ("test",), "ezpoints": ("test",)}   # the held-out splits seed.py evaluates on


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


def from_config(cfg, split):
    """The env of a seed.py / sft.py run (cfg.env) on `split`, built from the run's flags."""
    kw = dict(split=split, history_length=cfg.history_length, max_steps=cfg.max_steps)
    if cfg.image:
        kw["image"] = True
    if cfg.env == "alfworld":
        kw["data_dir"] = cfg.data_dir or None
    elif cfg.env == "search":
        kw.update(data=cfg.data_dir or None, retriever_url=cfg.retriever_url)
    return make(cfg.env, **kw)


def task_line(name):
    """The prompt-line prefix after which `insert_skill` puts the skill block."""
    return {"alfworld": "Your task is to:", "sokoban": "Your task is to:", "ezpoints": "Your task is to:",
            "search": "Your question:", "webshop": "Your task is to:"}[name]


IMAGE = "<image>"   # image mode (Appendix C.3): where an image goes in a prompt; env.prompt_images() fills them
SKILL_HEADER = "## Skill from past episodes"
SKILL_USE = "Use this skill when you choose your action in this episode:"
TURN_LINE = "Now it's your turn"     # opens the turn instruction of every actor prompt


def insert_skill(prompt_text, skill, env_name):
    """Put the skill block (a header line, a line telling the agent to use it, then the skill, which may
    span lines; as the authors' seed/prompting.py) right after the env's task line; when that line is
    absent, right before the turn instruction ("Now it's your turn ..."); failing both, at the top.
    An empty or None skill returns the prompt unchanged."""
    if not skill or not skill.strip():
        return prompt_text
    block = [SKILL_HEADER, SKILL_USE] + [ln.strip() for ln in skill.strip().splitlines() if ln.strip()]
    lines = prompt_text.split("\n")
    prefix = task_line(env_name)
    at = next((i + 1 for i, ln in enumerate(lines) if ln.lstrip().startswith(prefix)), None)
    if at is None:
        at = next((i + 1 for i, ln in enumerate(lines) if prefix in ln), None)
    if at is None:
        at = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(TURN_LINE)), 0)
    return "\n".join(lines[:at] + block + lines[at:])


def history_lines(history, steps, history_length, line="[Observation {k}] {obs}\n[Action {k}] {act}"):
    """The actor prompt's memory block (the authors' memory.fetch): how many steps were taken, then the
    last `history_length` (observation, action) pairs of `history`, each as `line` with its step number
    `k`; [] when there is nothing to show (the first-step form of every prompt)."""
    recent = history[-history_length:] if history_length > 0 else []
    if not recent:
        return []
    first = steps - len(recent) + 1
    return [f"Prior to this step you have taken {steps} step(s). Your last {len(recent)} step(s):"] + [
        line.format(k=first + k, obs=obs, act=act) for k, (obs, act) in enumerate(recent)]


# ----------------------------------------------------------------------------- the authors' projections
# alfworld, sokoban and webshop projection.py share these checks (search and EZPoints have their own).

CJK = re.compile(r"[\u4e00-\u9fff]")   # the authors' test: CJK unified ideographs anywhere in the response


def as_text(response):
    """Any model output as a string: non-text input reads as "" (an invalid response, never an error)."""
    return response if isinstance(response, str) else ""


def action_text(response):
    """The projection's extraction: the text between the first "<action>" and the first "</action>" of
    the lower-cased response, stripped; None when either tag is missing. As in the authors' code (`find`
    of each tag), an end tag that comes before the start tag gives "", and nothing else is checked here."""
    low = as_text(response).lower()
    start, end = low.find("<action>"), low.find("</action>")
    if start == -1 or end == -1:
        return None
    return low[start + len("<action>"):end].strip()


def has_think(response):
    """The projection's think check (on the raw text, case as written): "<think>" and "</think>" present."""
    text = as_text(response)
    return "<think>" in text and "</think>" in text


def has_cjk(response):
    return bool(CJK.search(as_text(response)))


# ----------------------------------------------------------------------------- action and thought tokens

RESPONSE_SPANS = {   # per response format: the action value and the thought value (regex group 1 each)
    "json": (r'"action"\s*:\s*"?([^"}]*)', r'"thoughts"\s*:\s*"((?:[^"\\]|\\.)*)'),   # EZPoints (gym_cards)
    "tags": (r"<action>(.*?)</action>", r"<think>(.*?)</think>"),                       # the other envs
}


def token_spans(tokenizer, ids):
    """Character span [start, end) of each token of `ids` in tokenizer.decode(ids, skip_special_tokens=True)
    (what the env received). Tokens decoded one by one when their pieces add up to the text; else (a
    character split over tokens) from the lengths of decoded prefixes. Special tokens get an empty span."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=True)
    if "".join(pieces) != text:
        pieces, prev = [], 0
        for k in range(len(ids)):
            n = len(tokenizer.decode(ids[:k + 1], skip_special_tokens=True))
            pieces.append(text[prev:max(n, prev)])
            prev = max(n, prev)
    ends = list(itertools.accumulate(len(p) for p in pieces))
    return text, [(e - len(p), e) for p, e in zip(pieces, ends)]


def response_masks(tokenizer, response_ids, env_name):
    """Which tokens of a sampled response carry the action and which the thought, by the env's response format
    (EZPoints: the JSON values of "action" and "thoughts"; the others: inside <action>..</action> and
    <think>..</think>, first occurrence, case-insensitive as the projections read them). A token is in a part
    when its characters overlap the part's value. -> (action [bool], thought [bool]), one per token; all False
    for a part the response does not have (an invalid response has no action tokens)."""
    text, spans = token_spans(tokenizer, list(response_ids))
    out = []
    for pattern in RESPONSE_SPANS["json" if env_name == "ezpoints" else "tags"]:
        m = re.search(pattern, text, flags=re.I | re.S)
        lo, hi = m.span(1) if m else (0, 0)
        out.append([s < hi and e > lo and e > s for s, e in spans])
    return out[0], out[1]
