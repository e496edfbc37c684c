"""ALFWorld (Shridhar et al., 2021) as a text environment (Section 4.1; the env contract in envs/__init__.py).

The game engine is the real `alfworld` package on TextWorld, with the machinery its `AlfredTWEnv`
uses: TextWorld's PDDL environment over a `game.tw-pddl` file (the package's `alfred.pddl` domain,
its `alfred.twl2` grammar with the task sentence filled in, and a PDDL problem), wrapped by the
package's `AlfredDemangler` (readable names such as "cabinet 3"), `AlfredInfos` and `AlfredExpert`
(the hand-coded expert, which follows every executed command and proposes the next one).

Games live in the official layout, `<data>/json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/`
with `game.tw-pddl` and `traj_data.json`: the ones `alfworld-download` fetches, or the ones
`python -m envs.alfworld_gen` writes offline. The data folder is the `data_dir` argument, else
`$ALFWORLD_DATA`, else `data/alfworld` in the repository. Task `i` of a split is game `i % num_tasks`
of its sorted game list; the family comes from the task folder name (pick, look, clean, heat, cool,
pick2), and success per family plus their macro average are the paper's ALFWorld metrics.

The agent answers `<think>...</think><action>...</action>`. Validity is the authors' ALFWorld projection
(agent_system/environments/env_package/alfworld/projection.py at 2cf2fad), a format rule: the response
holds an `<action>` and an `</action>` tag, a `<think>` and a `</think>` tag, and no CJK ideograph.
Admissibility is not checked: the lower-cased text inside the action tags goes to the game as it is, and
the game answers an inadmissible command with "Nothing happens.". A response without the action tags is
invalid and, as theirs, its last 30 lower-cased characters are still sent (almost always "Nothing
happens."). The history keeps what was sent. The trainer subtracts the invalid-action penalty for an
invalid step (grpo.row_rewards). A win gives `reward_scale` and ends the episode; `max_steps` steps
truncate it.
"""
import contextlib
import copy
import functools
import glob
import json
import os
import random
import re
import string
import sys

import gymnasium as gym

import envs

FAMILIES = {  # ALFRED task type (task folder prefix) -> family label used in the metrics
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick2",
}
SPLITS = ("train", "valid_seen", "valid_unseen")
PACKAGE_CACHE = os.path.expanduser("~/.cache/alfworld")   # importing alfworld sets $ALFWORLD_DATA to this
REPO_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "alfworld")
HOW_TO_GET_GAMES = (
    "generate games offline with\n"
    "    python -m envs.alfworld_gen --out data/alfworld --train 60 --valid_seen 12 --valid_unseen 12 --seed 0\n"
    "or download the official ones with `alfworld-download` (then point ALFWORLD_DATA or --data_dir at them)")


# ----------------------------------------------------------------------------- game files

def find_data_dir(data_dir=None):
    """The folder that holds `json_2.1.1/`: the argument, else $ALFWORLD_DATA, else data/alfworld.
    An $ALFWORLD_DATA set on purpose must hold games (no silent fallback); the package's own default,
    which importing alfworld puts there, is only tried."""
    env_dir = os.environ.get("ALFWORLD_DATA")
    if data_dir is None and env_dir and os.path.abspath(env_dir) != PACKAGE_CACHE:
        data_dir = env_dir
    tried = [data_dir] if data_dir is not None else [d for d in (env_dir, REPO_DATA) if d]
    for d in tried:
        if os.path.isdir(os.path.join(d, "json_2.1.1")):
            return os.path.abspath(d)
    raise FileNotFoundError(f"no ALFWorld games: no json_2.1.1/ folder in {' or '.join(tried)}; {HOW_TO_GET_GAMES}")


def family_of(game_path):
    """'.../pick_heat_then_place_in_recep-Potato-None-SinkBasin-14/trial_x/game.tw-pddl' -> 'heat'."""
    task_folder = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(game_path))))
    return FAMILIES.get(task_folder.split("-")[0], "unknown")


