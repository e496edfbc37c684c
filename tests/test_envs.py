"""Tests for the Sokoban, EZPoints, Search QA (with the BM25 retriever server) and WebShop envs
(docs/design-notes.md#environments): experts win, each env's validity rule is the authors' projection (one test per env),
hostile text never raises, prompts carry the skill-insertion task line, seeds fix tasks, and the retriever
protocol works on 127.0.0.1."""
import ast
import dataclasses
import json
import re
import socket
import time
import urllib.error
import urllib.request
from fractions import Fraction
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest

import envs
from envs import ezpoints, retriever, search, sokoban, webshop

HOSTILE = [
    "",
    "x" * 10_000,
    "<action>" + "up" * 5_000 + "</action>",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0 \U0001F600 \u0000 \ufeff",
    "<action>\u4e0a</action>",
    "<think>\u601d\u8003</think><action>\uff55\uff50</action>",
    "__import__('os').system('echo pwned')",
    "<action>__import__('os').system('echo pwned')</action>",
    "<action>eval('1+1')</action>",
    "<action><action>up</action></action>",
    "<action>up</action><action>down</action>",
    "<action>up",
    "up</action>",
    "</action>up<action>",
    "<search><answer>x</answer></search>",
    "<search>a</search><answer>b</answer>",
    "<answer></answer>",
    "<search>   </search>",
    "<answer>" + "a" * 5_000 + "</answer>",
    "<think>unclosed <action>",
    None,
]


NO_FORMAT = ["", "x" * 10_000, None, 42, "__import__('os').system('echo pwned')",
             "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0 \U0001F600 \u0000 \ufeff"]   # invalid in every env


def assert_survives_hostile(env, seed=0):
    """Any text is handled by the env's projection: a result, never an exception; text with no format at
    all is invalid everywhere."""
    for text in HOSTILE + NO_FORMAT:
        env.reset(seed=seed)
        obs, reward, terminated, truncated, info = env.step(text)
        assert isinstance(obs, str) and isinstance(info["valid"], bool) and isinstance(info["action"], str)
        assert info["valid"] is False or text not in NO_FORMAT, repr(text)[:80]


def assert_class_switches(cls):
    """The per-env switches every env class carries (README, "Adding an environment")."""
    import seed
    fields = {f.name for f in dataclasses.fields(seed.Config)}
    assert isinstance(cls.task_line, str) and cls.task_line.endswith(":")
    assert cls.eval_splits and all(isinstance(x, str) for x in cls.eval_splits)
    assert cls.response_format in envs.RESPONSE_SPANS and isinstance(cls.observation_in_task_key, bool)
    assert isinstance(cls.defaults, dict) and set(cls.defaults) <= fields, set(cls.defaults) - fields


def test_every_env_class_and_the_template_carry_their_switches(toy_env_factory):
    for name in envs.NAMES:
        assert_class_switches(envs.env_class(name))
    assert_class_switches(toy_env_factory)
    assert envs.env_class("alfworld").eval_splits == ("valid_seen", "valid_unseen")
    assert envs.env_class("ezpoints").response_format == "json" and envs.task_line("search") == "Your question:"


def assert_contract(env, name):
    assert env.name == name and isinstance(env, gym.Env)
    for attr in ("task", "family", "max_steps", "reward_scale", "invalid_penalty", "num_tasks"):
        assert hasattr(env, attr), attr
    assert_class_switches(type(env))
    obs, info = env.reset(seed=1)
    assert isinstance(obs, str) and {"task", "family", "admissible", "expert_plan"} <= set(info)
    assert env.task and info["task"] == env.task
    lines = env.prompt().splitlines()
    task_lines = [ln for ln in lines if ln.startswith(envs.task_line(name))]
    assert len(task_lines) == 1 and env.task in task_lines[0]


def play_expert(env, seed, wrap=lambda a: f"<think>plan</think><action>{a}</action>"):
    """The env's expert to the end, each move wrapped in the env's response format."""
    obs, info = env.reset(seed=seed)
    total, steps = 0.0, 0
    while True:
        action = env.expert_action()
        assert action is not None
        obs, reward, terminated, truncated, info = env.step(wrap(action))
        assert info["valid"], (action, obs)
        total, steps = total + reward, steps + 1
        if terminated or truncated:
            return info["won"], total, steps


