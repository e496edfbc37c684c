"""Hindsight analysis: an episode becomes a skill (Section 3.3, on-policy skill generation by the analyzer,
and the Stage-1 annotators of Section 3.2).

The analyzer reads a finished episode (task, outcome, every step's observation, full response and
validity) and answers with one JSON object {"episode_summary": ..., "episode_skill": ...}: a reusable
workflow for a success, an avoidance rule for a failure, addressed to the policy. With critical-step skills
(`skill_mode` episode_step, the authors' ALFWorld / WebShop / Search launchers; step_only) the object also
holds "step_skills": {"0": "...", "2": "..."}: 0-based step -> one imperative sentence for that step, at
most `max_step_skills` of them (seed/analysis.py at 2cf2fad). During RL the analyzer is
the snapshot pi_old itself (`analyze`: one greedy generation, as the authors; corrective retries on a parse
failure are optional); in Stage 1 it is an external OpenAI-compatible endpoint (`ExternalAnalyzer`, one
request per episode, transport retries only) or, offline, `scripted_analysis`, which writes the skill from the
env's own expert plan and the failure it saw. Both stages read the same prompt (`fit_prompt`: the whole
episode, trimmed only beyond the analyzer's own token budget), so a Stage-1 example is what Stage 2 asks.
`envs.insert_skill` puts a skill into an actor prompt (re-scoring, the skill_grpo and skill_prompt baselines);
`SkillLibrary` keeps Stage-1 skills for the baselines that retrieve a skill instead of analyzing live.
A visual episode (Appendix C.3) is analyzed with its images: each step's observation is its image, and the
prompt carries as many of them as the analyzer's token budget holds (`prompt_ids`).
"""
import json
import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import envs
import rollout
import vision
from envs import IMAGE
from runfolder import fail

SYSTEM = ("You are an expert coach for an AI agent. You read one finished episode of the agent and write a "
          "short, reusable skill that will help the agent on similar tasks. You answer with JSON only.")
CORRECTION = ("Your answer could not be used: {why}. Reply with only one JSON object, exactly of the form "
              '{{"episode_summary": "<one or two sentences>", "episode_skill": "<one short skill, a full '
              'sentence addressed to the agent>"}}, and nothing else.')
SKILL_MODES = ("episode_step", "episode_only", "step_only")   # which skills the analyzer writes (seed.Config)
MAX_SKILL_CHARS = 600                # a longer skill is cut at a sentence or word boundary
PLACEHOLDERS = {"", "none", "n/a", "na", "null", "skill", "...", "todo", "tbd", "unknown", "no skill",
                "the skill", "episode_skill"}


# ----------------------------------------------------------------------------- the analysis prompt

def _outcome(ep):
    if ep.won:
        return f"SUCCESS: the task was completed in {ep.length} steps (reward {ep.reward:g})."
    return f"FAILURE: the task was not completed after {ep.length} steps (reward {ep.reward:g})."


def step_images(ep):
    """A visual episode's observation images, one per step (the image of the step's prompt, PNG bytes);
    [] for a text episode."""
    return [s.prompt_ids.images[-1] for s in ep.steps if getattr(s.prompt_ids, "images", None)]


def _render_steps(ep, obs_keep, resp_cap):
    """The trajectory block, steps numbered from 0 (the step_skills keys); observations of steps before
    `obs_keep` are trimmed, responses capped. A visual
    episode shows each observation as its image (an IMAGE marker, as the authors' seed_visual prompt)."""
    lines, visual = [], bool(step_images(ep))
    for t, s in enumerate(ep.steps):
        obs = (IMAGE if visual else s.observation) if t >= obs_keep else "[older observation trimmed]"
        resp, act = (x if len(x) <= resp_cap else x[:resp_cap] + " [...]" for x in (s.response_text, s.action))
        if visual:   # a marker the agent wrote is text, not an image
            resp, act = resp.replace(IMAGE, "[image]"), act.replace(IMAGE, "[image]")
        valid = (f"valid, executed: {act}" if s.valid else
                 f"INVALID (the response broke the required format), executed: {act or 'nothing'}")
        lines += [f"## Step {t}", f"Observation: {obs}", f"Agent response: {resp}", f"Action: {valid}", ""]
    return "\n".join(lines)


