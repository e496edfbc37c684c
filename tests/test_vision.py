"""Visual agents (Appendix C.3): image observations, multimodal prompts, log-probs with the vision inputs,
re-scoring and the weight push, on a tiny Qwen2.5-VL with random weights built here (tests/tiny_vl.py: no
download). The rollout engine is the HF one: vLLM's CPU build cannot load Qwen2.5-VL without torchvision
(docs/design-notes.md, visual agents)."""
import numpy as np
import pytest
import torch

import analyzer
import envs
import grpo
import opd
import rollout
import vision
from tiny_vl import build


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("tiny-vl") / "model"))


@pytest.fixture(scope="session")
def vl(tiny_vl):
    model, tok, _ = rollout.load_model(tiny_vl)
    return model.eval(), tok


def test_image_envs_mark_their_images():
    for name in ("sokoban", "ezpoints"):
        text_env, img_env = envs.make(name), envs.make(name, image=True)
        text_env.reset(seed=3)
        img_env.reset(seed=3)
        assert envs.IMAGE not in text_env.prompt()
        assert img_env.prompt().count(envs.IMAGE) == len(img_env.prompt_images()) == 1
        assert img_env.prompt_images()[0].dtype == np.uint8
    ez = envs.make("ezpoints", image=True)
    ez.reset(seed=0)
    assert "of" not in ez.task.split("cards")[-1]           # no card named in the visual task
    before = ez.prompt_images()[0]
    ez.step('{"thoughts": "", "action": "%s"}' % ez.expert_action())
    assert (ez.prompt_images()[0] != before).any()          # the formula is drawn too
    other = envs.make("ezpoints", image=True)
    other.reset(seed=1)
    assert other.cards != ez.cards and (other.prompt_images()[0] != before).any()
    sk = envs.make("sokoban", image=True)
    sk.reset(seed=0)
    assert sk.prompt_images()[0].shape == (96, 96, 3)


def test_encode_expands_one_placeholder_per_visual_token(tiny_vl):
    proc = vision.load_processor(tiny_vl)
    img = np.random.default_rng(0).integers(0, 255, (96, 96, 3), dtype=np.uint8)
    ids = vision.encode(proc, f"two boards {envs.IMAGE} and {envs.IMAGE} end", [img, img])
    grid = proc.pixels([img])["image_grid_thw"][0]                           # 96 px -> 84 px -> 6x6 patches
    per_image = int(grid.prod()) // proc.merge ** 2
    assert ids.count(proc.image_token_id) == 2 * per_image == 18
    assert vision.collapsed(ids).count(proc.image_token_id) == 2
    assert len(ids.images) == 2 and isinstance(ids.images[0], bytes)
    with pytest.raises(ValueError, match="image marker"):
        vision.encode(proc, f"one {envs.IMAGE}", [img, img])


def _collect(engine, tok, n=2, max_tokens=6, seed=0):
    es = [envs.make("sokoban", image=True, max_steps=2) for _ in range(n)]
    return rollout.collect(engine, tok, es, [seed], n, temperature=1.0, max_tokens=max_tokens, progress=False)


def _max_gap(model, tok, steps):
    lp, _, _ = grpo.response_logprobs(model, [s.prompt_ids for s in steps], [s.response_ids for s in steps],
                                      tok.pad_token_id)
    ref = torch.zeros_like(lp)
    for i, s in enumerate(steps):
        ref[i, :len(s.engine_logprobs)] = torch.tensor(s.engine_logprobs)
    return float((lp - ref).abs().max())


def test_vllm_without_torchvision_stops_naming_the_problem(tiny_vl):
    import importlib.util
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: vLLM can load the model (tests/vl_sync.py covers it on GPUs)")
    with pytest.raises(SystemExit, match="torchvision"):
        rollout.make_engine("vllm", tiny_vl)