def test_no_eval_or_exec_in_env_modules():
    for mod in (sokoban, ezpoints, search, retriever, webshop):
        tree = ast.parse(open(mod.__file__).read())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not calls & {"eval", "exec", "compile"}, mod.__name__


# ----------------------------------------------------------------------------- Sokoban

def test_sokoban_rooms_solvable_across_seeds():
    lengths = []
    for split, n in (("train", 300), ("test", 60)):
        for i in range(n):
            room = sokoban.generate_room(sokoban.SPLIT_SEED[split] + i)
            walls = room["walls"]
            assert walls.shape == (6, 6) and (walls[[0, -1], :] == 0).all() and (walls[:, [0, -1]] == 0).all()
            assert room["box"] != room["target"] and room["player"] != room["box"]
            plan = sokoban.solve(walls, room["player"], room["box"], room["target"])
            assert plan is not None and len(plan) == len(room["plan"]) <= 15
            lengths.append(len(plan))
    assert max(lengths) >= 5   # reverse play yields rooms that need real pushing, not only one-step rooms


def test_sokoban_expert_wins_and_seed_fixes_room():
    env = envs.make("sokoban", split="train", history_length=2, max_steps=15)
    assert_contract(env, "sokoban")
    for seed in range(20):
        won, total, steps = play_expert(env, seed)
        assert won and total == env.reward_scale == 10.0
    a, _ = env.reset(seed=7)
    b, _ = envs.make("sokoban").reset(seed=7)
    assert a == b
    assert env.reset(seed=7 + env.num_tasks)[0] == a        # ids wrap around
    rooms = {envs.make("sokoban").reset(seed=s)[0] for s in range(30)}
    assert len(rooms) > 25
    test_rooms = {envs.make("sokoban", split="test").reset(seed=s)[0] for s in range(30)}
    assert rooms != test_rooms


def test_sokoban_rules_hostile_truncation_and_image():
    env = sokoban.SokobanEnv(image=True)
    obs, info = env.reset(seed=3)
    assert info["image"].dtype == np.uint8 and info["image"].shape == (96, 96, 3)
    assert "Colours in the image" in env.prompt() and "up, down, left, right" in env.prompt()
    assert env.prompt().count("<image>") == 1 and (env.prompt_images()[0] == info["image"]).all()
    assert_survives_hostile(env, seed=3)
    env.reset(seed=3)
    for i in range(15):
        obs, reward, terminated, truncated, info = env.step("no tags here")
        assert not terminated and truncated == (i == 14)
    # a box pushed into a corner is a dead end: the solver says so and the expert gives up
    walls = np.zeros((5, 5), dtype=int)
    walls[1:4, 1:4] = 1
    assert sokoban.solve(walls, (2, 2), (1, 1), (3, 3)) is None
    assert sokoban.solve(walls, (2, 1), (2, 2), (2, 3)) == ["right"]


def test_sokoban_history_in_prompt():
    env = sokoban.SokobanEnv(history_length=2)
    env.reset(seed=0)
    first = env.prompt()
    assert "Current observation:" in first and "Prior to this step" not in first and "[Action" not in first
    for a in ["<think>t</think><action>up</action>", "bad", "<think>t</think><action>left</action>"]:
        env.step(a)
    p = env.prompt()
    assert "Prior to this step you have taken 3 step(s)." in p and "You are now at step 4." in p
    assert "[Action 2] still" in p and "[Action 3] left" in p and "[Action 1]" not in p
    assert p.splitlines()[-1].startswith("Now it's your turn") and "<think>" in p.splitlines()[-1]


