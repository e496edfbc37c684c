"""EZPoints (Section 4.1; gym_cards' "EZPoints" as used by verl-agent/GiGPO, text version).

Two playing cards are dealt; the agent writes an arithmetic expression that equals 12, using each
card's value exactly once, one token per step: a card value, an operator (+ or *) or `=`. J, Q and
K count as 10 (as in gym_cards). `=` ends the episode and the formula is evaluated by the small
recursive-descent parser below over exact fractions (never Python's `eval`). Only card pairs that
admit a solution are dealt: the task list is every ordered pair of the 52 cards whose values an
exhaustive search can combine into 12 (e.g. 4 and 8 by +, 3 and 4 by *). Reward 10 on a correct `=`.

The response format, validity and what is executed follow the authors' gym_cards projection
(env_package/gym_cards/projection.py at 2cf2fad) and their EZPoints prompt: the agent answers a JSON object
{"thoughts": ..., "action": ...}; the lower-cased text from `"action":` on (the last character when the key
is missing) must contain exactly one of the tokens 1-10, +, * and = ("10" is read before "1"). An invalid
response executes nothing: the formula stays as it is, the step counts. A valid token that cannot be used
(a number that is not an unused card value) also leaves the formula unchanged, as their env does.
The operators are + and * as theirs (with two cards 12 is never a difference or a quotient).

With `image=True` (Appendix C.3's visual agents) the cards are an image drawn here (`render_cards`: rank and
suit on each card, the formula written below, 300 x 300 as gym_cards' canvas); the prompt names no card
and keeps the formula so far as text, as the authors' visual template does.
"""
import itertools
from fractions import Fraction

import gymnasium as gym
import numpy as np

import envs

TARGET = 12
OPERATORS = ["+", "*"]                 # the authors' EZPoints actions (with the numbers and "=")
TOKENS = [str(v) for v in range(1, 11)] + OPERATORS + ["="]   # what the projection recognizes
SUITS = ["hearts", "spades", "diamonds", "clubs"]
RANKS = ["A", "2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K"]
RANK_VALUE = {r: min(i + 1, 10) for i, r in enumerate(RANKS)}
SPLIT_ORDER = {"train": 0, "valid": 1, "test": 2}   # seed of each split's fixed task order


# ----------------------------------------------------------------------------- parser

class ParseError(ValueError):
    pass


def evaluate(tokens):
    """Value of a token list under the grammar  expr := term (('+'|'-') term)*,
    term := number (('*'|'/') number)*  as an exact Fraction. Raises ParseError on bad syntax,
    division by zero or an unknown token."""
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def number():
        nonlocal pos
        tok = peek()
        if tok is None or not (isinstance(tok, str) and tok.isdigit() and tok.isascii()):
            raise ParseError(f"expected a number at position {pos}, got {tok!r}")
        pos += 1
        return Fraction(int(tok))

    def term():
        nonlocal pos
        value = number()
        while peek() in ("*", "/"):
            op = peek()
            pos += 1
            rhs = number()
            if op == "/" and rhs == 0:
                raise ParseError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def expr():
        nonlocal pos
        value = term()
        while peek() in ("+", "-"):
            op = peek()
            pos += 1
            rhs = term()
            value = value + rhs if op == "+" else value - rhs
        return value

    value = expr()
    if pos != len(tokens):
        raise ParseError(f"unexpected token {tokens[pos]!r} at position {pos}")
    return value


def solutions(values, target=TARGET):
    """Exhaustive search: every formula (token list, `=` excluded) that uses each value once,
    in any order, joined by any operators, and evaluates to `target`."""
    found = []
    for perm in sorted(set(itertools.permutations(values))):
        for ops in itertools.product(OPERATORS, repeat=len(values) - 1):
            tokens = [str(perm[0])]
            for op, v in zip(ops, perm[1:]):
                tokens += [op, str(v)]
            try:
                if evaluate(tokens) == target:
                    found.append(tokens)
            except ParseError:
                pass
    return found


def all_tasks():
    """Every ordered pair of distinct cards (rank, suit) whose values can make TARGET."""
    cards = [(r, s) for s in SUITS for r in RANKS]
    return [(a, b) for a, b in itertools.permutations(cards, 2)
            if solutions([RANK_VALUE[a[0]], RANK_VALUE[b[0]]])]


TASKS = all_tasks()


# ----------------------------------------------------------------------------- parsing

def parse_action(text):
    """Raw response -> the token (valid) or None (invalid), as the authors' gym_projection for EZPoints:
    from `"action":` on (else the last character), exactly one distinct token of TOKENS must occur."""
    rest = envs.as_text(text).lower()
    rest = rest[rest.find('"action":'):]
    found = {"10"} if "10" in rest else set()
    rest = rest.replace("10", "")
    found |= {tok for tok in TOKENS if tok in rest}
    return found.pop() if len(found) == 1 else None