def test_image_ezpoints_collects_with_the_drawn_cards(tiny_vl, vl):
    model, tok = vl
    engine = rollout.make_engine("hf", tiny_vl, dtype="float32", seed=1, max_model_len=1024)
    es = [envs.make("ezpoints", image=True, max_steps=2) for _ in range(2)]
    steps = [s for ep in rollout.collect(engine, tok, es, [7], 2, max_tokens=6, progress=False) for s in ep.steps]
    assert steps and all(len(s.prompt_ids.images) == 1 for s in steps)
    assert _max_gap(model, tok, steps) < 1e-4


def test_hf_engine_logprobs_equal_trainer_on_image_prompts_before_and_after_push(tiny_vl, vl):
    """Collect on image Sokoban; the engine's log-probs of the sampled tokens equal the trainer's (with the
    pixel values and image grids in the forward); a changed vision tower breaks that, a push restores it."""
    model, tok = vl
    torch.manual_seed(0)
    engine = rollout.make_engine("hf", tiny_vl, dtype="float32", seed=0, max_model_len=1024)
    episodes = _collect(engine, tok)
    steps = [s for ep in episodes for s in ep.steps]
    assert steps and all(isinstance(s.prompt_ids, vision.ImagePrompt) for s in steps)
    assert all(len(s.prompt_ids.images) == 1 for s in steps)
    assert _max_gap(model, tok, steps) < 1e-4
    # the images matter: another board gives other log-probs
    s = steps[0]
    other = vision.ImagePrompt(s.prompt_ids, [np.zeros((96, 96, 3), np.uint8)], s.prompt_ids.source)
    a, _, _ = grpo.response_logprobs(model, [s.prompt_ids], [s.response_ids], tok.pad_token_id)
    b, _, _ = grpo.response_logprobs(model, [other], [s.response_ids], tok.pad_token_id)
    assert float((a - b).abs().max()) > 1e-4
    # change the trainer's vision tower and LM: the engine lags until the push
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(0.05 * torch.randn_like(p))
        assert any("visual" in n for n, _ in rollout.stream_weights(model, torch.float32))
        steps2 = [s for ep in _collect(engine, tok, seed=1) for s in ep.steps]
        assert _max_gap(model, tok, steps2) > 1e-3
        engine.push_weights(model)
        steps3 = [s for ep in _collect(engine, tok, seed=2) for s in ep.steps]
        assert _max_gap(model, tok, steps3) < 1e-4
    finally:
        model.load_state_dict(saved)


def test_rescore_keeps_the_images_and_inserts_the_skill_as_text(tiny_vl, vl):
    model, tok = vl
    engine = rollout.make_engine("hf", tiny_vl, dtype="float32", seed=3, max_model_len=1024)
    steps = [s for ep in _collect(engine, tok) for s in ep.steps]
    skill = "Push the box toward the target from the side opposite to it."
    plain = opd.rescore(model, tok, steps, [None] * len(steps))
    with_skill = opd.rescore(model, tok, steps, [skill] * len(steps))
    ids = opd.skill_prompt_ids(tok, steps[0], skill)
    assert ids.images == steps[0].prompt_ids.images and len(ids) > len(steps[0].prompt_ids)
    for i, s in enumerate(steps):
        n = len(s.response_ids)
        assert torch.allclose(plain[i, :n], torch.tensor(s.engine_logprobs), atol=1e-4)
    assert float((with_skill - plain).abs().max()) > 1e-4