def test_sokoban_projection_rule():
    """The authors' sokoban_projection (projection.py:22-86 at 2cf2fad): the first of up, down, left, right,
    still inside the action tags is the move; valid with a think block; otherwise "still" (stay), invalid.
    No CJK rule here."""
    env = sokoban.SokobanEnv()
    cases = [("<think>t</think><action>Move UP now</action>", "up", True),
             ("<think>t</think><action>upleft</action>", "up", True),         # lookup order up, down, left, right
             ("<think>t</think><action>left or right</action>", "left", True),
             ("<think>t</think><action>still</action>", "still", True),
             ("<think>\u5411\u5de6</think><action>left</action>", "left", True),
             ("<action>left</action>", "left", False),                         # no think: invalid, still moved
             ("<think>t</think><action>jump</action>", "still", False),
             ("<think>t</think><action>\u4e0a</action>", "still", False),
             ("<think>t</think>left", "still", False), ("<think>t</think></action>up<action>", "still", False)]
    for text, move, valid in cases:
        env.reset(seed=0)
        start = (env.player, env.box)
        expected = sokoban.SokobanEnv(); expected.reset(seed=0)
        if move != "still":
            expected._move(move)
        obs, _, _, _, info = env.step(text)
        assert (info["action"], info["valid"]) == (move, valid), text
        assert (env.player, env.box) == (expected.player, expected.box) and obs == expected._grid()
        assert env.history == [(sokoban.render_text(env.room["walls"], env.room["target"], start[1], start[0]), move)]


# ----------------------------------------------------------------------------- EZPoints

def test_ezpoints_parser():
    ev = ezpoints.evaluate
    assert ev("2 + 3 * 4".split()) == 14
    assert ev("8 - 2 - 3".split()) == 3
    assert ev("10 / 4 * 2".split()) == 5
    assert ev("3 / 2".split()) == Fraction(3, 2)
    assert ev("24 / 2".split()) == 12 and ev(["7"]) == 7
    for bad in ["", "+", "2 +", "2 2", "* 3", "x", "2 ** 3", "2 + ( 3 )", "__import__", "1 / 0", "\u0662 + 1"]:
        with pytest.raises(ezpoints.ParseError):
            ev(bad.split())


def test_ezpoints_solver_and_deals():
    assert ezpoints.solutions([3, 4]) == [["3", "*", "4"], ["4", "*", "3"]]
    assert ezpoints.solutions([1, 1]) == [] and ezpoints.solutions([7, 7]) == []
    values = {tuple(sorted(ezpoints.RANK_VALUE[c[0]] for c in t)) for t in ezpoints.TASKS}
    assert values == {(2, 10), (3, 9), (4, 8), (5, 7), (6, 6), (2, 6), (3, 4)}
    assert all(ezpoints.solutions([ezpoints.RANK_VALUE[a[0]], ezpoints.RANK_VALUE[b[0]]])
               for a, b in ezpoints.TASKS)


def ez(token):
    """An EZPoints response in the authors' JSON format."""
    return json.dumps({"thoughts": "one step at a time", "action": token})


def test_ezpoints_expert_rules_and_hostile():
    env = envs.make("ezpoints", max_steps=5, history_length=2)
    assert_contract(env, "ezpoints")
    for seed in range(0, env.num_tasks, 7):
        won, total, steps = play_expert(env, seed, wrap=ez)
        assert won and total == 10.0 and steps == 4
    assert env.reset(seed=11)[0] == envs.make("ezpoints").reset(seed=11)[0]
    assert_survives_hostile(env)
    # wrong formula: ends the episode without a win
    env.reset(seed=0)
    a, b = env.values
    for tok in [str(a), "*" if a + b == 12 else "+", str(b), "="]:
        obs, reward, terminated, truncated, info = env.step(ez(tok))
    assert terminated and not info["won"] and reward == 0.0 and "Wrong" in obs
    # a card used twice is a valid token the formula does not take; '=' before both cards is a loss
    env.reset(seed=0)
    env.step(ez(str(a)))
    if a != b:
        info = env.step(ez(str(a)))[4]
        assert info["valid"] and env.formula == [str(a)]
    obs, reward, terminated, _, info = env.step(ez("="))
    assert terminated and reward == 0.0 and "exactly once" in obs
    # running out of steps truncates
    env.reset(seed=0)
    for i in range(5):
        *_, terminated, truncated, _ = env.step(ez("+"))
    assert truncated and not terminated