def _job(ep, skill_mode, max_step_skills):
    """The prompt's closing instructions and the JSON form asked for, by skill mode."""
    k = min(max_step_skills, ep.length)
    episode = ("Write one skill the agent should follow next time it meets a similar task.\n"
               + ("- The episode SUCCEEDED: write the workflow that worked, as the few key steps in order.\n"
                  if ep.won else
                  "- The episode FAILED: write an avoidance rule: what went wrong (invalid actions, loops, "
                  "wasted steps, wrong objects) and what to do instead.\n")
               + "- Address the agent directly, in at most three sentences; make it reusable for similar tasks, "
                 "not a copy of this episode's step numbers.\n")
    steps = (f"Pick at most {k} critical step(s) of this episode (where it was won or lost: a mistake, a wasted "
             f"move, or a key move) and write, for each, one short imperative sentence telling the agent what "
             f"to do at that step. Key each by its step number as shown above (0 is the first step).\n")
    summary = '"episode_summary": "<what happened, one or two sentences>"'
    step_json = '"step_skills": {"0": "<what to do at step 0>", "2": "<what to do at step 2>"}'
    if skill_mode == "step_only":
        return "# Your job\n" + steps + "Answer with only this JSON object:\n{" + summary + ", " + step_json + "}"
    job = "# Your job\n" + episode
    if skill_mode == "episode_only" or k == 0:
        return job + 'Answer with only this JSON object:\n{' + summary + ', "episode_skill": "<the skill>"}'
    return (job + "Then, for the step skills: " + steps + "Answer with only this JSON object:\n{" + summary
            + ', "episode_skill": "<the skill>", ' + step_json + "}")


def analysis_prompt(episode, max_chars=None, skill_mode="episode_only", max_step_skills=0):
    """-> chat messages asking for {"episode_summary", "episode_skill"} (and "step_skills", by `skill_mode`:
    at most `max_step_skills`) about `episode`, whole (every step's observation and full response) unless
    the user message exceeds `max_chars`: then old observations are trimmed first (oldest first, the last
    one is kept), then old responses are shortened."""
    ep = episode
    head = (f"Environment: {ep.env}\nTask: {ep.task}\nOutcome: {_outcome(ep)}\n\n# Trajectory\n")
    tail = _job(ep, skill_mode, max_step_skills)
    n, body = ep.length, _render_steps(ep, 0, 10**9)
    budget = len(body) if max_chars is None else max_chars - len(head) - len(tail)
    for keep in range(1, n):                                    # trim observations, oldest first
        if len(body) <= budget:
            break
        body = _render_steps(ep, keep, 10**9)
    for cap in (800, 400, 200, 80):                             # then shorten responses
        if len(body) <= budget:
            break
        body = _render_steps(ep, n - 1, cap)
    if len(body) > budget:                                      # still too long: keep the most recent part
        body = "[earlier steps omitted]\n" + body[len(body) - max(budget - 30, 0):]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": head + body + "\n" + tail}]


# ----------------------------------------------------------------------------- parsing

def _json_objects(text):
    """Every JSON object that decodes from some '{' in `text`, in order (trailing commas tolerated)."""
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        for chunk in (text[m.start():], re.sub(r",\s*([}\]])", r"\1", text[m.start():])):
            try:
                obj, _ = dec.raw_decode(chunk)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj
                break


def _clean(value):
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = " ".join(value)
    return " ".join(value.split()) if isinstance(value, str) else None


def _shorten(skill):
    if len(skill) <= MAX_SKILL_CHARS:
        return skill
    cut = skill[:MAX_SKILL_CHARS]
    end = max(cut.rfind(". "), cut.rfind("! "), cut.rfind("? "))
    return cut[:end + 1] if end > MAX_SKILL_CHARS // 3 else cut[:cut.rfind(" ")].rstrip(",;:") + "..."


def _trivial(skill):
    """-> why a (cleaned) skill string is unusable, or "" when it is a real skill."""
    bare = skill.strip(" .\"'<>").lower()
    echo = skill.startswith("<") and skill.endswith(">")              # the prompt's own placeholder
    if echo or bare in PLACEHOLDERS or len(bare) < 12 or len(bare.split()) < 3:
        return "empty or trivial; write a real, specific skill"
    if sum(c.isalpha() for c in skill) < len(skill) / 2:
        return "must be plain English sentences"
    return ""


