"""Rollouts and engines (docs/gpu.md): the vLLM engine's weights follow the trainer's,
`collect` records are complete and consistent with both engines, ranks sample different episodes,
and malformed model output becomes invalid steps, never an exception."""
import json
import math
import os
import random
import socket
import subprocess
import sys

import pytest
import torch

import rollout
from conftest import ToyEnv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer_logprobs(model, prompt, response):
    """log-softmax of the trainer's float32 forward pass at the response tokens."""
    ids = torch.tensor([prompt + response])                               # [1, P+R]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]                  # [R, vocab]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_diff(engine, model, prompt):
    """Sample from the engine at temperature 1 and compare its log-probs to the trainer's."""
    [(ids, lps)] = engine.generate([prompt], 1.0, 12)
    return (trainer_logprobs(model, prompt, ids) - torch.tensor(lps)).abs().max().item()


def test_weight_sync(vllm_engine, model_path):
    """float32: equal before an update, stale after an optimizer step without a push, equal after
    push_weights. The prompt (longer than one 128-token KV block) is cached by the first call, so a
    push that left the prefix cache or the prepared LM head stale would fail the last checks."""
    model, tok, _ = rollout.load_model(model_path)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = rollout.chat_ids(tok, "List the rooms of a house and what each one is for. " * 14)
    assert len(prompt) > 128
    assert max_diff(vllm_engine, model, prompt) <= 1e-4

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([prompt[:48]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert max_diff(vllm_engine, model, prompt) > 0.1

    vllm_engine.push_weights(model)
    assert max_diff(vllm_engine, model, prompt) <= 1e-4

    model.load_state_dict(original)  # the session's engine goes back to the base weights
    vllm_engine.push_weights(model)
    assert max_diff(vllm_engine, model, prompt) <= 1e-4


def test_hf_engine_logprobs_and_push(hf_engine, model_path):
    """The fallback's log-probs are the trainer's too (batched, left-padded), and a push copies weights."""
    model, tok, _ = rollout.load_model(model_path)
    prompts = [rollout.chat_ids(tok, "Name a fruit."), rollout.chat_ids(tok, "Count from one to five, please.")]
    outs = hf_engine.generate(prompts, 1.0, 10, n=2)
    assert len(outs) == 4
    for (ids, lps), prompt in zip(outs, [prompts[0]] * 2 + [prompts[1]] * 2):
        assert len(ids) == len(lps) > 0
        assert (trainer_logprobs(model, prompt, ids) - torch.tensor(lps)).abs().max() <= 1e-3
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)
    hf_engine.push_weights(model)
    assert torch.equal(hf_engine.model.model.norm.weight, model.model.norm.weight)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    hf_engine.push_weights(model)


def test_greedy_is_deterministic_and_stops_at_eos(hf_engine, vllm_engine, tokenizer):
    prompt = rollout.chat_ids(tokenizer, "Say yes.")
    for engine in (hf_engine, vllm_engine):
        (a, _), (b, _) = engine.generate([prompt, prompt], 0.0, 16)
        assert a == b
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert eos not in a[:-1] and (a[-1] == eos or len(a) == 16)


class CountingEngine:
    """Counts generate calls of a real engine (one call per turn is part of the contract)."""

    def __init__(self, engine):
        self.engine, self.calls, self.max_model_len = engine, 0, engine.max_model_len

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        self.calls += 1
        return self.engine.generate(prompt_ids_list, temperature, max_tokens, n)


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_collect_records(kind, request, tokenizer):
    engine = CountingEngine(request.getfixturevalue(f"{kind}_engine"))
    tasks, group_size, max_steps = [0, 7], 2, 2
    envs = [ToyEnv(max_steps=max_steps) for _ in range(len(tasks) * group_size)]
    episodes = rollout.collect(engine, tokenizer, envs, tasks, group_size, temperature=1.0, max_tokens=24)
    assert len(episodes) == 4
    assert engine.calls == max(ep.length for ep in episodes)
    for k, (ep, env) in enumerate(zip(episodes, envs)):
        assert ep.group_id == k // group_size and ep.task_id == tasks[k // group_size]
        assert ep.env == "toy" and ep.family == env.family and ep.task == env.task
        assert 1 <= ep.length <= max_steps
        assert ep.won or ep.length == max_steps  # an episode only stops at a win or at max steps
        assert ep.reward == sum(s.reward for s in ep.steps) == (10.0 if ep.won else 0.0)
        assert [s.response_text for s in ep.steps] == env.received
        for s in ep.steps:
            assert s.response_text == tokenizer.decode(s.response_ids, skip_special_tokens=True)
            assert s.prompt_ids == rollout.chat_ids(tokenizer, s.prompt_text)
            assert s.prompt_text.startswith("You are playing") and s.observation in s.prompt_text
            assert len(s.engine_logprobs) == len(s.response_ids) > 0
            assert all(math.isfinite(x) and x <= 0 for x in s.engine_logprobs)
            assert s.valid == (s.action != "")
    by_group = {}
    for ep in episodes:
        by_group.setdefault(ep.group_id, set()).add((ep.task_id, ep.task, ep.family))
    assert all(len(v) == 1 for v in by_group.values()) and len(by_group) == len(tasks)


class ScriptedEngine:
    """Stands in for a model that writes given texts: `reply(prompt_text) -> str`. Used to feed the
    rollout exact (adversarial or expert) responses; everything after generate is the real path."""

    def __init__(self, tokenizer, reply, max_model_len=4096):
        self.tok, self.reply, self.max_model_len = tokenizer, reply, max_model_len
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        out = []
        for ids in prompt_ids_list:
            for _ in range(n):
                reply = self.reply(self.tok.decode(ids))
                toks = reply if isinstance(reply, list) else self.tok.encode(reply, add_special_tokens=False)
                out.append((toks + [self.eos], [-1.0] * (len(toks) + 1)))
        return out


def test_bad_output_becomes_invalid_steps(tokenizer):
    rng = random.Random(0)
    bad = ["", "x" * 10_000, "I would like to guess five.", "<action>guess 5</action> 日本語 😀",
           "<action>guess 1</action><action>guess 2</action>", "<action>jump</action>", "<action>guess 5",
           [rng.randrange(len(tokenizer)) for _ in range(50)]]   # random token ids, specials included
    envs = [ToyEnv(max_steps=3) for _ in bad]
    replies = {}

    def reply(prompt_text):
        k = len(replies)
        replies[k] = bad[k % len(bad)]
        return replies[k]

    episodes = rollout.collect(ScriptedEngine(tokenizer, reply), tokenizer, envs, list(range(len(bad))), 1,
                               progress=False)
    assert all(ep.length == 3 and not ep.won for ep in episodes)
    assert all(not s.valid and s.action == "" and s.reward == 0.0 for ep in episodes for s in ep.steps)
    assert [len(s.response_text) for s in episodes[1].steps] == [10_000] * 3


def test_long_prompts_are_left_truncated_and_counted(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda p: "<action>guess 1</action>", max_model_len=96)
    envs = [ToyEnv(max_steps=2) for _ in range(2)]
    episodes = rollout.collect(engine, tokenizer, envs, [4, 5], 1, max_tokens=16, progress=False)
    for ep in episodes:
        assert ep.info["truncated_prompts"] == ep.length == 2
        for s in ep.steps:
            assert s.prompt_ids == rollout.chat_ids(tokenizer, s.prompt_text)[-80:]
    with pytest.raises(ValueError, match="max_model_len"):
        rollout.collect(engine, tokenizer, envs, [4, 5], 1, max_tokens=96, progress=False)


def test_evaluate_metrics(tokenizer):
    """An expert (middle of the remaining range) wins every task; always guessing 1 wins only task 0."""
    def expert(prompt_text):
        line = [l for l in prompt_text.splitlines() if l.startswith("Current observation:")][-1]
        lo, hi = (int(x) for x in line.rstrip(".").split("between ")[1].split(" and "))
        return f"<think>halve the range</think><action>guess {(lo + hi) // 2}</action>"

    envs = [ToyEnv(max_steps=4) for _ in range(4)]
    tasks = list(range(9))
    res = rollout.evaluate(ScriptedEngine(tokenizer, expert), tokenizer, envs, tasks)
    assert len(res) == 9 and all(won == 1.0 and bad == 0 and reward > 0 and math.isnan(score)
                                 for _, won, _, bad, reward, score in res)     # the toy env reports no score
    m = rollout.eval_metrics(res, "eval/test")
    assert "eval/test/score" not in m
    assert m["eval/test/success"] == m["eval/test/success_macro"] == m["eval/test/success_low"] == 1.0
    assert m["eval/test/success_high"] == 1.0 and 1 <= m["eval/test/length"] <= 4
    assert m["eval/test/invalid_rate"] == 0.0 and m["eval/test/reward"] == pytest.approx(sum(r[4] for r in res) / 9)
    m = rollout.eval_metrics(rollout.evaluate(ScriptedEngine(tokenizer, lambda p: "<action>guess 1</action>"),
                                              tokenizer, envs, tasks), "eval/test")
    assert m["eval/test/success_low"] == 0.25 and m["eval/test/success_high"] == 0.0
    assert m["eval/test/success"] == pytest.approx(1 / 9) and m["eval/test/success_macro"] == pytest.approx(0.125)
    assert m["eval/test/length"] == pytest.approx((1 + 8 * 4) / 9)
    assert math.isnan(rollout.eval_metrics([], "eval/test")["eval/test/success"])   # no tasks: nan, not 0


def _torchrun(script, out):
    """Run tests/<script> <out> under torchrun, 2 ranks on a free port, outside any outer torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = REPO
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           os.path.join(REPO, "tests", script), str(out)]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_two_ranks_sample_different_episodes(tmp_path):
    """torchrun, 2 ranks, gloo, one in-process vLLM engine per rank, same base seed."""
    out = tmp_path / "ranks.json"
    proc = _torchrun("rollout_ranks.py", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["groups"] == [0, 0, 1, 1] for r in ranks)
    assert all(all(all(ok) for ok in r["lengths"]) for r in ranks)
    assert ranks[0]["texts"] != ranks[1]["texts"]


def test_fsdp2_streamed_push_keeps_each_engine_in_sync(tmp_path):
    """The weight-sync check, FSDP2 variant: 2 gloo ranks, a sharded trainer, one float32 engine per rank.
    Equal before an update, stale after an optimizer step, equal after rollout.push; what the engine got
    was a stream of full plain tensors in the same order on both ranks, and the gradients were freed."""
    out = tmp_path / "push.json"
    proc = _torchrun("push_ranks.py", out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["sharded"] == r["params"] > 0                        # every parameter was a DTensor shard
        assert r["before"] <= 1e-4 and r["stale"] > 0.1 and r["after"] <= 1e-4, r
        assert r["grads_freed"]
        assert [n for n, _, _ in r["streamed"]] == list(r["full_shapes"])    # every weight, state_dict order
        assert all(kind == "Tensor" and shape == r["full_shapes"][n] for n, shape, kind in r["streamed"])
    assert ranks[0]["streamed"] == ranks[1]["streamed"]


def test_collect_with_skills_on_a_real_env(vllm_engine, tokenizer):
    """skill_grpo: a task's skill block sits in the actor prompt right after the task line
    (envs.insert_skill), and prompt_ids are the ids of exactly that text; a None skill leaves it plain."""
    import envs
    skill = "Multiply the two card values first when their product is 12."
    envs_ = [envs.make("ezpoints", max_steps=2) for _ in range(4)]
    episodes = rollout.collect(vllm_engine, tokenizer, envs_, [3, 8], 2, skills=[skill, None], max_tokens=16)
    for ep in episodes:
        assert 1 <= ep.length <= 2 and ep.env == "ezpoints"
        for s in ep.steps:
            lines = s.prompt_text.split("\n")
            at = next(i for i, line in enumerate(lines) if line.startswith(envs.task_line("ezpoints")))
            block = [""] + envs.skill_section(envs.EPISODE_SKILL, skill).split("\n") + [""]
            assert (lines[at + 1:at + 6] == block) == (ep.group_id == 0)
            assert (skill in s.prompt_text) == (ep.group_id == 0)
            assert s.prompt_ids == rollout.chat_ids(tokenizer, s.prompt_text)
            assert s.response_text == tokenizer.decode(s.response_ids, skip_special_tokens=True)


def test_engine_leaves_no_rank_in_the_environment(vllm_engine):
    """Subprocesses started later (torchrun, scripts) must not inherit a rank from the test process."""
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)


def test_resumed_hf_engine_samples_what_an_unbroken_one_samples(tmp_path, tokenizer):
    """--resume restores the HF engine's sampling state (HFEngine.rng, saved in trainer_state.pt): after one
    call, a checkpoint and a resume into a fresh engine, calls 2 and 3 sample what an unbroken engine's calls
    2 and 3 sample; a fresh engine without the restore replays call 1. A one-layer model keeps it fast."""
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM
    import runfolder
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=256))
    folder, run_dir = str(tmp_path / "tiny"), str(tmp_path / "run")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    engine = lambda: rollout.make_engine("hf", folder, seed=3, max_model_len=256)
    sample = lambda e: e.generate([[1, 2, 3], [4, 5]], 1.0, 8, n=2)
    unbroken = engine()
    want = [sample(unbroken) for _ in range(3)]
    assert want[1] != want[0]
    first = engine()
    assert sample(first) == want[0]
    opt, data_rng = torch.optim.AdamW(model.parameters()), np.random.default_rng(0)
    os.makedirs(run_dir)
    runfolder.save_checkpoint(run_dir, 1, model, opt, tokenizer, data_rng, first)
    assert sample(engine()) == want[0]                        # not restored: the stream already used
    resumed = engine()
    assert runfolder.resume(run_dir, model, opt, data_rng, resumed) == 1
    assert [sample(resumed) for _ in range(2)] == want[1:]