def test_ezpoints_projection_rule():
    """The authors' gym_projection for EZPoints (gym_cards/projection.py:20-64 at 2cf2fad): from `"action":`
    on (else the last character) exactly one of 1-10, +, *, = must occur; an invalid answer executes
    nothing (their action -1); their prompt shows no history."""
    env = envs.make("ezpoints")
    env.reset(seed=0)
    a, b = env.values
    other = next(str(v) for v in range(2, 10) if v not in (a, b))
    cases = [(ez(str(a)), str(a), True, [str(a)]),
             ('{"thoughts": "3 or 4 or 10?", "action": "%d"}' % a, str(a), True, [str(a)]),   # thoughts before: cut
             ('{"action": "%d", "thoughts": "not %s"}' % (a, other), "", False, []),          # two tokens after the key
             (ez("10"), "10", True, ["10"] if 10 in (a, b) else []),
             (ez(other), other, True, []),                   # valid token, not a card value: formula unchanged
             (ez("-"), "", False, []), (ez("/"), "", False, []),                               # not their operators
             (f"<think>t</think><action>{a}</action>", "", False, []),                        # last char '>'
             (f"I pick {a}", str(a), True, [str(a)]),                                          # no key: the last char
             ('{"action": "' + "\u4e09" + '"}', "", False, [])]
    for text, token, valid, formula in cases:
        env.reset(seed=0)
        obs, reward, terminated, _, info = env.step(text)
        assert (info["action"], info["valid"], env.formula) == (token, valid, formula), text
        assert not terminated and reward == 0.0 and env.steps == 1
    env.step(ez("+"))
    assert "Prior to this step" not in env.prompt() and '"action"' in env.prompt()


# ----------------------------------------------------------------------------- Search QA

@pytest.fixture(scope="module")
def server():
    srv, url = retriever.start_background(search.DATA_DIR + "/corpus.jsonl")
    yield url
    srv.shutdown()
    srv.server_close()


def post(url, payload, raw=None):
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def test_retriever_protocol(server):
    assert server.startswith("http://127.0.0.1:")
    out = post(server, {"query": "capital of Australia", "topk": 3, "return_scores": True})
    (hits,) = out["result"]
    assert len(hits) == 3
    assert hits[0]["document"]["contents"].split("\n")[0] in {"Australia", "Canberra"}
    assert all(isinstance(h["score"], float) for h in hits)
    assert hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]
    batch = post(server, {"queries": ["Mount Everest height", "penicillin"], "topk": 2, "return_scores": False})
    assert len(batch["result"]) == 2 and "contents" in batch["result"][1][0]
    assert "Fleming" in batch["result"][1][0]["contents"]
    for bad in [b"not json", b"[]", b'{"topk": 3}', b'{"query": "x", "topk": 0}', b'{"queries": [1]}']:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, None, raw=bad)
        assert e.value.code == 400
    health = json.loads(urllib.request.urlopen(server.replace("/retrieve", "/health"), timeout=5).read())
    assert health["documents"] == 229


def test_exact_match_normalization():
    em = search.exact_match
    assert em("The Eiffel Tower!", ["eiffel tower"]) == 1.0
    assert em("  canberra ", ["Sydney", "Canberra"]) == 1.0
    assert em("an  apple", ["Apple"]) == 1.0
    assert em("Paris, France", ["Paris"]) == 0.0
    assert em("", ["Paris"]) == 0.0


def test_search_env_end_to_end(server):
    env = envs.make("search", retriever_url=server, split="train", history_length=4, max_steps=4)
    assert_contract(env, "search")
    assert env.reward_scale == 1.0 and env.invalid_penalty == 0.01 and env.num_tasks == 45
    for seed in range(0, 45, 5):
        won, total, steps = play_expert(env, seed, wrap=lambda a: "<think>x</think>" + a)
        assert won and total == 1.0 and steps == 2
    assert env.reset(seed=0)[1]["task"] == "What is the capital of Australia?"
    assert envs.make("search", retriever_url=server, split="test").reset(seed=0)[1]["task"] != env.task
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("<think>hm</think><search> capital of Australia </search>")
    assert obs.startswith("<information>") and "Canberra" in obs and not terminated and info["valid"]
    assert "<information>" in env.prompt()
    obs, reward, terminated, _, info = env.step("<answer> the CANBERRA. </answer>")
    assert reward == 1.0 and terminated and info["won"]
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("<answer>Sydney</answer>")
    assert reward == 0.0 and terminated and not info["won"] and info["valid"]
    assert_survives_hostile(env)
    env.reset(seed=0)
    for i in range(4):
        *_, terminated, truncated, _ = env.step("<search>kangaroo</search>")
    assert truncated and not terminated


