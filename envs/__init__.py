"""The paper's benchmarks (Section 4.1) as gymnasium environments with text observations.

Every env follows one small contract, which `rollout.py` and `analyzer.py` rely on:

    env = envs.make(name, **kwargs)       # kwargs: split, data paths, history_length, max_steps, ...
    obs, info = env.reset(seed=task_id)   # the same task_id always gives the same task
    obs, reward, terminated, truncated, info = env.step(raw_model_response)
    env.prompt()                          # the actor prompt for the current turn (a user message)

Attributes: `name`, `task` (the task text), `family` (task family, e.g. "heat" for ALFWorld),
`max_steps`, `reward_scale` (episode reward of a win), `invalid_penalty`, `num_tasks` (how many
distinct task ids the split holds). Class attributes, the env's own switches: `task_line` (the prompt holds one
line starting with it, after which `insert_skill` puts a skill block), `eval_splits` (the held-out splits
seed.py evaluates on), `response_format` ("tags": <think>/<action>; "json": EZPoints' {"thoughts", "action"}),
`observation_in_task_key` (the skill library keys on the task text plus the first observation, where the task
text alone does not tell tasks apart), `defaults` (its column of docs/design-notes.md#defaults: seed.py's and
sft.py's flags for `--env <name>`).
README, "Adding an environment": the steps, with tests/conftest.py's ToyEnv as the template. `info` holds
`won`, `valid` (the env's projection accepted the response), `action` (what the env executed: the projection's
output, also for an invalid response where the authors' projection still passes something on; "" when nothing
was executed), `admissible` (list of actions, when the env has such a list) and, from `reset`, `expert_plan`
where the env can compute one (used by the scripted analyzer of Stage 1).
Validity and what is executed follow each env's projection in the authors' code
(agent_system/environments/env_package/*/projection.py at 2cf2fad): a format rule, not admissibility
(ALFWorld sends an inadmissible command to the game, which answers "Nothing happens."). `step` never
raises on bad text. Rewards: `reward_scale * won` on the step that ends the episode with a win (search
QA: exact match), 0 otherwise; the invalid-action penalty is applied by the trainer (grpo.row_rewards).
"""
import itertools
import math
import re

import numpy as np

NAMES = ("alfworld", "sokoban", "ezpoints", "search", "webshop")


def env_class(name):
    """The class of one environment by name (plain if-chain: the five benchmarks and nothing else; each module
    imported on first use, its heavy packages only when an env is built)."""
    if name == "alfworld":
        from envs.alfworld import AlfWorldEnv
        return AlfWorldEnv
    if name == "sokoban":
        from envs.sokoban import SokobanEnv
        return SokobanEnv
    if name == "ezpoints":
        from envs.ezpoints import EZPointsEnv
        return EZPointsEnv
    if name == "search":
        from envs.search import SearchEnv
        return SearchEnv
    if name == "webshop":
        from envs.webshop import WebShopEnv
        return WebShopEnv
    raise ValueError(f"unknown env {name!r}; choose one of {', '.join(NAMES)}")


def make(name, **kwargs):
    """Build one environment by name."""
    return env_class(name)(**kwargs)


def defaults():
    """{env name: its `defaults`}: the --env columns of seed.py's and sft.py's flags."""
    return {name: dict(env_class(name).defaults) for name in NAMES}


def from_config(cfg, split):
    """The env of a seed.py / sft.py run (cfg.env) on `split`, built from the run's flags."""
    kw = dict(split=split, history_length=cfg.history_length, max_steps=cfg.max_steps)
    if cfg.image:
        kw["image"] = True
    if cfg.env == "alfworld":
        kw["data_dir"] = cfg.data_dir or None
    elif cfg.env == "search":
        kw.update(data=cfg.data_dir or None, retriever_url=cfg.retriever_url)
    elif cfg.env == "webshop":
        kw.update(small=cfg.webshop_small, human_goals=cfg.webshop_human_goals, train_from=cfg.webshop_train_from)
    return make(cfg.env, **kw)


def task_line(name):
    """The prompt-line prefix of the env's task line (insert_skill finds it among TASK_LINES)."""
    return env_class(name).task_line