@functools.lru_cache(maxsize=16)
def list_games(data_dir, split):
    """Sorted playable game files of a split (as AlfredTWEnv: six task types, no movable/sliced
    variants, a traj_data.json beside each game, games marked unsolvable left out)."""
    if split not in SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r}; choose one of {', '.join(SPLITS)}")
    games = []
    for path in sorted(glob.glob(os.path.join(data_dir, "json_2.1.1", split, "*", "*", "game.tw-pddl"))):
        if family_of(path) == "unknown" or "movable" in path or "Sliced" in path:
            continue
        if not os.path.exists(os.path.join(os.path.dirname(path), "traj_data.json")):
            continue
        with open(path) as f:
            if '"solvable": false' in f.read():          # marked unsolvable by alfworld-generate
                continue
        games.append(path)
    if not games:
        raise FileNotFoundError(f"no playable games in {os.path.join(data_dir, 'json_2.1.1', split)}; {HOW_TO_GET_GAMES}")
    return tuple(games)


@functools.lru_cache(maxsize=256)
def read_game(path):
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- the TextWorld engine

@functools.lru_cache(maxsize=64)
def _translate(domain, problem, verbose=False):
    """TextWorld's PDDL -> SAS translation (fast_downward.pddl2sas), memoized: it is a pure function
    of the text, and a load + reset would otherwise translate the same game four times. The
    translator overwrites sys.argv; it is restored."""
    argv = list(sys.argv)
    try:
        return _FD_PDDL2SAS(domain, problem, verbose=verbose)
    finally:
        sys.argv[:] = argv


def _fast_pddl2sas(domain, problem, verbose=False, optimize=False):
    """Stands in for fast_downward.pddl2sas. The second, "optimized" translation TextWorld makes only
    feeds the planner expert (`policy_commands`), which this engine never asks for: the plain one
    serves both (half the cost of a reset)."""
    return _translate(domain, problem, verbose)


def clear_caches():
    """Forget cached game files, grammars and translations (for a process that rewrites game files)."""
    for cache in (read_game, _game_logic, _translate, expert_plan_of, list_games):
        cache.cache_clear()


@functools.lru_cache(maxsize=64)
def _game_logic(path):
    """Parsed grammar and action templates of a game (read-only once built; shared by instances)."""
    data = read_game(path)
    return _pddl_logic.GameLogic(domain=data["pddl_domain"], grammar=data["grammar"])


def _speed_up_textgen():
    """TextWorld's text generator re-parses the same few grammar snippets with TatSu for every
    admissible command at every step and deep-copies its derivation context (entity records that
    nothing modifies) at every node: about 90% of a step. Memoize the parses (each caller still gets
    its own copy) and copy the context's two dicts shallowly. Observations and admissible commands
    are unchanged (tests/test_alfworld.py compares transcripts with SEED_ALFWORLD_PLAIN=1, which
    turns this off)."""
    from textworld.envs.pddl import textgen
    from textworld.logic import Rule
    parse = functools.lru_cache(maxsize=4096)(textgen._parse_and_convert)
    textgen._parse_and_convert = lambda *args, **kwargs: copy.deepcopy(parse(*args, **kwargs))
    query = functools.lru_cache(maxsize=4096)(Rule.parse_conjunctive_query)
    Rule.parse_conjunctive_query = classmethod(lambda cls, expr: query(expr))
    textgen.copy_context = lambda c: {**c, "variables": dict(c["variables"]), "mapping": dict(c["mapping"])}


def _import_engine():
    """Import TextWorld/alfworld lazily (a few seconds) and install the caches above, once."""
    global _FD_PDDL2SAS, _pddl_logic, PddlEnv
    if "_FD_PDDL2SAS" in globals():
        return
    import fast_downward
    from textworld.envs import PddlEnv
    from textworld.envs.pddl import logic as _pddl_logic
    _FD_PDDL2SAS = fast_downward.pddl2sas
    fast_downward.pddl2sas = _fast_pddl2sas
    if not os.environ.get("SEED_ALFWORLD_PLAIN"):
        _speed_up_textgen()


def make_engine():
    """The package's wrapper chain: PddlEnv -> AlfredDemangler -> AlfredInfos -> AlfredExpert."""
    _import_engine()
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos

    class CachedPddlEnv(PddlEnv):
        """TextWorld's PddlEnv whose `load` takes the game text and parsed grammar from the caches."""

        def load(self, path):
            self._game_file, self._game_data = path, read_game(path)
            self.walkthrough = self._game_data.get("walkthrough")
            self._logic = _game_logic(path)
            self._pddl_state = _pddl_logic.PddlState(self.downward_lib, self._game_data["pddl_problem"], self._logic)
            self._entity_infos = self._get_entity_infos()

    class Expert(AlfredExpert):
        """The package's AlfredExpert. Its hand-coded expert notices a placement by the verb "put"
        ("put X in/on Y"), which alfworld 0.4.0 renamed to "move X to Y"; without being told the old
        wording it believes it still holds the object and stalls after the first of two placements
        (pick2). So the expert (only the expert; the game sees the real command) is told the old wording."""

        def step(self, command):
            self.state, reward, done = textworld.core.Wrapper.step(self, command)
            self.prev_command = re.sub(r"^move (.+) to (.+)$", r"put \1 in/on \2", str(command))
            self._gather_infos()
            return self.state, reward, done

    infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=True, extras=["gamefile", "expert_plan"])
    env = AlfredInfos(AlfredDemangler(CachedPddlEnv(infos), shuffle=False))
    return Expert(env, expert_type="handcoded")