def test_search_projection_rule(server):
    """The authors' search_projection (search/projection.py:34-88 at 2cf2fad): the first search block, else
    the first answer block, is executed; invalid when there is none, or both tags, or a tag twice (the
    block found still runs); no think rule. No block: nothing is executed and no information comes back."""
    env = envs.make("search", retriever_url=server)
    cases = [("<search>capital of Australia</search>", "<search>capital of Australia</search>", True, False),
             ("<SEARCH> capital of Australia </SEARCH>", "<search>capital of Australia</search>", True, False),
             ("<search>capital of Australia</search><answer>Sydney</answer>", "<search>capital of Australia</search>", False, False),
             ("<search>capital of Australia</search> <search>koala</search>", "<search>capital of Australia</search>", False, False),
             ("<answer>Canberra</answer><answer>Sydney</answer>", "<answer>Canberra</answer>", False, True),
             ("<think>hm</think><answer>Canberra</answer>", "<answer>Canberra</answer>", True, True),
             ("<search>   </search>", "<search></search>", True, False),
             ("I would search for the capital.", "", False, False), ("<search>unclosed", "", False, False)]
    for text, action, valid, ends in cases:
        env.reset(seed=0)
        obs, reward, terminated, _, info = env.step(text)
        assert (info["action"], info["valid"], terminated) == (action, valid, ends), text
        assert obs.startswith("<information>") == action.startswith("<search>") and (obs == "") == (action == "")
        assert reward == (1.0 if action == "<answer>Canberra</answer>" else 0.0)
        assert env.history == [(obs, action)]
    env.reset(seed=0)
    first = env.prompt()
    env.step("<search>capital of Australia</search>")
    later = env.prompt()
    assert "Prior to this step" not in first and "[Step 1] <search>capital of Australia</search>" in later
    assert "Prior to this step you have taken 1 step(s)." in later and "Canberra" in later


def test_dead_retriever_reports_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()                                   # nothing listens there now
    url = f"http://127.0.0.1:{port}/retrieve"
    t0 = time.perf_counter()
    with pytest.raises(search.RetrieverError, match=re.escape(url) + ".*3 attempts"):
        search.retrieve(url, "anything", timeout=0.5, retries=2, backoff=0.01)
    assert time.perf_counter() - t0 < 5
    env = search.SearchEnv(retriever_url=url, retries=1, backoff=0.01, timeout=0.5)
    env.reset(seed=0)
    with pytest.raises(search.RetrieverError, match=re.escape(url)):
        env.step("<search>q</search>")


def test_search_data_loaders(tmp_path):
    rows = [{"id": "train_0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"],
             "data_source": "nq", "prompt": [{"role": "user", "content": "... Question: who wrote hamlet?\n"}],
             "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
             "extra_info": {"split": "train", "index": 0}}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ex = search.load_examples(str(tmp_path), "train")
    assert list(ex) == [{"question": "who wrote hamlet?", "answers": ["Shakespeare"], "source": "nq"}]
    # a row that kept only the chat prompt and the reward model (Search-R1's verl columns)
    slim = {"prompt": rows[0]["prompt"], "reward_model": rows[0]["reward_model"], "data_source": "nq"}
    assert search.load_examples([slim])[0]["answers"] == ["Shakespeare"]
    with pytest.raises(ValueError, match="golden_answers"):
        search.load_examples([{"question": "q"}])
    with pytest.raises(FileNotFoundError):
        search.load_examples(str(tmp_path), "test")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pyarrow"):
            search.load_examples(str(tmp_path / "x.parquet"))
    else:
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
        assert search.load_examples(str(tmp_path), "test")[0]["answers"] == ["Shakespeare"]