# ----------------------------------------------------------------------------- image (Appendix C.3)

FELT, RED, BLACK = (53, 101, 77), (200, 30, 30), (20, 20, 20)   # gym_cards' table green '#35654d'


def draw_suit(draw, suit, cx, cy, r, colour):
    """A suit symbol of radius ~r centred at (cx, cy), from circles and polygons."""
    if suit == "diamonds":
        draw.polygon([(cx, cy - r), (cx + 0.7 * r, cy), (cx, cy + r), (cx - 0.7 * r, cy)], fill=colour)
        return
    if suit == "clubs":
        for dx, dy in ((0, -0.45), (-0.5, 0.15), (0.5, 0.15)):
            x, y = cx + dx * r, cy + dy * r
            draw.ellipse([x - 0.45 * r, y - 0.45 * r, x + 0.45 * r, y + 0.45 * r], fill=colour)
    else:   # hearts: two lobes over a point; spades: the same upside down
        s = 1 if suit == "hearts" else -1
        for dx in (-0.45, 0.45):
            x, y = cx + dx * r, cy - s * 0.3 * r
            draw.ellipse([x - 0.5 * r, y - 0.5 * r, x + 0.5 * r, y + 0.5 * r], fill=colour)
        draw.polygon([(cx - 0.95 * r, cy - s * 0.15 * r), (cx + 0.95 * r, cy - s * 0.15 * r), (cx, cy + s * r)],
                     fill=colour)
    if suit in ("clubs", "spades"):
        draw.polygon([(cx, cy), (cx - 0.35 * r, cy + r), (cx + 0.35 * r, cy + r)], fill=colour)


