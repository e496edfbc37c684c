"""Search-augmented QA with the Search-R1 protocol (Section 4.1; Jin et al. 2025; docs/design-notes.md#environments).

Each turn the model either searches, `<search> query </search>`, and the env answers with the top
documents of the retriever as `<information>Doc 1(Title: ...) ...</information>`, or answers,
`<answer> ... </answer>`, which ends the episode with reward = exact match (0/1) of the normalized
answer against any gold answer (normalization as in Search-R1/SQuAD: lowercase, drop punctuation and
the articles a/an/the, squeeze spaces). At most `max_steps` (4) turns.
Validity and what is executed follow the authors' search projection (env_package/search/projection.py at
2cf2fad): the response is cut after its first `</search>` (else its first `</answer>`); its first search
block, else its first answer block, is the action. The turn is invalid (penalty 0.01 in the trainer) when
there is no block, or the response holds both a `<search>` and an `<answer>` tag, or one of them twice;
the block found is still executed then. A turn without a block executes nothing and returns no
information. The history keeps each action with the information it brought back.

The retriever is any server speaking `POST /retrieve {"query", "topk", "return_scores"}` ->
`{"result": [[{"document": {"contents"}, "score"}]]}` (Search-R1's own server, or `envs.retriever`).
The client retries with exponential backoff and then stops the run with an error naming the URL.

Data: Search-R1's processed parquet files (columns `question`, `golden_answers`, `data_source`,
`reward_model.ground_truth.target`; needs pyarrow) or JSONL with `{"question", "golden_answers"}`
(optional `data_source`). Default: the small QA set shipped in envs/data/search_qa/.
"""
import functools
import json
import os
import re
import string
import time
import urllib.error
import urllib.request

import gymnasium as gym

import envs

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "search_qa")
BLOCK = {kind: re.compile(rf"<{kind}>(.*?)</{kind}>", re.IGNORECASE | re.DOTALL) for kind in ("search", "answer")}
OPEN = {kind: re.compile(rf"<{kind}>", re.IGNORECASE) for kind in ("search", "answer")}


# ----------------------------------------------------------------------------- reward

def normalize_answer(s):
    """Lowercase, drop punctuation and the articles a/an/the, squeeze whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction, golden_answers):
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


# ----------------------------------------------------------------------------- retriever client

class RetrieverError(RuntimeError):
    pass


def retrieve(url, query, topk=3, timeout=10.0, retries=4, backoff=0.5):
    """-> list of document dicts (with "contents") from a Search-R1 retriever. Retries `retries`
    times with exponential backoff (backoff, 2*backoff, ...) on connection errors, timeouts and
    5xx answers; then raises RetrieverError naming the URL."""
    body = json.dumps({"query": query, "topk": topk, "return_scores": True}).encode()
    last = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                result = json.loads(resp.read())["result"][0]
            return [item["document"] if "document" in item else item for item in result]
        except urllib.error.HTTPError as e:
            if e.code < 500:   # the request itself is wrong: retrying won't help
                raise RetrieverError(f"retriever at {url} rejected the request: HTTP {e.code} "
                                     f"{e.read()[:200].decode(errors='replace')}")
            last = e
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            last = e
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RetrieverError(f"retriever at {url} answered outside the Search-R1 protocol: {e!r}")
    raise RetrieverError(f"retriever at {url} unreachable after {retries + 1} attempts "
                         f"({last!r}); start one with: python -m envs.retriever --corpus CORPUS.jsonl")


def format_documents(docs):
    """Search-R1's passage format: 'Doc i(Title: first line) rest of the text'."""
    out = []
    for i, doc in enumerate(docs, 1):
        title, _, text = str(doc.get("contents", "")).partition("\n")
        out.append(f"Doc {i}(Title: {title.strip()}) {text.strip()}")
    return "\n".join(out)


# ----------------------------------------------------------------------------- data

def load_jsonl(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})")
    return rows


def load_parquet(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), "
                          f"or convert it to JSONL with question/golden_answers")
    return pq.read_table(path).to_pylist()


def to_example(row, where):
    """A Search-R1 row (parquet or JSONL) -> {"question", "answers", "source"}."""
    question = row.get("question")
    if question is None and row.get("prompt"):   # only the chat prompt was kept: take the question
        question = str(row["prompt"][0]["content"]).rsplit("Question:", 1)[-1]
    answers = row.get("golden_answers")
    if answers is None:
        answers = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if isinstance(answers, str):
        answers = [answers]
    if not question or not answers:
        raise ValueError(f"{where}: a row needs 'question' and 'golden_answers' "
                         f"(or reward_model.ground_truth.target); got keys {sorted(row)}")
    question = str(question).strip()
    if not question.endswith("?"):
        question += "?"
    return {"question": question, "answers": [str(a) for a in answers],
            "source": str(row.get("data_source") or "qa")}