def _step_skills(raw, cap, n_steps=None, lenient=False):
    """The "step_skills" object -> {step: skill}, as the authors' parse: a key is a step number (0-based; an
    int or a string of one), a step outside the episode (0 <= step < n_steps) or a key that is not a number
    is dropped, and so is a value that is not a usable sentence; the first `cap` kept, in the answer's order.
    Anything but an object gives {}."""
    out = {}
    for key, value in (raw.items() if isinstance(raw, dict) else ()):
        try:
            step = int(str(key).strip())
        except ValueError:
            continue
        text = _clean(value)
        if len(out) >= cap or step in out or step < 0 or (n_steps is not None and step >= n_steps):
            continue
        if text and (lenient or not _trivial(text)):
            out[step] = _shorten(text)
    return out


def _parse(text, lenient=False, skill_mode="episode_only", max_step_skills=0, n_steps=None):
    """-> (dict or None, reason for the corrective message). `lenient`: any non-empty skill passes."""
    if not isinstance(text, str) or not text.strip():
        return None, "the answer was empty"
    objs = list(_json_objects(text))
    if not objs:
        return None, "no JSON object was found"
    cap = max_step_skills if skill_mode != "episode_only" else 0
    if skill_mode == "step_only":
        for obj in objs:
            if "step_skills" in obj:
                steps = _step_skills(obj["step_skills"], cap, n_steps, lenient)
                if not steps:
                    return None, '"step_skills" held no usable step skill'
                summary = _clean(obj.get("episode_summary", "")) or ""
                return {"episode_summary": summary, "episode_skill": "", "step_skills": steps}, ""
        return None, 'the JSON object had no "step_skills" key'
    for obj in objs:
        if "episode_skill" not in obj:
            continue
        skill, summary = _clean(obj["episode_skill"]), _clean(obj.get("episode_summary", ""))
        if skill is None:
            return None, '"episode_skill" must be a string'
        why = "" if lenient and skill else _trivial(skill)
        if why:
            return None, f'"episode_skill" was {why}'
        return {"episode_summary": summary or "", "episode_skill": _shorten(skill),
                "step_skills": _step_skills(obj.get("step_skills"), cap, n_steps, lenient)}, ""
    return None, 'the JSON object had no "episode_skill" key'


def parse_analysis(text, lenient=False, skill_mode="episode_only", max_step_skills=0, n_steps=None):
    """The analyzer's answer -> {"episode_summary", "episode_skill", "step_skills"} or None. Tolerates code
    fences and text around the JSON (the first object with an "episode_skill" key wins; "step_skills" in
    step_only mode); rejects a missing, empty, placeholder or trivial skill (fewer than 3 words / 12
    characters, mostly non-letters). step_skills ({step: sentence}, {} in episode_only mode) follow
    _step_skills' rules with `max_step_skills` and the episode's `n_steps`; step_only needs one. Never evals,
    never raises. `lenient=True` is Stage 1's label filter (the authors' pipeline): any non-empty skill
    string is kept."""
    return _parse(text, lenient, skill_mode, max_step_skills, n_steps)[0]


# ----------------------------------------------------------------------------- the live analyzer (pi_old)

def fit_prompt(episode, tokenizer, max_prompt_tokens, skill_mode="episode_only", max_step_skills=0):
    """The analysis prompt both stages use (Stage-1 examples and labels, Stage-2 `analyze`): the whole episode
    when its chat ids fit `max_prompt_tokens` (the analyzer's own budget, 16,384 tokens by default as the
    authors' analysis context), else shrunk by analysis_prompt's rule (old observations first) until it fits."""
    msgs = analysis_prompt(episode, None, skill_mode, max_step_skills)
    chars = len(msgs[1]["content"])
    for _ in range(8):
        n = len(prompt_ids(episode, tokenizer, msgs))
        if n <= max_prompt_tokens:
            break
        chars = int(chars * max_prompt_tokens / n * 0.95)
        msgs = analysis_prompt(episode, chars, skill_mode, max_step_skills)
    return msgs


def prompt_ids(episode, tokenizer, msgs):
    """The chat ids of an analysis conversation; for a visual episode an ImagePrompt with the images its
    markers show (the most recent steps': trimming drops the oldest observations first)."""
    images = step_images(episode)
    if not images:
        return rollout.chat_ids(tokenizer, msgs)
    shown = sum(m["content"].count(IMAGE) for m in msgs)
    return vision.encode(vision.load_processor(tokenizer.name_or_path), msgs, images[len(images) - shown:])