def render_cards(cards, formula, size=300):
    """-> uint8 image [size, size, 3]: the two cards side by side on a green table (5:7 cards of 0.45 x the
    width, as gym_cards lays them out), each with its rank in the corners and a large suit symbol, and
    "Formula: ..." written below."""
    from PIL import Image, ImageDraw, ImageFont
    canvas = Image.new("RGB", (size, size), FELT)
    draw = ImageDraw.Draw(canvas)
    w = int(size / len(cards) * 0.9)
    h = int(w * 7 / 5)
    big, small = ImageFont.load_default(size=w // 4), ImageFont.load_default(size=size // 15)
    for i, (rank, suit) in enumerate(cards):
        x, y = 5 + int(i * w * 1.1), (size - h) // 2
        colour = RED if suit in ("hearts", "diamonds") else BLACK
        draw.rounded_rectangle([x, y, x + w, y + h], radius=w // 12, fill=(255, 255, 255), outline=BLACK)
        draw.text((x + w // 14, y + w // 20), rank, fill=colour, font=big)
        draw.text((x + w - w // 14, y + h - w // 20), rank, fill=colour, font=big, anchor="rb")
        draw_suit(draw, suit, x + w / 2, y + h / 2 + w / 12, w / 4, colour)
    draw.text((10, int(size * 0.86)), "Formula: " + " ".join(formula), fill=(255, 255, 255), font=small)
    return np.asarray(canvas, dtype=np.uint8)


# ----------------------------------------------------------------------------- env

def card_name(card):
    rank, suit = card
    full = {"A": "ace", "J": "jack", "Q": "queen", "K": "king"}.get(rank, rank)
    return f"{full} of {suit}"


class EZPointsEnv(gym.Env):
    """Build an expression equal to 12 from two cards, one token per step (module docstring).
    `split` is accepted for the common interface: the pool of dealable pairs is small (gym_cards
    draws train and eval hands from one distribution), so every split deals from all of it, each
    in its own fixed shuffled order. `history_length` too: the prompt shows no history, as the
    authors' (their GymCardEnvironmentManager keeps none)."""

    name = "ezpoints"
    reward_scale = 10.0
    invalid_penalty = 0.1
    task_line = "Your task is to:"   # the prompt's task line (envs.insert_skill puts the episode skill after it)
    eval_splits = ("test",)          # held-out splits seed.py evaluates on
    response_format = "json"         # {"thoughts": ..., "action": ...}, the authors' gym_cards format
    observation_in_task_key = False   # the library files a skill under the task text (analyzer.task_key)
    defaults = dict(max_steps=5, history_length=2, max_prompt_tokens=1024, max_tokens=256,
                    max_step_skills=0)   # the authors' launcher (docs/design-notes.md)

    def __init__(self, max_steps=5, history_length=2, split="train", image=False):
        if split not in SPLIT_ORDER:
            raise ValueError(f"unknown ezpoints split {split!r}; choose one of {', '.join(SPLIT_ORDER)}")
        self.order = np.random.default_rng(SPLIT_ORDER[split]).permutation(len(TASKS))
        self.split, self.max_steps, self.history_length = split, max_steps, history_length
        self.image = image
        self.num_tasks = len(TASKS)
        self.family = "ezpoints"
        self.task = ""
        self.cards = None

    # -- gymnasium API
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        task_id = int(seed) if seed is not None else int(self.np_random.integers(self.num_tasks))
        self.task_id = task_id % self.num_tasks
        self.cards = TASKS[int(self.order[self.task_id])]
        self.values = [RANK_VALUE[r] for r, _ in self.cards]
        self.task = (f"write a formula that equals {TARGET} using the values of the cards "
                     f"{card_name(self.cards[0])} and {card_name(self.cards[1])}, each exactly once.")
        if self.image:   # the agent reads the cards from the image, as the authors' visual EZPoints
            self.task = f"write a formula that equals {TARGET} using the values of the two cards in the image, each exactly once."
        self.formula, self.steps, self.done = [], 0, False
        self.obs = self._observation()
        plan = self.expert_formula() + ["="]
        info = dict(task=self.task, family=self.family, admissible=self.admissible(),
                    expert_plan=plan, won=False, valid=True, action="")
        return self.obs, info

    def admissible(self):
        """Card values not used yet, the operators, and `=`."""
        left = list(self.values)
        for tok in self.formula:
            if tok.isdigit() and int(tok) in left:
                left.remove(int(tok))
        return sorted({str(v) for v in left}, key=int) + OPERATORS + ["="]

    def step(self, text):
        if self.cards is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            info = dict(won=False, valid=False, action="", admissible=[])
            return "The episode is over; call reset().", 0.0, True, False, info
        action = parse_action(text)
        won = terminated = False
        if action == "=":
            terminated = True
            won, verdict = self._check()
            obs = f"Formula: {' '.join(self.formula)} = . {verdict}"
        else:
            if action in self.admissible():
                self.formula.append(action)
            obs = self._observation()
        self.steps += 1
        truncated = not terminated and self.steps >= self.max_steps
        self.done, self.obs = terminated or truncated, obs
        info = dict(won=won, valid=action is not None, action=action or "", admissible=self.admissible())
        return obs, self.reward_scale if won else 0.0, terminated, truncated, info

    def _check(self):
        numbers = sorted(int(t) for t in self.formula if t.isdigit())
        if numbers != sorted(self.values):
            return False, "Wrong: the formula must use each card's value exactly once."
        try:
            value = evaluate(self.formula)
        except ParseError as e:
            return False, f"Wrong: the formula is not well formed ({e})."
        if value == TARGET:
            return True, f"Correct: it equals {TARGET}."
        return False, f"Wrong: it equals {value}, not {TARGET}."

    def _observation(self):
        formula = " ".join(self.formula) if self.formula else "(empty)"
        if self.image:
            return f"Cards: {envs.IMAGE} Formula so far: {formula}"
        cards = ", ".join(f"{card_name(c)} (value {v})" for c, v in zip(self.cards, self.values))
        return f"Cards: {cards}. Formula so far: {formula}"

    def prompt_images(self):
        """Image mode: the images the prompt's IMAGE markers stand for (the two cards and the formula)."""
        return [render_cards(self.cards, self.formula)]

    # -- contract extras
    def expert_formula(self):
        """The first solution (token list, `=` excluded) that extends the current formula; None when none does."""
        if self.cards is None or self.done:
            return None
        n = len(self.formula)
        return next((sol for sol in solutions(self.values) if sol[:n] == self.formula), None)

    def expert_action(self):
        """Next token of expert_formula(): its next token, or `=` once it is written; None when none extends it."""
        sol = self.expert_formula()
        if sol is None:
            return None
        n = len(self.formula)
        return sol[n] if n < len(sol) else "="

    def prompt(self):
        """The authors' EZPoints template structure (one form at every step, no history: the formula is the
        state): the goal and the allowed tokens, the card and formula rules, the reward, the current
        formula, the turn instruction and the JSON answer format. The card values, which their agent reads
        from an image, are given in the task line."""
        return "\n".join([
            f"You are an expert card-game player building a formula that equals {TARGET}.",
            f"{self.task_line} {self.task}",
            "Card rules: number cards count their face value, J, Q and K count 10, A counts 1; use only "
            "these two values, each exactly once.",
            f"Formula rules: each step appends one token to the end of the formula: a card value, '+' or "
            f"'*', or '=', which evaluates the formula and ends the game. Reward {self.reward_scale:g} if it "
            f"equals {TARGET}, else 0.",
            f"Current observation: {self.obs}",
            "Now it's your turn to append the next token. Answer with one JSON object: "
            '{"thoughts": "<your step-by-step reasoning>", "action": "<the next token>"}',
        ])