def load_examples(data=None, split="train"):
    """`data`: None (the shipped set), a .jsonl/.parquet file, a folder holding `<split>.jsonl` or
    `<split>.parquet`, or a list of row dicts."""
    if isinstance(data, list):
        return [to_example(r, f"row {i}") for i, r in enumerate(data)]
    path = data or DATA_DIR
    if os.path.isdir(path):
        for ext in (".parquet", ".jsonl"):
            if os.path.exists(os.path.join(path, split + ext)):
                path = os.path.join(path, split + ext)
                break
        else:
            raise FileNotFoundError(f"no {split}.parquet or {split}.jsonl in {path}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"search QA data not found: {path}")
    return _load_file(os.path.abspath(path), os.path.getmtime(path))


@functools.lru_cache(maxsize=8)
def _load_file(path, mtime):
    """Parsed once per process (a rollout builds hundreds of envs over the same file); shared, read-only."""
    rows = load_parquet(path) if path.endswith(".parquet") else load_jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no questions")
    return tuple(to_example(r, f"{path} row {i}") for i, r in enumerate(rows))


# ----------------------------------------------------------------------------- parsing

def parse_action(text):
    """Raw response -> ((kind, content) or None, valid), as the authors' search projection (module
    docstring). Never raises."""
    text = envs.as_text(text)
    cut = next((text.split(end, 1)[0] + end for end in ("</search>", "</answer>") if end in text), text)
    found = next(((kind, m.group(1).strip()) for kind in ("search", "answer") if (m := BLOCK[kind].search(cut))), None)
    n_search, n_answer = len(OPEN["search"].findall(text)), len(OPEN["answer"].findall(text))
    return found, found is not None and not (n_search and n_answer) and n_search <= 1 and n_answer <= 1


# ----------------------------------------------------------------------------- env

class SearchEnv(gym.Env):
    """One question per task; search up to `max_steps` - 1 times, then answer (module docstring)."""

    name = "search"
    reward_scale = 1.0
    invalid_penalty = 0.01
    task_line = "Your question:"    # the prompt's task line (envs.insert_skill puts the episode skill after it)
    eval_splits = ("test",)          # held-out splits seed.py evaluates on
    response_format = "tags"         # <think> spans as the others' (no <action>: no action tokens)
    observation_in_task_key = False   # the library files a skill under the task text (analyzer.task_key)
    defaults = dict(tasks_per_update=128, max_steps=4, history_length=4, max_prompt_tokens=4096,
                    kl_coef=0.001, ent_coef=0.0, max_step_skills=2,   # the authors' launcher (docs/design-notes.md):
                    mini_batch_size=512, lr_warmup=0.1,             # 512 step rows a step, 10 % warm-up,
                    eval_every=150, eval_tasks=0)                   # the whole test set after update 150 only

    def __init__(self, retriever_url="http://127.0.0.1:8000/retrieve", data=None, split="train",
                 max_steps=4, topk=3, history_length=4, timeout=10.0, retries=4, backoff=0.5):
        self.examples = load_examples(data, split)
        self.url, self.split, self.max_steps, self.topk = retriever_url, split, max_steps, topk
        self.history_length = history_length
        self.client = dict(timeout=timeout, retries=retries, backoff=backoff)
        self.num_tasks = len(self.examples)
        self.task, self.family, self.example = "", "", None

    # -- gymnasium API
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        task_id = int(seed) if seed is not None else int(self.np_random.integers(self.num_tasks))
        self.task_id = task_id % self.num_tasks
        self.example = self.examples[self.task_id]
        self.task, self.family = self.example["question"], self.example["source"]
        self.steps, self.history, self.done = 0, [], False
        self.obs = "No search results yet."
        plan = [f"<search> {self.task} </search>", f"<answer> {self.example['answers'][0]} </answer>"]
        info = dict(task=self.task, family=self.family, admissible=[], expert_plan=plan,
                    won=False, valid=True, action="")
        return self.obs, info

    def step(self, text):
        if self.example is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return "The episode is over; call reset().", 0.0, True, False, dict(won=False, valid=False, action="")
        parsed, valid = parse_action(text)
        reward, terminated, action, obs = 0.0, False, "", ""
        if parsed is not None and parsed[0] == "search":
            action = f"<search>{parsed[1]}</search>"
            docs = retrieve(self.url, parsed[1], self.topk, **self.client)
            obs = f"<information>{format_documents(docs)}</information>"
        elif parsed is not None:
            action = f"<answer>{parsed[1]}</answer>"
            reward = exact_match(parsed[1], self.example["answers"])
            terminated = True
            obs = f"Your answer: {parsed[1]}"
        self.history.append((obs, action))
        self.steps += 1
        truncated = not terminated and self.steps >= self.max_steps
        self.done, self.obs = terminated or truncated, obs
        info = dict(won=reward == 1.0, valid=valid, action=action)
        return obs, reward * self.reward_scale, terminated, truncated, info

    # -- contract extras
    def expert_action(self):
        """Search the question first, then answer the first gold answer."""
        if self.example is None or self.done:
            return None
        searched = any(a.startswith("<search>") for _, a in self.history)
        if not searched:
            return f"<search> {self.task} </search>"
        return f"<answer> {self.example['answers'][0]} </answer>"

    def prompt(self):
        """The authors' search template structure: role and question; after the first step the steps
        taken and the last `history_length` actions, each with the information it brought back; the turn
        instruction with the format rules."""
        lines = [
            "You are an expert agent answering a question step by step with the help of a search engine.",
            f"{self.task_line} {self.task}",
        ]
        lines += envs.history_lines(self.history, self.steps, self.history_length, line="[Step {k}] {act}\n{obs}")
        lines.append("Now it's your turn. First reason inside <think> </think>. Then do exactly one of: "
                     "(1) if you lack knowledge, search with <search> your query </search>, and the "
                     "results will come back inside <information> </information>; "
                     "(2) if you know enough, give the final answer inside <answer> </answer>, "
                     "a few words without explanation, for example <answer> Beijing </answer>.")
        return "\n".join(lines)