IMAGE = "<image>"   # image mode (Appendix C.3): where an image goes in a prompt; env.prompt_images() fills them
# The teacher's skill sections, in the authors' format (seed/prompting.py at 2cf2fad): a bold title, an
# instruction line ending in ":", the skill in square brackets; sections are set apart by blank lines.
EPISODE_SKILL = ("Episode-Level Skill", "Refer to this episode-level skill when deciding what action to take in "
                 "the current episode")
STEP_SKILL = ("Critical-Step Skill", "Use this current-step skill for this decision only")
TASK_LINES = (r"^.*\bYour task is to:\s*.*(?:\n|$)", r"^.*\bYour current task is:\s*.*(?:\n|$)",
              r"^.*\bYour task is:\s*.*(?:\n|$)", r"^.*\bYour question:\s*.*(?:\n|$)",
              r"^.*\bYour goal is(?: to)?\b[:\s].*(?:\n|$)")   # the episode section goes after the first found
TURN_LINE = "Now it's your turn"     # opens the turn instruction of every actor prompt
TURN_ANCHORS = (TURN_LINE + " to", TURN_LINE)   # the step section (and the episode one's fallback) goes before


def skill_section(title_and_use, skill):
    """One skill section: "**<title>**", "<instruction>:", "[<skill>]"; "" for an empty skill."""
    body = str(skill or "").strip()
    return f"**{title_and_use[0]}**\n{title_and_use[1]}:\n[{body}]" if body else ""


def _put_at(text, at, block):
    """`block` between text[:at] and text[at:], each side stripped where they meet, blank lines around."""
    before, after = text[:at].rstrip(), text[at:].lstrip()
    return "\n\n".join(part for part in (before, block, after) if part)


def _before_turn(text, block):
    """Before the first turn anchor found; with none, at the end."""
    at = next((text.find(a) for a in TURN_ANCHORS if a in text), len(text))
    return _put_at(text, at, block)


def insert_skill(prompt_text, skill, step_skill=None):
    """The teacher's context h~ as the authors build it (build_augmented_observation_text): the prompt,
    stripped; the episode-skill section right after the task line (the first of TASK_LINES that matches: the
    line, and the next one when the line ends at its colon), failing that before the turn instruction ("Now
    it's your turn ..."), failing both at the end; the step-skill section before the turn instruction (or at
    the end). No skill at all returns the prompt unchanged."""
    episode, step = skill_section(EPISODE_SKILL, skill), skill_section(STEP_SKILL, step_skill)
    if not episode and not step:
        return prompt_text
    text = str(prompt_text).strip()
    if episode:
        m = next((m for m in (re.search(p, text, flags=re.MULTILINE) for p in TASK_LINES) if m), None)
        text = _put_at(text, m.end(), episode) if m else _before_turn(text, episode)
    return _before_turn(text, step) if step else text


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
    for pattern in RESPONSE_SPANS[env_class(env_name).response_format]:
        m = re.search(pattern, text, flags=re.I | re.S)
        lo, hi = m.span(1) if m else (0, 0)
        out.append([s < hi and e > lo and e > s for s, e in spans])
    return out[0], out[1]


# ----------------------------------------------------------------------------- the tasks a run plays

def train_subset(num_tasks, fraction, seed):
    """The training task ids a run draws from (the sample-efficiency study, Table 6): the first
    ceil(fraction * num_tasks) (at least 1) of a permutation seeded by `seed`, sorted; 1 -> every task."""
    perm = np.random.default_rng([seed, 1]).permutation(num_tasks)   # a stream apart from the data order's
    k = max(1, math.ceil(round(fraction * num_tasks, 6)))            # round: 0.6 * 5 is 3.0000000000000004
    return np.sort(perm[:k])


def eval_task_ids(cfg, split, rank, world):
    """This rank's share of the held-out tasks of `split`: the first --eval_tasks (0: all), every world-th."""
    n = from_config(cfg, split).num_tasks
    return list(range(min(cfg.eval_tasks, n) if cfg.eval_tasks else n))[rank::world]