def answer_room(max_tokens, retries):
    """Context an analysis needs beyond its prompt: the answer, plus per corrective retry the bad answer kept
    in the conversation, the corrective message (< 96 tokens) and a new answer."""
    return (retries + 1) * max_tokens + 96 * retries


def analysis_budget(model_path, max_prompt_tokens, max_tokens, retries=0):
    """-> (the analyzer's prompt budget, the context one analysis needs: that budget + answer_room).
    The model's own context (config.max_position_embeddings; 8192 for the embedded SmolLM2-135M) caps it:
    vLLM refuses a longer max_model_len, so the prompt budget shrinks to fit, with a notice."""
    from transformers import AutoConfig
    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    room = answer_room(max_tokens, retries)
    if limit and max_prompt_tokens + room > limit:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"[analyzer] the model's context is {limit} tokens: the analyzer's prompt budget is "
                  f"{limit - room} (asked {max_prompt_tokens}, plus {room} for its answers)", flush=True)
        max_prompt_tokens = limit - room
    if max_prompt_tokens < 256:
        fail(f"the analyzer's answers ({room} tokens) leave {max_prompt_tokens} of the model's context for the "
             f"episode; lower --analyzer_max_tokens or --analyzer_retries")
    return max_prompt_tokens, max_prompt_tokens + room