@contextlib.contextmanager
def _expert_rng(step):
    """The hand-coded expert draws from the global `random`; fix it per step (so plans are
    reproducible) and give the caller's random state back afterwards."""
    saved = random.getstate()
    random.seed(1000 + step)
    try:
        yield
    finally:
        random.setstate(saved)


def engine_reset(engine, path):
    """Start a game from its initial state (loading it first unless it is the one already loaded)."""
    with _expert_rng(0):
        if getattr(engine, "gamefile", None) != path:
            engine.load(path)
        return engine.reset()


def engine_step(engine, command, step):
    """Apply one command (the game answers an inadmissible one with "Nothing happens."). The expert runs after the game moved; when it gives up
    (its own exceptions) the game state stands and the expert is reported as unavailable."""
    with _expert_rng(step):
        try:
            state, _, _ = engine.step(command)
            return state, True
        except Exception:
            state = engine.state
            state["extra.expert_plan"] = []
            return state, False


def play_expert(path, max_steps=50, engine=None):
    """Play the hand-coded expert from the start of a game; its plan if it wins within max_steps."""
    global _PLANNING_ENGINE
    if engine is None:
        _PLANNING_ENGINE = engine = _PLANNING_ENGINE or make_engine()
    state, plan = engine_reset(engine, path), []
    while not state["won"] and len(plan) < max_steps:
        proposal = state["extra.expert_plan"]
        if not proposal or proposal[0] not in state["admissible_commands"]:
            return None
        plan.append(proposal[0])
        state, ok = engine_step(engine, proposal[0], len(plan))
        if not ok and not state["won"]:
            return None
    return plan if state["won"] else None


_PLANNING_ENGINE = None   # one engine (one planner-library copy) for plans of games that store none


@functools.lru_cache(maxsize=1024)
def expert_plan_of(path):
    """The expert's plan from the start: stored in the game file (`walkthrough`) or played once."""
    stored = read_game(path).get("walkthrough")
    return tuple(stored) if stored else tuple(play_expert(path) or ())


# ----------------------------------------------------------------------------- response parsing

def parse_action(response):
    """Raw model response -> (the command sent to the game, valid), as the authors' projection: the text
    inside the action tags (valid when a think block is there too and no CJK text), else the last 30
    lower-cased characters of the response (invalid). Never raises."""
    action = envs.action_text(response)
    if action is None:
        return envs.as_text(response).lower()[-30:], False
    return action, envs.has_think(response) and not envs.has_cjk(response)


# ----------------------------------------------------------------------------- the environment