# ----------------------------------------------------------------------------- WebShop

class StandInShop:
    """A small stand-in with the official `WebAgentTextEnv` interface (text mode): reset(session),
    step(action) -> (obs, reward, done, info), get_available_actions(), instruction_text,
    server.goals. WebShop's product data and search index can't be fetched here, so the adapter's
    contract is tested against this object; the real shop is used when the package is installed."""

    PRODUCTS = {"b001": ("red cotton t-shirt", ["small", "medium", "large"]),
                "b002": ("blue denim jacket", ["medium", "large"]),
                "b003": ("green tea 20 bags", ["pack of 1", "pack of 3"]),
                "b004": ("wooden desk lamp", ["black", "white"])}

    def __init__(self, n_goals=1600):
        asins = list(self.PRODUCTS)
        goals = []
        for i in range(n_goals):
            asin = asins[i % len(asins)]
            name, opts = self.PRODUCTS[asin]
            opt = opts[i % len(opts)]
            goals.append({"asin": asin.upper(), "query": name, "category": ["fashion", "food"][i % 2],
                          "instruction_text": f"i need a {name}, {opt}", "goal_options": [opt]})
        self.server = SimpleNamespace(goals=goals)

    def reset(self, session=None):
        self.goal = self.server.goals[session]
        self.instruction_text = "Instruction: " + self.goal["instruction_text"]
        self.page, self.results, self.asin, self.options = "search", [], None, set()
        return self.observation, None

    @property
    def observation(self):
        head = f"WebShop [SEP] Instruction: [SEP] {self.goal['instruction_text']} [SEP] "
        if self.page == "search":
            return head + "Search"
        if self.page == "results":
            return head + "Back to Search [SEP] Next > [SEP] " + " [SEP] ".join(
                f"{a.upper()} [SEP] {self.PRODUCTS[a][0]}" for a in self.results)
        return head + f"Back to Search [SEP] {self.PRODUCTS[self.asin][0]} [SEP] Buy Now"

    def get_available_actions(self):
        if self.page == "search":
            return {"has_search_bar": True, "clickables": ["search"]}
        if self.page == "results":
            return {"has_search_bar": False, "clickables": ["back to search", "next >"] + self.results}
        return {"has_search_bar": False,
                "clickables": ["back to search", "< prev", "description", "buy now"] + self.PRODUCTS[self.asin][1]}

    def step(self, action):
        m = re.match(r"^(search|click)\[(.+)\]$", action)
        name, arg = (m.group(1), m.group(2).lower()) if m else (None, None)
        clickables = self.get_available_actions()["clickables"]
        if name == "search":                   # the official env searches from any page
            words = set(arg.split())
            ranked = sorted(self.PRODUCTS, key=lambda a: -len(words & set(self.PRODUCTS[a][0].split())))
            # the best match sits on the second page, so paging is exercised
            self.pages, self.page = [ranked[1:3], [ranked[0]] + ranked[3:]], "results"
            self.results = self.pages[0]
        elif name == "click" and arg in clickables:
            if arg == "back to search":
                self.page = "search"
            elif arg == "next >":
                self.results = self.pages[1]
            elif arg in self.PRODUCTS:
                self.page, self.asin, self.options = "item", arg, set()
            elif arg == "buy now":
                right = self.asin == self.goal["asin"].lower()
                score = (0.5 + 0.5 * (self.options == set(self.goal["goal_options"]))) if right else 0.1
                return "Thank you for shopping with us!", score, True, None
            elif self.page == "item" and arg in self.PRODUCTS[self.asin][1]:
                self.options = {arg}
        return self.observation, 0.0, False, None


def test_webshop_without_package_explains_install():
    try:
        import web_agent_site  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="web_agent_site.*setup.sh"):
            webshop.WebShopEnv()
    else:   # installed: construction must either work or name the missing data
        try:
            webshop.WebShopEnv(split="test")
        except RuntimeError as e:
            assert "data" in str(e)