def test_analysis_prompt_carries_the_episode_images(tiny_vl, vl):
    """The analyzer in visual mode: every step's observation is its image, within the token budget (the
    oldest observations are trimmed first, and their images go with them)."""
    model, tok = vl
    engine = rollout.make_engine("hf", tiny_vl, dtype="float32", seed=5, max_model_len=2048)
    es = [envs.make("sokoban", image=True, max_steps=3) for _ in range(2)]
    episodes = rollout.collect(engine, tok, es, [4], 2, temperature=1.0, max_tokens=4, progress=False)
    ep = episodes[0]
    assert ep.length == 3 and len(analyzer.step_images(ep)) == 3
    msgs = analyzer.fit_prompt(ep, tok, 4096)
    ids = analyzer.prompt_ids(ep, tok, msgs)
    assert msgs[1]["content"].count(envs.IMAGE) == 3 and ids.images == analyzer.step_images(ep)
    whole = len(ids)
    small = analyzer.fit_prompt(ep, tok, whole - 5)
    cut = analyzer.prompt_ids(ep, tok, small)
    assert len(cut) <= whole - 5 and len(cut.images) < 3
    assert cut.images == analyzer.step_images(ep)[3 - len(cut.images):]              # the most recent ones
    text_ep = rollout.Episode(task_id=0, group_id=0, env="sokoban", task=ep.task, steps=[
        rollout.Step(s.prompt_text, list(s.prompt_ids), s.response_ids, s.response_text, s.engine_logprobs,
                     s.observation, s.action, s.valid) for s in ep.steps])
    assert envs.IMAGE not in analyzer.analysis_prompt(text_ep)[1]["content"]          # text episodes as before
    seen = []
    generate = engine.generate
    engine.generate = lambda prompts, *a, **kw: seen.extend(prompts) or generate(prompts, *a, **kw)
    stats = analyzer.analyze(engine, tok, episodes, max_tokens=8)
    assert stats["episodes"] == 2 and all(len(p.images) == 3 for p in seen)


@pytest.mark.parametrize("algo", ["seed", "grpo"])
def test_one_update_through_seed_on_image_sokoban(tiny_vl, tmp_path, monkeypatch, algo):
    """One update of seed.py on image Sokoban with the tiny VL model and the HF engine. The random-weight
    analyzer never writes JSON, so its parse is replaced by a fixed skill (a stand-in for a trained
    analyzer): re-scoring and the OPD term then run on image rows."""
    import json
    import seed
    monkeypatch.setattr(analyzer, "_parse", lambda text, lenient=False, *mode: (
        {"episode_summary": "s", "episode_skill": "Push the box toward the target, never into a corner.",
         "step_skills": {}}, ""))
    out = str(tmp_path / algo)
    seed.main(["--env", "sokoban", "--image", "--model", tiny_vl, "--init", "", "--algo", algo, "--out", out,
               "--engine", "hf", "--updates", "1", "--tasks_per_update", "1", "--group_size", "2",
               "--max_steps", "2", "--max_tokens", "8", "--micro_batch_size", "2", "--mini_batch_size", "2",
               "--eval_every", "0", "--analyzer_max_tokens", "8", "--analyzer_max_prompt_tokens", "1024"])
    m = [json.loads(x) for x in open(f"{out}/metrics.jsonl")][-1]
    assert m["update"] == 0 and np.isfinite(m["loss/pg"]) and np.isfinite(m["loss/kl"])
    if algo == "seed":
        assert m["skill_rate"] == 1.0 and m["loss/opd"] != 0 and 0 < m["gate/mean"] < 1
    else:
        assert "loss/opd" not in m
    eps = [json.loads(x) for x in open(f"{out}/episodes/update_0000.jsonl")]
    assert len(eps) == 2 and "<image>" in eps[0]["first_prompt"]
    assert vision.is_visual(f"{out}/checkpoint") and vision.load_processor(f"{out}/checkpoint")   # resumable


def test_a_checkpoint_keeps_the_image_processor(tiny_vl, vl, tmp_path):
    """vision.save_image_processor beside tok.save_pretrained: the saved folder encodes images alike; a text
    model's folder gets nothing, and image mode on it stops with a message naming the problem."""
    model, tok = vl
    out = str(tmp_path / "ckpt")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    vision.save_image_processor(tok, out)
    img = np.random.default_rng(1).integers(0, 255, (96, 96, 3), dtype=np.uint8)
    a = vision.encode(vision.load_processor(tiny_vl), f"see {envs.IMAGE}", [img])
    b = vision.encode(vision.load_processor(out), f"see {envs.IMAGE}", [img])
    assert list(a) == list(b) and torch.equal(vision.pixel_inputs([a], "cpu")["pixel_values"],
                                              vision.pixel_inputs([b], "cpu")["pixel_values"])
    text = str(tmp_path / "text")
    tok.save_pretrained(text)
    with pytest.raises(SystemExit, match="no image processor"):
        vision.load_processor(text)