class AlfWorldEnv(gym.Env):
    """One ALFWorld household game at a time, text in and text out (see the module docstring)."""

    name = "alfworld"
    reward_scale = 10.0      # episode reward of a win
    invalid_penalty = 0.1    # subtracted per invalid step by the trainer (grpo.row_rewards)
    task_line = "Your task is to:"   # the prompt's task line (envs.insert_skill puts the episode skill after it)
    eval_splits = ("valid_seen", "valid_unseen")   # held-out splits seed.py evaluates on
    response_format = "tags"         # <think>...</think><action>...</action> (envs.RESPONSE_SPANS)
    observation_in_task_key = False   # the library files a skill under the task text (analyzer.task_key)
    defaults = dict()                # seed.Config's and sft.SFTConfig's defaults are ALFWorld's

    def __init__(self, data_dir=None, split="train", history_length=5, max_steps=30):
        if max_steps < 1 or history_length < 0:
            raise ValueError(f"need max_steps >= 1 and history_length >= 0 (got {max_steps}, {history_length})")
        self.data_dir = find_data_dir(data_dir)
        self.split = split
        self.games = list_games(self.data_dir, split)
        self.num_tasks = len(self.games)
        self.history_length = history_length
        self.max_steps = max_steps
        self.observation_space = gym.spaces.Text(max_length=1_000_000, charset=string.printable)
        self.action_space = gym.spaces.Text(max_length=1_000_000, charset=string.printable)
        self._engine, self._expert_ok = None, False
        self.task, self.family, self.task_id, self.game = "", "", None, None
        self._state = None

    # -- gymnasium API

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        task_id = int(seed) if seed is not None else int(self.np_random.integers(self.num_tasks))
        self.task_id, self.game = task_id, self.games[task_id % self.num_tasks]
        if self._engine is None:
            self._engine = make_engine()
        self._state = engine_reset(self._engine, self.game)
        self._expert_ok = True
        self.obs = self._state["feedback"]
        self.task = self.obs.split("Your task is to: ", 1)[-1].strip() if "Your task is to: " in self.obs else ""
        self.family = family_of(self.game)
        self.history, self.steps, self.won, self.done = [], 0, False, False
        return self.obs, self._info(valid=True, action="", expert_plan=list(expert_plan_of(self.game)),
                                    hidden=bool(read_game(self.game).get("hidden")))

    def step(self, action):
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return self.obs, 0.0, self.won, not self.won, self._info(valid=False, action="")
        command, valid = parse_action(action)
        self.history.append((self.obs, command))
        self.steps += 1
        self._state, ok = engine_step(self._engine, command, self.steps)
        self._expert_ok = self._expert_ok and ok
        self.obs = self._state["feedback"]
        self.won = bool(self._state["won"])
        terminated = self.won
        truncated = not terminated and self.steps >= self.max_steps
        self.done = terminated or truncated
        reward = self.reward_scale if self.won else 0.0
        return self.obs, reward, terminated, truncated, self._info(valid=valid, action=command)

    def close(self):
        """Drop the engine. (Its copy of the planner library stays loaded until the process ends:
        unloading it with dlclose is not safe.)"""
        self._engine, self._state = None, None

    # -- contract extras

    @property
    def admissible(self):
        return [c for c in self._state["admissible_commands"] if c != "help"] if self._state else []

    def expert_action(self):
        """The hand-coded expert's next command here (None once it has given up or the game is over)."""
        if self._state is None or self.done or not self._expert_ok:
            return None
        proposal = self._state.get("extra.expert_plan") or []
        return proposal[0] if proposal and proposal[0] in self.admissible else None

    def prompt(self):
        """The actor's user message, in the structure of the authors' ALFWorld templates: at the first step
        the observation (which states the task on its own line) and the admissible actions; later the task,
        the steps taken and the last `history_length` observation/action pairs, the current step and
        observation, the admissible actions; always closed by the turn instruction with the format rules."""
        lines = ["You are an expert agent acting in ALFWorld, a text-based simulation of a household."]
        if self.steps == 0:
            lines.append(f"Current observation: {_first_observation(self.obs)}")
        else:
            lines.append(f"{self.task_line} {self.task}")
            lines += envs.history_lines([(_without_task(o), a) for o, a in self.history], self.steps,
                                        self.history_length)
            lines.append(f"You are now at step {self.steps + 1}. Current observation: {_without_task(self.obs)}")
        lines.append("Admissible actions: " + ", ".join(f'"{a}"' for a in self.admissible))
        lines.append("Now it's your turn to act. First reason step by step about the situation inside "
                     "<think> </think>. Then choose one admissible action for this step and write it "
                     "inside <action> </action>.")
        return "\n".join(lines)

    def _info(self, valid, action, **extra):
        return {"task": self.task, "family": self.family, "task_id": self.task_id, "game": self.game,
                "admissible": self.admissible, "won": self.won, "valid": valid, "action": action,
                "steps": self.steps, **extra}


def _first_observation(obs):
    """The game's first text without its banner, blank lines squeezed: the task sentence keeps its own line."""
    obs = obs.replace("-= Welcome to TextWorld, ALFRED! =-", "")
    return "\n".join(" ".join(ln.split()) for ln in obs.splitlines() if ln.strip())


def _without_task(obs):
    """The intro text minus its banner and task sentence (the prompt states the task once, on its own line)."""
    obs = obs.replace("-= Welcome to TextWorld, ALFRED! =-", "")
    return " ".join(obs.split("Your task is to: ", 1)[0].split())