def test_webshop_adapter_contract_with_stand_in():
    """Stand-in shop (see StandInShop): WebShop's data can't be fetched in this environment."""
    env = envs.make("webshop", split="train", max_steps=15, history_length=2, text_env=StandInShop())
    assert_contract(env, "webshop")
    assert env.num_tasks == 1100 and env.reward_scale == 10.0   # train = goals [500, 1600), the authors' split
    assert webshop.WebShopEnv(split="test", text_env=StandInShop()).num_tasks == 500
    obs, info = env.reset(seed=0)
    assert "Instruction" not in obs and env.task.startswith("i need a ")
    assert info["admissible"] == ["search[<your query>]"]
    for seed in range(8):
        won, total, steps = play_expert(env, seed)
        assert won and total == 10.0
    assert env.reset(seed=5)[1]["task"] == webshop.WebShopEnv(text_env=StandInShop()).reset(seed=5)[1]["task"]
    assert_survives_hostile(env)
    env.reset(seed=0)
    think = "<think>what next</think>"
    obs, _, _, _, info = env.step(think + "<action>click[buy now]</action>")   # not on this page: nothing happens
    assert info["valid"] and info["action"] == "click[buy now]" and obs == env.history[0][0]
    obs, _, _, _, info = env.step(think + "<action>search[Red Cotton T-Shirt]</action>")
    assert info["valid"] and info["action"] == "search[red cotton t-shirt]" and "B00" in obs
    assert env.step(think + "<action>click[b999]</action>")[4]["valid"] is True
    prompt = env.prompt()
    assert "[Action 2] search[red cotton t-shirt]" in prompt and "[Action 3] click[b999]" in prompt
    assert "[Action 1]" not in prompt and env.history[0][1] == "click[buy now]"        # history_length 2
    # buying the wrong product: scored, episode over, no win
    env.reset(seed=0)
    env.step("<action>search[wooden desk lamp]</action>")
    wrong = next(a[6:-1] for a in env.admissible() if re.match(r"click\[b00\d\]", a)
                 and a[6:-1] != env.goal["asin"].lower())
    env.step(f"<action>click[{wrong}]</action>")
    obs, reward, terminated, _, info = env.step("<action>click[Buy Now]</action>")
    assert terminated and reward == 0.0 and not info["won"] and 0 < info["score"] < 1


def test_webshop_projection_rule():
    """The authors' webshop_projection (webshop/projection.py:19-65 at 2cf2fad): a format rule (action tags,
    think block, no CJK ideograph); the lower-cased action text, or without tags the last 20 lower-cased
    characters, goes to the shop, which ignores what it cannot do. Stand-in shop: see StandInShop."""
    env = envs.make("webshop", text_env=StandInShop())
    cases = [("<think>t</think><action>search[red cotton t-shirt]</action>", "search[red cotton t-shirt]", True),
             ("<action>search[red cotton t-shirt]</action>", "search[red cotton t-shirt]", False),  # no think
             ("<think>\u4e70\u886c\u886b</think><action>search[shirt]</action>", "search[shirt]", False),
             ("<think>t</think><action>buy the shirt</action>", "buy the shirt", True),
             ("please search[red cotton t-shirt]", "[red cotton t-shirt]", False)]
    for text, sent, valid in cases:
        env.reset(seed=0)
        start = env.obs
        obs, _, _, _, info = env.step(text)
        assert (info["action"], info["valid"]) == (sent, valid), text
        assert (obs != start) == sent.startswith("search[") and env.history == [(start, sent)]
    env.reset(seed=0)
    first = env.prompt()
    assert "Current page:" in first and "Prior to this step" not in first
    env.step("<think>t</think><action>search[red cotton t-shirt]</action>")
    assert "You are now at step 2." in env.prompt() and "[Action 1] search[red cotton t-shirt]" in env.prompt()


def test_bad_configuration_fails_at_construction():
    for name in ("sokoban", "ezpoints"):
        with pytest.raises(ValueError, match="split"):
            envs.make(name, split="bogus")
    with pytest.raises(ValueError, match="split"):
        envs.make("webshop", split="bogus", text_env=StandInShop())
    with pytest.raises(FileNotFoundError, match="bogus"):
        envs.make("search", split="bogus")
    with pytest.raises(FileNotFoundError, match="no_such_file"):
        envs.make("search", data="/no_such_file.jsonl")