def analyze(engine, tokenizer, episodes, max_tokens=1024, retries=0, max_prompt_tokens=None,
            skill_mode="episode_only", max_step_skills=0):
    """Greedy analysis of every episode by the snapshot, batched: one `engine.generate` call over all episodes
    (the authors' Stage 2: one greedy generation, no retries); with `retries` > 0, a failed parse gets the bad
    answer back plus a corrective message, up to `retries` more rounds over the episodes still unparsed.
    Sets ep.summary / ep.skill (None when it never parsed, or in step_only mode) and ep.step_skills.
    -> {"episodes", "parsed", "parse_failures", "parse_failure_rate", "first_try_failures", "generate_calls"}.
    `engine` is any object with rollout's engine interface, generate(prompt_ids_list, temperature, max_tokens,
    n) -> [(token_ids, logprobs)] (rollout.VLLMEngine, rollout.HFEngine). Each episode is read whole up to
    `max_prompt_tokens` (fit_prompt), never beyond what the engine's max_model_len leaves after `answer_room`
    (the default budget)."""
    room = getattr(engine, "max_model_len", 4096) - answer_room(max_tokens, retries)
    max_prompt_tokens = room if max_prompt_tokens is None else min(max_prompt_tokens, room)
    if max_prompt_tokens < 256:
        raise ValueError(f"max_tokens={max_tokens} with {retries} retries leaves {max_prompt_tokens} prompt "
                         f"tokens for the analysis; raise the engine's max_model_len or lower max_tokens")
    convs = [fit_prompt(ep, tokenizer, max_prompt_tokens, skill_mode, max_step_skills) for ep in episodes]
    for ep in episodes:
        ep.summary, ep.skill, ep.step_skills = None, None, {}
    pending, first_fail, calls = list(range(len(episodes))), 0, 0
    for attempt in range(retries + 1):
        if not pending:
            break
        outs = engine.generate([prompt_ids(episodes[i], tokenizer, convs[i]) for i in pending],
                               temperature=0.0, max_tokens=max_tokens, n=1)
        calls += 1
        still = []
        for i, (ids, _) in zip(pending, outs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            parsed, why = _parse(text, False, skill_mode, max_step_skills, episodes[i].length)
            if parsed:
                ep = episodes[i]
                ep.summary, ep.skill, ep.step_skills = (parsed["episode_summary"], parsed["episode_skill"] or None,
                                                        parsed["step_skills"])
            else:
                if step_images(episodes[i]):
                    text = text.replace(IMAGE, "[image]")   # kept in the conversation as text
                convs[i] = convs[i] + [{"role": "assistant", "content": text},
                                       {"role": "user", "content": CORRECTION.format(why=why)}]
                still.append(i)
        first_fail += len(still) if attempt == 0 else 0
        pending = still
    n = len(episodes)
    return {"episodes": n, "parsed": n - len(pending), "parse_failures": len(pending),
            "parse_failure_rate": len(pending) / max(n, 1), "first_try_failures": first_fail,
            "generate_calls": calls}


def self_analyze(engine, tokenizer, episodes, cfg, progress=False, chunk=32):
    """Stage 2's analyzer (Section 3.3): the snapshot analyzes every episode of an update with `analyze` (one
    greedy generation, --analyzer_retries corrective retries), each read whole up to --analyzer_max_prompt_tokens
    (capped by what the engine holds), `chunk` episodes per batched call.
    -> {"episodes", "parse_failures", "first_try_failures"} summed over the chunks."""
    from tqdm import tqdm
    stats = {"episodes": 0, "parse_failures": 0, "first_try_failures": 0}
    for i in tqdm(range(0, len(episodes), chunk), desc="analyze", disable=None if progress else True,
                  leave=False):   # None: off when stderr is a file
        st = analyze(engine, tokenizer, episodes[i:i + chunk], max_tokens=cfg.analyzer_max_tokens,
                     retries=cfg.analyzer_retries, max_prompt_tokens=cfg.analyzer_max_prompt_tokens,
                     skill_mode=cfg.skill_mode, max_step_skills=cfg.max_step_skills)
        stats = {k: stats[k] + st[k] for k in stats}
    return stats


# ----------------------------------------------------------------------------- the scripted annotator

def _key_steps(plan, cap=12):
    """An expert plan without the detours: runs of repeats collapsed, a move followed by another move
    dropped (only the last "go to" before an interaction matters), cut to `cap` items."""
    steps = []
    for a in plan:
        a = str(a).strip()
        if not a:
            continue
        if steps and steps[-1][0] == a:
            steps[-1][1] += 1
        elif steps and a.startswith("go to ") and steps[-1][0].startswith("go to ") and steps[-1][1] == 1:
            steps[-1][0] = a
        else:
            steps.append([a, 1])
    out = [a if k == 1 else f"{a} (x{k})" for a, k in steps]
    return out if len(out) <= cap else out[:cap - 1] + ["...", out[-1]]


def scripted_analysis(episode, max_steps=None, max_step_skills=0, oracle=False):
    """Stage-1 analysis written from the env's own knowledge, no model: a workflow from
    episode.info["expert_plan"] for a success; for a failure, an avoidance rule from what went wrong
    (invalid actions, repeated actions, running out of steps: pass the env's `max_steps`, else
    episode.info["max_steps"] is used when present) plus the expert's key steps; and up to
    `max_step_skills` step skills (scripted_step_skills). A failure in a hidden-object room (the CPU testbed)
    names only what the episode saw, unless `oracle` (seed.py --teacher oracle): then the route, which knows
    where the object lay.
    -> {"episode_summary", "episode_skill", "step_skills"}."""
    ep, plan = episode, _key_steps(episode.info.get("expert_plan") or [])
    route, task = " -> ".join(plan), episode.task.strip().rstrip(".")
    if ep.won:
        summary = f"The agent completed the task '{task}' in {ep.length} steps."
        skill = (f"For tasks like '{task}', follow this workflow: {route}." if plan else
                 f"For tasks like '{task}', repeat what worked: "
                 + " -> ".join(_key_steps([s.action for s in ep.steps if s.valid])) + ".")
        return {"episode_summary": summary, "episode_skill": skill,
                "step_skills": scripted_step_skills(ep, max_step_skills)}
    invalid = [s for s in ep.steps if not s.valid]
    acts = Counter(s.action for s in ep.steps if s.valid and s.action)
    loop = next(((a, k) for a, k in acts.most_common(1) if k >= 3), None)
    max_steps = max_steps or ep.info.get("max_steps")
    problems, rules = [], []
    if invalid:
        problems.append(f"{len(invalid)} of {ep.length} responses were invalid actions")
        rules.append("always reason and then give exactly one action in the format the prompt asks for")
    if loop:
        problems.append(f"the action '{loop[0]}' was repeated {loop[1]} times")
        rules.append(f"do not repeat '{loop[0]}' when it does not change the situation")
    if max_steps and ep.length >= max_steps:
        problems.append(f"all {max_steps} steps ran out")
        rules.append("move toward the goal directly instead of exploring at random")
    if not problems:
        problems.append(f"the goal was not reached in {ep.length} steps")
        rules.append("check that each action brings you closer to the goal")
    summary = f"The agent failed the task '{task}': " + "; ".join(problems) + "."
    skill = "Avoid this failure: " + "; ".join(rules) + "."
    unseen = None
    if plan and ep.info.get("hidden") and not oracle:   # a CPU-testbed room (alfworld_gen.py --hidden): name only what was seen
        import testbed
        unseen = testbed.hidden_hindsight(ep, plan)
    if unseen:
        skill += " " + unseen
    elif plan:
        skill += f" Instead, the key steps are: {route}."
    return {"episode_summary": summary, "episode_skill": skill,
            "step_skills": scripted_step_skills(ep, max_step_skills)}



MOVES = ("go to ", "look", "inventory", "examine ", "help")   # ALFWorld actions that change nothing by themselves


def scripted_step_skills(episode, cap):
    """Step skills (0-based step -> one imperative sentence) from what the episode did, at most `cap`, in step
    order. A failure: the first step where the agent left the expert plan (while it had followed it so far,
    the state is the plan's, so the plan's move is the right one there), every invalid response, and every
    repeat of the previous action. A success: its key moves, the valid actions of the plan that are not
    moves or looks."""
    ep, plan = episode, [str(a).strip() for a in episode.info.get("expert_plan") or []]
    found = {}
    if ep.won:
        for t, s in enumerate(ep.steps):
            if s.valid and s.action in plan and not s.action.startswith(MOVES):
                found[t] = f"Do '{s.action}' now: it is the key step of the workflow at this point."
        return dict(sorted(found.items())[:cap])
    acts = [s.action if s.valid else None for s in ep.steps]
    off = next((t for t, a in enumerate(acts) if t < len(plan) and a != plan[t]), None)
    if off is not None:
        found[off] = f"Do '{plan[off]}' at this step: it is the expert's next action from here."
    for t, s in enumerate(ep.steps):
        if not s.valid:
            found.setdefault(t, "Reason briefly, then give exactly one action in the format the prompt asks for.")
        elif t and s.action and s.action == acts[t - 1]:
            found.setdefault(t, f"Do not repeat '{s.action}': it did not change anything; choose another action.")
    return dict(sorted(found.items())[:cap])


# ----------------------------------------------------------------------------- the external analyzer

class ExternalAnalyzer:
    """Client of any OpenAI-compatible chat endpoint (POST {base_url}/chat/completions, temperature 0): the
    Stage-1 annotator. base_url is the API root, e.g. "http://127.0.0.1:8000/v1". The key is read from the
    environment variable `api_key_env` (optional for local servers) and never printed. Each request: `timeout`
    seconds, up to `retries` retries with exponential backoff on connection errors, timeouts, 429 and 5xx (5
    attempts, as the authors' --skill-retries 5); then a RuntimeError naming the URL. One request per episode
    (the authors' pipeline); `parse_retries` > 0 adds corrective follow-ups on an answer that does not parse.
    Up to `max_tokens` new tokens (the authors' 1,024). `concurrency` requests run at once."""

    def __init__(self, base_url, model, api_key_env="SEED_ANALYZER_KEY", timeout=60, retries=4,
                 concurrency=8, backoff=1.0, max_tokens=1024, parse_retries=0, skill_mode="episode_only",
                 max_step_skills=0):
        self.url = base_url.rstrip("/")
        if not self.url.endswith("/chat/completions"):
            self.url += "/chat/completions"
        self.model, self.timeout, self.retries = model, timeout, retries
        self.concurrency, self.backoff, self.max_tokens = concurrency, backoff, max_tokens
        self.parse_retries, self.skill_mode, self.max_step_skills = parse_retries, skill_mode, max_step_skills
        self.api_key_env = api_key_env     # the key itself is read per request and kept nowhere
        self._local = threading.local()

    def _session(self):
        import requests
        if not hasattr(self._local, "s"):
            self._local.s = requests.Session()
        return self._local.s

    def chat(self, messages):
        """One completion text, with retries and backoff."""
        import requests
        headers = {"Content-Type": "application/json"}
        if os.environ.get(self.api_key_env):
            headers["Authorization"] = "Bearer " + os.environ[self.api_key_env]
        body = {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": self.max_tokens}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                r = self._session().post(self.url, json=body, headers=headers, timeout=self.timeout)
            except requests.Timeout:
                last = f"no answer within {self.timeout} s"
                continue
            except requests.ConnectionError as e:
                last = f"connection failed ({type(e).__name__})"
                continue
            if r.status_code == 429 or r.status_code >= 500:
                last = f"HTTP {r.status_code}"
                continue
            if r.status_code != 200:
                raise RuntimeError(f"analyzer endpoint {self.url} refused the request: HTTP {r.status_code} "
                                   f"{r.text[:200]!r}" + (f" (check the API key in ${self.api_key_env})"
                                                          if r.status_code in (401, 403) else ""))
            try:
                return r.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError):
                last = "malformed response body"
        raise RuntimeError(f"analyzer endpoint {self.url} unreachable after {self.retries + 1} attempts "
                           f"(last error: {last})")

    def _one(self, msgs):
        for _ in range(self.parse_retries + 1):
            text = self.chat(msgs)
            parsed, why = _parse(text, True, self.skill_mode, self.max_step_skills)
            if parsed:
                return parsed
            msgs = msgs + [{"role": "assistant", "content": text},
                           {"role": "user", "content": CORRECTION.format(why=why)}]
        return None

    def annotate(self, prompts, progress=True):
        """`prompts`: one analysis prompt (chat messages, `fit_prompt`) per episode. -> one
        {"episode_summary", "episode_skill", "step_skills"} (a non-empty skill) or None per prompt, in order."""
        from tqdm import tqdm
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(tqdm(pool.map(self._one, prompts), total=len(prompts), desc="external analyzer",
                             disable=None if progress else True))


# ----------------------------------------------------------------------------- the skill library

SKILL_FILE = "skills.jsonl"    # the skill library that sft.py writes next to its checkpoint


def task_key(env_name, task, first_observation=""):
    """The text a library entry is filed and looked up by: the task text; for an env whose task text is the same in
    every task (its class's observation_in_task_key: Sokoban), the task followed by the first observation."""
    return f"{task}\n{first_observation}".strip() if envs.env_class(env_name).observation_in_task_key else task


def episode_key(ep):
    """task_key of a collected episode (its first step's observation is the env's reset observation)."""
    return task_key(ep.env, ep.task, ep.steps[0].observation if ep.steps else "")


def words(text):
    """The library's tokenizer: lower-cased runs of letters or digits, and every other non-space character
    on its own, so numbers and one-character values (EZPoints' card values 2-9, Sokoban's board symbols)
    count; bm25s.tokenize drops one-character tokens."""
    return re.findall(r"[a-z0-9]+|[^\sa-z0-9]", str(text).lower())


class SkillLibrary:
    """Stage-1 skills, one JSON line each: {"env", "family", "task", "skill"} ("task": task_key's text).
    `retrieve` serves the library baselines (seed.Algo skills="library"): among the env's skills the same family
    first (any family when it has none), in it an entry with the same task text (whitespace aside), else the best
    BM25 match of the task text over `words`."""

    def __init__(self, entries=None):
        self.entries = list(entries or [])
        self._index = {}

    def add(self, env, family, task, skill):
        if skill:
            self.entries.append({"env": env, "family": family, "task": task, "skill": skill})
            self._index.clear()

    def save(self, path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            for e in self.entries:
                f.write(json.dumps(e) + "\n")

    @classmethod
    def load(cls, path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"skill library {path} not found (Stage 1 writes it)")
        with open(path) as f:
            return cls(json.loads(line) for line in f if line.strip())

    def retrieve(self, env, family, task_text):
        """-> the skill of the exact or best-matching entry (task_text: task_key's text), or None when the
        env has none."""
        import bm25s
        pool = [e for e in self.entries if e["env"] == env]
        same = [e for e in pool if e["family"] == family]
        pool = same or pool
        if not pool:
            return None
        norm = lambda t: " ".join(str(t).split())
        exact = next((e for e in pool if norm(e["task"]) == norm(task_text)), None)
        if exact:
            return exact["skill"]
        key = (env, family if same else None)
        if key not in self._index:
            bm = bm25s.BM25()
            bm.index([words(e["task"]) or ["<empty>"] for e in pool], show_progress=False)
            self._index[key] = bm
        q = words(task_text)
        if not q:
            return pool[0]["skill"]
        docs, scores = self._index[key].retrieve([q], k=1, show_progress=False)
        return pool[int(docs[0, 0]) if scores[0, 0] > 0 else 0]["skill"]   # no shared word: the first

    def for_tasks(self, env, task_ids):
        """One skill per task of `env`'s split (the env is reset once per task to read its text and family)."""
        out = []
        for t in task_ids:
            obs, _ = env.reset(seed=int(t))
            out.append(self.retrieve(env.name, env.family, task_key(env.name, env.task, obs)))
        return out
