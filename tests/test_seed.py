"""The training loop (seed.py) and Stage 1 (sft.py), end to end on CPU with the embedded model.

One tiny pipeline is shared by the checks (module fixtures): generated ALFWorld games -> sft.py (scripted
analyzer, HF engine) -> seed.py --algo seed from that checkpoint, killed during its second update and
resumed; seed.py --algo grpo on Sokoban from the base model; the saved checkpoint reloaded and evaluated.
The distributed checks run one update step on fixed rows (tests/dist_update.py) in one process, under
torchrun with two gloo ranks (DDP), and with --fsdp (FSDP2 fully_shard).
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

import analyzer
import grpo
import envs
import rollout
import runfolder
import seed
import sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
TINY = ["--engine", "hf", "--tasks_per_update", "1", "--group_size", "2", "--max_steps", "2", "--history_length", "1",
        "--max_tokens", "16", "--micro_batch_size", "2"]


def run(args, timeout=1800, **kw):   # generous: the suite shares 2 cores
    p = subprocess.run([PY, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, **kw)
    return p


def lines(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


# ----------------------------------------------------------------------------- configuration (no model)

def test_flags_env_columns_and_overrides():
    cfg = seed.parse_config(["--env", "search"])
    assert (cfg.tasks_per_update, cfg.max_steps, cfg.history_length, cfg.kl_coef, cfg.ent_coef) == (128, 4, 4, 0.001, 0.0)
    cfg = seed.parse_config(["--env", "search", "--kl_coef", "0.05", "--fsdp"])
    assert cfg.kl_coef == 0.05 and cfg.fsdp and cfg.max_steps == 4
    cfg = seed.parse_config([])
    assert (cfg.tasks_per_update, cfg.group_size, cfg.max_steps, cfg.lr, cfg.lambda_opd, cfg.beta_opd) == \
        (16, 8, 30, 1e-6, 0.01, 5.0)
    assert seed.parse_config(["--env", "webshop"]).adv_norm == "mean_norm"


def test_skill_modes_per_env_are_the_authors_launchers():
    """Every entry-point SEED launcher of the authors (examples/seed_trainer/run_*_sft_*_self.sh at 2cf2fad, line 47)
    exports SEED_SKILL_MODE=episode_only before calling _common/<env>.sh, whose episode_step default then never
    applies: episode skills on every env (the step-skill caps, 5, 5, 2, 2, 0, matter only under --skill_mode
    episode_step / step_only). Stage 1 writes its labels in the same mode."""
    want = {"alfworld": ("episode_only", 5), "webshop": ("episode_only", 5), "search": ("episode_only", 2),
            "sokoban": ("episode_only", 2), "ezpoints": ("episode_only", 0)}
    for env, (mode, k) in want.items():
        c = seed.parse_config(["--env", env])
        assert (c.skill_mode, c.max_step_skills, c.skill_teacher_mode) == (mode, k, "step_priority")
        s = runfolder.parse_config(["--env", env], sft.SFTConfig, sft.ENV_DEFAULTS)
        assert (s.skill_mode, s.max_step_skills) == (mode, k)
    assert sft.main.__module__ == "sft" and runfolder.parse_config([], sft.SFTConfig).k0 == 8


def test_launch_defaults_per_env_are_the_authors():
    """_common/<env>.sh at 2cf2fad: validation on 128 tasks, one sample each at T=0.4, every 5 updates and after the
    last (none before training); Search validates its whole test set after its 150th update only, with a 10 %
    warm-up; mini-batches of 256 / 64 / 512 step rows (ppo_mini_batch_size, not multiplied: the actor's rollout.n
    is 1, the group size is env.rollout.n)."""
    want = {"alfworld": (5, 128, 256, 0.0), "webshop": (5, 128, 64, 0.0), "search": (150, 0, 512, 0.1),
            "sokoban": (5, 128, 256, 0.0), "ezpoints": (5, 128, 256, 0.0)}
    for env, w in want.items():
        c = seed.parse_config(["--env", env])
        assert (c.eval_every, c.eval_tasks, c.mini_batch_size, c.lr_warmup) == w, env
        assert (c.eval_temperature, c.eval_first, c.updates, c.tis_cap) == (0.4, False, 150, 0.0)
    c = seed.parse_config(["--env", "search"])
    assert [seed.learning_rate(c, u) for u in (0, 1, 14, 15, 149)] == pytest.approx([0, 1e-6 / 15, 14e-6 / 15, 1e-6, 1e-6])
    assert seed.learning_rate(seed.parse_config([]), 0) == 1e-6        # no warm-up: constant from update 0


def test_truncated_importance_sampling_weights_grpo_by_the_capped_ratio(smol):
    """--tis_cap C multiplies GRPO's per-token loss by min(exp(lp_old - lp_engine), C) (detached): tokens the engine
    sampled 0.5 nats less likely than pi_old get e^0.5, those 2 nats less likely get the cap; off (0) it is plain
    GRPO, whatever the engine's log-probs."""
    from types import SimpleNamespace
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_update import fixed_rows
    model, tok = smol
    rows = fixed_rows(model, n=4)
    rows.engine = [o - (0.5 if i % 2 else 2.0) for i, o in enumerate(rows.old)]
    lens = [len(r) for r in rows.responses]
    with torch.no_grad():
        lp, mask, _ = grpo.response_logprobs(model, rows.prompts, rows.responses, tok.pad_token_id)   # [4, R]
    old = grpo.pad(rows.old, lp.shape[1])
    pg = grpo.policy_loss(lp, old, rows.adv, mask)                                                   # [4, R]
    w = torch.tensor([3.0 if i % 2 == 0 else math.exp(0.5) for i in range(4)])[:, None]              # [4, 1]
    for cap, weight in ((0.0, 1.0), (3.0, w)):
        cfg = seed.Config(algo="grpo", kl_coef=0.0, ent_coef=0.0, tis_cap=cap, dtype="float32")
        run = SimpleNamespace(cfg=cfg, model=model, tok=tok, world=1, device=torch.device("cpu"))
        value, _, _ = seed.micro_loss(run, rows, float(sum(lens)), 0.0)
        assert float(value.detach()) == pytest.approx(float((pg * weight * mask).sum()) / sum(lens), rel=1e-4)


def test_stage1_defaults_are_the_authors():
    c = runfolder.parse_config([], sft.SFTConfig)
    assert (c.tasks, c.k0, c.temperature, c.val_fraction, c.lr, c.warmup_ratio, c.batch_size, c.epochs) == \
        (180, 8, 0.4, 0.1, 5e-6, 0.1, 8, 3) and sft.BETAS == (0.9, 0.95)
    assert (c.analyzer_max_prompt_tokens, c.analyzer_max_tokens) == (16384, 1024)
    c = runfolder.parse_config(["--env", "sokoban"], sft.SFTConfig, sft.ENV_DEFAULTS)
    assert (c.temperature, c.lr, c.max_steps) == (1.0, 2e-6, 15)


def test_stage1_draws_m_over_6_tasks_per_alfworld_family(tmp_path):
    """On 12 generated games (2 of each family): M/6 per family, distinct games while a family has enough,
    the same draw for the same seed; an env without families gets a plain draw of distinct tasks."""
    import numpy as np
    from envs.alfworld import FAMILIES, family_of
    p = run(["-m", "envs.alfworld_gen", "--out", str(tmp_path), "--train", "12", "--valid_seen", "0",
             "--valid_unseen", "0", "--seed", "0", "--workers", "1"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    probe = envs.make("alfworld", data_dir=str(tmp_path), split="train")
    for m in (12, 18):
        tasks = sft.draw_tasks(probe, m, np.random.default_rng(0))
        fams = [family_of(probe.games[t]) for t in tasks]
        assert len(tasks) == m and all(fams.count(f) == m // 6 for f in FAMILIES.values())
        assert len(set(tasks)) == min(m, 12)
    assert sft.draw_tasks(probe, 18, np.random.default_rng(0)) == tasks                  # seeded
    plain = sft.draw_tasks(envs.make("sokoban"), 20, np.random.default_rng(0))
    assert len(set(plain)) == 20


@pytest.mark.parametrize("flags, words", [
    (["--env", "nope"], "unknown --env"),
    (["--algo", "ppo"], "unknown --algo"),
    (["--env", "sokoban", "--init", "/no/such/ckpt"], "--init /no/such/ckpt"),
    (["--data_dir", "/no/such/dir"], "--data_dir /no/such/dir"),
    (["--env", "sokoban", "--algo", "static_skills", "--init", ""], "skill library"),
    (["--env", "sokoban", "--micro_batch_size", "0"], "--micro_batch_size must be positive"),
    (["--env", "sokoban", "--train_fraction", "0"], "--train_fraction must be in (0, 1]"),
    (["--env", "sokoban", "--train_fraction", "1.5"], "--train_fraction must be in (0, 1]"),
    (["--env", "sokoban", "--skill_mode", "steps"], "--skill_mode must be"),
    (["--env", "sokoban", "--skill_teacher_mode", "both"], "--skill_teacher_mode"),
    (["--env", "sokoban", "--skill_mode", "step_only", "--max_step_skills", "0"], "needs --max_step_skills 1 or more"),
])
def test_bad_flags_stop_at_start_up(flags, words, capsys):
    with pytest.raises(SystemExit) as e:
        seed.validate(seed.parse_config(flags))
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_an_algo_that_fixes_lambda_refuses_another_lambda(capsys):
    """opsd and opd_only fix lambda_opd at 1: an explicit other --lambda_opd stops (never silently ignored); the
    same value, or none, is accepted; an algo that reads the flag takes it."""
    for algo in ("opsd", "opd_only"):
        with pytest.raises(SystemExit) as e:
            seed.parse_config(["--algo", algo, "--lambda_opd", "0.01"])     # the default value, passed: refused too
        assert e.value.code == 2 and f"--algo {algo} fixes lambda_opd at 1" in capsys.readouterr().err
        assert seed.parse_config(["--algo", algo, "--lambda_opd", "1"]).algo == algo
        assert seed.parse_config(["--algo", algo]).algo == algo
    assert seed.parse_config(["--algo", "grpo_opsd", "--lambda_opd", "0.3"]).lambda_opd == 0.3


def test_bad_flag_from_the_command_line():
    p = run(["seed.py", "--env", "alfworld", "--algo", "nope"], timeout=300)
    assert p.returncode == 2 and "unknown --algo 'nope'" in p.stderr


# ----------------------------------------------------------------------------- the shared tiny pipeline

@pytest.fixture(scope="module")
def games(tmp_path_factory):
    out = tmp_path_factory.mktemp("alfworld")
    p = run(["-m", "envs.alfworld_gen", "--out", str(out), "--train", "3", "--valid_seen", "1",
             "--valid_unseen", "1", "--seed", "0", "--workers", "1"])
    assert p.returncode == 0, p.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="module")
def sft_ckpt(games, tmp_path_factory):
    """Stage 1 on 2 tasks x 2 episodes (3 training pairs, 1 held out); a high learning rate and 4 epochs so the
    tiny set teaches the JSON format under the cosine decay (measured: 2 or 3 epochs leave the greedy answer
    looping on the expert's route past 128 tokens)."""
    out = str(tmp_path_factory.mktemp("sft") / "ckpt")
    p = run(["sft.py", "--env", "alfworld", "--data_dir", games, "--out", out, "--tasks", "2", "--k0", "2",
             "--engine", "hf", "--max_steps", "2", "--history_length", "1", "--max_tokens", "16", "--epochs", "4",
             "--lr", "4e-4", "--batch_size", "2", "--micro_batch_size", "2"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return out


def test_sft_writes_a_checkpoint_seed_accepts(sft_ckpt, games):
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "skills.jsonl", "stage1.json"):
        assert os.path.exists(os.path.join(sft_ckpt, name)), name
    summary = json.load(open(os.path.join(sft_ckpt, "stage1.json")))
    assert summary["episodes"] == 4 and summary["parsed"] == 4 and summary["skills"] == 4
    assert (summary["train_pairs"], summary["val_pairs"]) == (3, 1)       # 10% held out, at least one
    val = summary["val_loss"]                                             # one per epoch, and it falls
    assert len(val) == 4 and all(0 < v < 20 for v in val) and val[-1] < val[0]
    log = [json.loads(x) for x in open(os.path.join(sft_ckpt, "sft_log.jsonl"))]
    assert len(log) == 4 * 2 and log[-1]["loss"] < 0.5 * log[0]["loss"]   # 2 steps per epoch on 3 pairs
    assert [r.get("val_loss") for r in log] == [x for v in val for x in (None, v)]
    total, warm = len(log), int(0.1 * len(log))                           # cosine after a linear warm-up
    want = [k / warm if k < warm else 0.5 * (1 + math.cos(math.pi * (k - warm) / (total - warm))) for k in range(total)]
    assert [r["lr"] for r in log] == pytest.approx([4e-4 * w for w in want])
    lib = analyzer.SkillLibrary.load(os.path.join(sft_ckpt, "skills.jsonl"))
    assert lib.retrieve("alfworld", lib.entries[0]["family"], lib.entries[0]["task"])
    seed.validate(seed.parse_config(["--init", sft_ckpt, "--data_dir", games, "--algo", "static_skills"]))


class _Analyzer(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint on loopback (stands in for the external analyzer API)."""
    calls = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        assert self.headers.get("Authorization") == "Bearer test-key" and body["temperature"] == 0
        text = json.dumps({"episode_summary": "The agent looked around.",
                           "episode_skill": "Go to the target receptacle first, then take the object."})
        data = json.dumps({"choices": [{"message": {"content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_annotation_is_resumable_and_never_resent(sft_ckpt, tmp_path, monkeypatch):
    """Labels come from a loopback OpenAI-compatible server; a second pass over the same cache sends nothing,
    and a cache holding half the labels sends only the other half."""
    episodes = {d["key"]: sft.episode_from_json(d)
                for d in sft.read_jsonl(os.path.join(sft_ckpt, "stage1", "episodes.rank*.jsonl"))}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Analyzer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("SEED_TEST_KEY", "test-key")
    cfg = sft.SFTConfig(analyzer_url=f"http://127.0.0.1:{server.server_address[1]}/v1", analyzer_model="m",
                        analyzer_key_env="SEED_TEST_KEY", annotate_batch=2)
    tok, budget = sft._tokenizer(cfg.model), sft.prompt_budget(cfg)
    annotate = lambda: sft.annotate(cfg, str(tmp_path), 0, 1, episodes, tok, budget)   # noqa: E731
    try:
        first = annotate()
        assert _Analyzer.calls == len(episodes) == 4 and all(first.values())
        assert annotate() == first and _Analyzer.calls == 4
        with open(tmp_path / "labels.rank0.jsonl") as f:
            kept = f.readlines()[:2]
        with open(tmp_path / "labels.rank0.jsonl", "w") as f:
            f.writelines(kept + ['{"key": "cut by a ki'])      # a line cut by a kill is redone
        annotate()
        assert _Analyzer.calls == 6
    finally:
        server.shutdown()
    assert "test-key" not in open(tmp_path / "labels.rank0.jsonl").read()


@pytest.fixture(scope="module")
def seed_run(games, sft_ckpt, tmp_path_factory):
    """seed.py --algo seed, 2 updates, killed (SIGKILL) during update 2 after the update-1 checkpoint,
    then --resume. -> (run folder, metrics seen at the kill)."""
    out = str(tmp_path_factory.mktemp("seed") / "run")
    args = ["seed.py", "--algo", "seed", "--env", "alfworld", "--data_dir", games, "--init", sft_ckpt,
            "--out", out, "--updates", "2", "--save_every", "1", "--eval_every", "2",
            "--eval_tasks", "1", "--analyzer_max_tokens", "128", "--analyzer_retries", "1", "--lr", "1e-5", *TINY]
    proc = subprocess.Popen([PY, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    state = os.path.join(out, "checkpoint", "trainer_state.pt")
    deadline = time.time() + 1800
    while not os.path.exists(state) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    log = proc.communicate()[0]
    assert os.path.exists(state), log[-3000:]
    at_kill = lines(out)
    p = run(args + ["--resume"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return out, at_kill, p.stdout


def test_kill_and_resume_lose_and_double_nothing(seed_run):
    out, at_kill, stdout = seed_run
    assert [m["update"] for m in at_kill] == [0]
    assert "resumed" in stdout and "at update 1" in stdout
    ms = lines(out)
    assert [m["update"] for m in ms] == [0, 1] and ms[0] == at_kill[0]
    state = torch.load(os.path.join(out, "checkpoint", "trainer_state.pt"), weights_only=False)
    assert state["update"] == 2 and state["optimizer"]["state"]
    assert sorted(os.listdir(os.path.join(out, "episodes"))) == ["update_0000.jsonl", "update_0001.jsonl"]


def test_seed_run_writes_everything_and_distills(seed_run):
    out, _, _ = seed_run
    ms = lines(out)
    for m in ms:
        for k in ("success", "length", "reward", "loss/pg", "loss/kl", "loss/entropy", "loss/opd", "gate/mean",
                  "gate/std", "diag/tied_groups", "diag/gate_std_action", "clip_frac", "parse_failure_rate", "first_try_failure_rate", "sec/collect", "sec/analyze", "sec/update"):
            assert k in m, k
        assert m["episodes"] == 2 and m["rows"] >= 2
        assert m["first_try_failure_rate"] >= m["parse_failure_rate"]   # retries only ever rescue
    skilled = [m for m in ms if m["skill_rate"] > 0]
    assert skilled, "the SFT'd analyzer never produced a parsable skill"
    assert all(m["loss/opd"] != 0 and 0 < m["gate/mean"] < 1 for m in skilled)
    assert "eval/valid_seen/success" in ms[-1] and "eval/valid_unseen/success_macro" in ms[-1]
    eps = [[json.loads(x) for x in open(os.path.join(out, "episodes", f"update_000{u}.jsonl"))] for u in (0, 1)]
    assert [len(e) for e in eps] == [2, 2] and eps[1][0]["steps"][0]["response"] is not None
    assert any(e["skill"] and e["summary"] for e in eps[0] + eps[1])
    assert os.path.getsize(os.path.join(out, "curves.png")) > 10_000
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["algo"] == "seed" and cfg["lambda_opd"] == 0.01


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("grpo") / "run")
    p = run(["seed.py", "--algo", "grpo", "--env", "sokoban", "--out", out, "--updates", "2", "--eval_every", "2",
             "--eval_tasks", "1", "--lr", "1e-5", "--eval_first", "--eval_greedy", *TINY])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return out


def test_grpo_has_no_opd_term(grpo_run):
    first, *ms = lines(grpo_run)
    assert first["update"] == -1 and [m["update"] for m in ms] == [0, 1]     # --eval_first: the starting policy
    for m in (first, ms[-1]):                                                # at T = 0.4 and greedy
        assert all(f"{p}/test/{k}" in m for p in ("eval", "eval_greedy") for k in ("success", "invalid_rate", "length"))
        assert m["eval/test/length"] in (1, 2)                                # one task, --max_steps 2
        assert (m["eval/test/invalid_rate"] * m["eval/test/length"]).is_integer()   # invalid steps / steps
    assert all("loss/opd" not in m and "gate/mean" not in m and m["skill_rate"] == 0 for m in ms)
    assert all(0 <= m["diag/tied_groups"] <= 1 and "diag/gate_std_action" not in m for m in ms)   # no teacher
    assert all(m["loss/kl"] >= 0 and m["tokens"] > 0 for m in ms)


def test_checkpoint_reloads_and_evaluates(grpo_run):
    import envs
    ckpt = os.path.join(grpo_run, "checkpoint")
    model, tok, _ = rollout.load_model(ckpt)
    base, _, _ = rollout.load_model(rollout.EMBEDDED)
    moved = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
    assert moved > 0, "the checkpoint holds the base weights: no update was saved"
    engine = rollout.make_engine("hf", ckpt, dtype="float32", max_model_len=2048)
    res = rollout.evaluate(engine, tok, [envs.make("sokoban", split="test", max_steps=2) for _ in range(2)],
                           [0, 1], max_tokens=16)
    assert len(res) == 2 and all(1 <= r[2] <= 2 and r[3] <= r[2] for r in res)       # --max_steps 2 held
    assert rollout.eval_metrics(res, "eval/test")["eval/test/success"] == sum(r[1] for r in res) / 2


# ----------------------------------------------------------------------------- DDP and FSDP2 equal one process

@pytest.fixture(scope="module")
def single_update(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist") / "single.json")
    p = run(["tests/dist_update.py", out])
    assert p.returncode == 0, p.stderr[-3000:]
    return json.load(open(out))


def torchrun(tmp_path, *extra):
    out = str(tmp_path / "ranks.json")
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "tests/dist_update.py", out, *extra], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.load(open(out))


def assert_same_update(a, b):
    assert len(a["grad_norms"]) == len(b["grad_norms"]) == 2            # 8 rows, mini-batches of 4
    for x, y in zip(a["grad_norms"], b["grad_norms"]):
        assert abs(x - y) <= 1e-4 * abs(x), (a["grad_norms"], b["grad_norms"])
    for key in ("tokens", "skill_tokens", "pg", "opd", "kl"):
        assert abs(a["sums"][key] - b["sums"][key]) <= 1e-4 * max(1.0, abs(a["sums"][key])), key
    scale = max(v["norm"] for v in a["fingerprint"].values())
    assert scale > 1e-3, "the update did not move the parameters"
    for name, fa in a["fingerprint"].items():
        fb = b["fingerprint"][name]
        assert abs(fa["norm"] - fb["norm"]) <= 1e-4 * scale, name
        assert max(abs(x - y) for x, y in zip(fa["sample"], fb["sample"])) <= 1e-5 * scale + 1e-7, name


def assert_checkpoint_holds_the_update(folder, result):
    """The HF checkpoint saved from the wrapped model reloads with exactly the updated weights."""
    model, _, _ = rollout.load_model(os.path.join(folder, "checkpoint"))
    base, _, _ = rollout.load_model(rollout.EMBEDDED)
    got, ref = model.state_dict(), base.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        d = (got[name].double() - ref[name].double()).flatten()
        assert abs(float(d.norm()) - result["fingerprint"][name]["norm"]) < 1e-6, name
    state = torch.load(os.path.join(folder, "checkpoint", "trainer_state.pt"), weights_only=False)
    assert state["update"] == 1 and state["world"] == 2 and len(state["rng"]) == 2


def test_two_ddp_ranks_equal_one_process(single_update, tmp_path):
    ddp = torchrun(tmp_path)
    assert ddp["world"] == 2 and ddp["rank_max_diff"] == 0.0
    assert_same_update(single_update, ddp)
    assert_checkpoint_holds_the_update(str(tmp_path), ddp)


def test_two_fsdp2_ranks_equal_one_process(single_update, tmp_path):
    fsdp = torchrun(tmp_path, "--fsdp")
    assert fsdp["world"] == 2 and fsdp["fsdp"] and fsdp["rank_max_diff"] == 0.0
    assert_same_update(single_update, fsdp)
    assert_checkpoint_holds_the_update(str(tmp_path), fsdp)


# ----------------------------------------------------------------------------- the loss of one micro-batch, per algo

LAMBDA = 0.5   # --lambda_opd in these checks
# What each trained algo's loss is made of, written out here rather than read from seed.ALGOS: the policy-gradient
# term (None, "pg", or "rlsd": pg times RLSD's bounded teacher weight on skill rows), the distillation term (None,
# "opd" gated, "opsd" ungated) and its weight ("flag": --lambda_opd).
LOSS_TABLE = {"seed": ("pg", "opd", "flag"), "grpo": ("pg", None, 0.0), "skill_grpo": ("pg", None, 0.0),
              "skill_grpo_star": ("pg", None, 0.0), "static_skills": ("pg", "opd", "flag"),
              "opsd": (None, "opsd", 1.0), "grpo_opsd": ("pg", "opsd", "flag"), "rlsd": ("rlsd", None, 0.0),
              "skill_sd": ("pg", "opsd", "flag"), "opd_only": (None, "opd", 1.0)}


def hand_loss(algo, lp, old, ls, adv, mask, skill, n_tok, n_skill, progress=0.0):
    """The joint loss of one micro-batch (kl_coef = ent_coef = 0) from its log-probs, by LOSS_TABLE."""
    pg_kind, distill, weight = LOSS_TABLE[algo]
    loss = 0.0
    if pg_kind:
        pg = grpo.policy_loss(lp, old, adv, mask)                                               # [rows, R]
        if pg_kind == "rlsd":
            w = torch.exp(torch.sign(adv)[:, None] * (ls - lp)).clamp(1 - seed.RLSD_EPS, 1 + seed.RLSD_EPS)
            pg = pg * (1 + skill * (1 - progress) * (w - 1))
        loss += float((pg * mask).sum()) / n_tok
    if distill == "opd":                                  # g (lp_skill - lp), g = sigmoid(5 (lp_skill - lp))
        loss += (LAMBDA if weight == "flag" else weight) * float((torch.sigmoid(5.0 * (ls - lp)) * (ls - lp)
                                                                 * skill).sum()) / n_skill
    elif distill == "opsd":                               # value sg(lp - lp_skill) per token
        loss += (LAMBDA if weight == "flag" else weight) * float(((lp - ls) * skill).sum()) / n_skill
    return loss


def test_loss_table_covers_every_trained_algo():
    assert set(LOSS_TABLE) == {name for name, a in seed.ALGOS.items() if a.train}
    assert {name for name, a in seed.ALGOS.items() if not a.train} == {"vanilla", "skill_prompt"}


@pytest.mark.parametrize("algo", sorted(LOSS_TABLE))
def test_micro_loss_per_algo_equals_the_hand_computation(smol, algo):
    """seed.micro_loss on fixed rows, half of them (rows 1 and 2) with a skill, recomputed by hand from the
    log-probs (LOSS_TABLE): an OPD / OPSD term enters L as its weight x its sum over skill tokens / the skill-token
    count (the authors' opd_mask mean), a pure-distillation algo has no GRPO term, RLSD multiplies GRPO's
    per-token loss by its bounded weight on skill rows at the start of the run and is plain GRPO at its end; the
    metrics name exactly the terms the algo has."""
    from types import SimpleNamespace
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_update import fixed_rows
    model, tok = smol
    rows = fixed_rows(model, n=4)
    assert rows.has_skill.tolist() == [0.0, 1.0, 1.0, 0.0]
    lens = [len(r) for r in rows.responses]
    n_tok, n_skill = float(sum(lens)), float(lens[1] + lens[2])
    cfg = seed.Config(algo=algo, kl_coef=0.0, ent_coef=0.0, lambda_opd=LAMBDA, dtype="float32")
    run = SimpleNamespace(cfg=cfg, model=model, tok=tok, world=1, device=torch.device("cpu"))
    with torch.no_grad():
        lp, mask, _ = grpo.response_logprobs(model, rows.prompts, rows.responses, tok.pad_token_id)   # [4, R]
    R = lp.shape[1]
    old, ls, skill = grpo.pad(rows.old, R), grpo.pad(rows.lp_skill, R), rows.has_skill[:, None] * mask
    for progress in (0.0, 1.0):
        value, sums, _ = seed.micro_loss(run, rows, n_tok, n_skill, progress)
        want = hand_loss(algo, lp, old, ls, rows.adv, mask, skill, n_tok, n_skill, progress)
        assert float(value.detach()) == pytest.approx(want, rel=1e-4, abs=1e-7), (algo, progress)
    pg_kind, distill, _ = LOSS_TABLE[algo]
    assert sums["skill_tokens"] == n_skill
    metrics = seed.loss_metrics(sums, [1.0], seed.ALGOS[algo])
    assert ("loss/pg" in metrics) == ("clip_frac" in metrics) == bool(pg_kind)
    assert ("loss/opd" in metrics) == ("gate/mean" in metrics) == bool(distill)
    assert ("rlsd/weight_mean" in metrics) == (pg_kind == "rlsd")
    if distill:
        assert metrics["loss/opd"] != 0
    if pg_kind == "rlsd":   # the weight moved something at the start (progress 0), nothing at the end
        assert hand_loss(algo, lp, old, ls, rows.adv, mask, skill, n_tok, n_skill) != pytest.approx(
            hand_loss("grpo", lp, old, ls, rows.adv, mask, skill, n_tok, n_skill), rel=1e-3)


# ----------------------------------------------------------------------------- the baselines, end to end

FIXED_SKILL = "Push the box toward the target along the shortest path, one step at a time."


def fake_analyzer(engine, tokenizer, episodes, cfg, progress=False, chunk=32):
    """analyzer.self_analyze's stand-in: every episode gets the same parsed skill (the base model parses none)."""
    for ep in episodes:
        ep.summary, ep.skill, ep.step_skills = "The agent played.", FIXED_SKILL, {}
    return {"episodes": len(episodes), "parse_failures": 0, "first_try_failures": 0}


def test_live_analyzer_baselines_distill_the_skill(tmp_path, monkeypatch):
    """One run state (seed.build_run) and one update of each live-analyzer algo (rl_update; run.cfg.algo switched
    between updates) with a fake analyzer that returns a fixed skill: every row is distilled, and every micro-batch
    loss, OPD / OPSD / RLSD term included, equals the hand computation from that micro-batch's log-probs."""
    monkeypatch.setattr(analyzer, "self_analyze", fake_analyzer)
    checked, micro_loss = [], seed.micro_loss

    def checking(run, mb, n_tok, n_skill, progress=0.0):
        with torch.no_grad():   # the same weights the call below sees (before its backward)
            lp, mask, _ = grpo.response_logprobs(run.model, mb.prompts, mb.responses, run.tok.pad_token_id)
        R = lp.shape[1]
        old = lp if mb.old is None else grpo.pad(mb.old, R)
        skill = mb.has_skill[:, None] * mask
        want = hand_loss(run.cfg.algo, lp, old, grpo.pad(mb.lp_skill, R), mb.adv, mask, skill, n_tok, n_skill,
                         progress)
        out = micro_loss(run, mb, n_tok, n_skill, progress)
        checked.append((run.cfg.algo, float(out[0].detach()), want, float(skill.sum())))
        return out
    monkeypatch.setattr(seed, "micro_loss", checking)
    cfg = seed.parse_config(["--env", "sokoban", "--init", "", "--out", str(tmp_path / "run"), "--updates", "5",
                             "--tasks_per_update", "1", "--group_size", "2", "--max_steps", "1", "--max_tokens", "16",
                             "--engine", "hf", "--eval_every", "0", "--micro_batch_size", "2", "--kl_coef", "0",
                             "--ent_coef", "0", "--lambda_opd", str(LAMBDA), "--lr", "1e-5", "--save_every", "99"])
    seed.validate(cfg)
    run = seed.build_run(cfg)
    algos = ("opsd", "grpo_opsd", "rlsd", "opd_only", "seed")
    try:
        got = {}
        for u, algo in enumerate(algos):
            run.cfg.algo = algo
            got[algo], _ = seed.rl_update(u, run)
    finally:
        runfolder.finish(run)
    assert sorted({a for a, *_ in checked}) == sorted(algos)
    for algo, value, want, n_skill in checked:
        assert n_skill > 0 and value == pytest.approx(want, rel=1e-4, abs=1e-7), algo
    for algo, m in got.items():
        assert m["skill_rate"] == 1.0 and m["skill_token_frac"] == 1.0, algo
        assert ("loss/pg" in m) == (algo not in ("opsd", "opd_only")), algo
        assert ("loss/opd" in m) == (algo != "rlsd") and m.get("loss/opd", 1.0) != 0, algo
    r, tied = got["rlsd"]["rlsd/weight_mean"], got["rlsd"]["diag/tied_groups"]
    assert 1 - seed.RLSD_EPS <= r <= 1 + seed.RLSD_EPS and (r == 1.0) == (tied == 1.0)   # A = 0: sign 0, weight 1


def test_library_baselines_run(tmp_path, monkeypatch):
    """Full seed.main runs of the library-skill baselines on Sokoban from the base model: skill_grpo_star trains
    with the library skill in the actor's prompt and evaluates with it; skill_prompt only evaluates, with it. Every
    rollout call is recorded (skills passed, temperature)."""
    lib = analyzer.SkillLibrary()
    lib.add("sokoban", "", "push the box onto the target", "Walk around the box and push it toward the target.")
    lib.save(str(tmp_path / "skills.jsonl"))
    common = ["--env", "sokoban", "--init", "", "--skill_library", str(tmp_path / "skills.jsonl"), "--updates", "1",
              "--tasks_per_update", "1", "--group_size", "2", "--max_steps", "1", "--max_tokens", "16",
              "--engine", "hf", "--eval_every", "1", "--eval_tasks", "1", "--micro_batch_size", "2", "--kl_coef", "0",
              "--train_fraction", "0.00001"]
    calls, collect = [], rollout.collect
    def recording(*a, **kw):
        calls[-1].append((kw.get("skills") is not None, a[5] if len(a) > 5 else kw.get("temperature")))
        return collect(*a, **kw)
    monkeypatch.setattr(rollout, "collect", recording)
    got, seen = {}, {}
    for algo in ("skill_grpo_star", "skill_prompt"):
        out = str(tmp_path / algo)
        calls.append([])
        seed.main(common + ["--algo", algo, "--out", out])
        got[algo], seen[algo] = lines(out), calls[-1]
    assert [m["update"] for m in got["skill_prompt"]] == [0] and "eval/test/success" in got["skill_prompt"][0]
    assert "loss/pg" not in got["skill_prompt"][0] and not os.path.exists(tmp_path / "skill_prompt" / "checkpoint")
    assert json.load(open(tmp_path / "skill_prompt" / "config.json"))["updates"] == 0   # --updates does not apply
    assert seen["skill_prompt"] == [(True, 0.4)] and seen["skill_grpo_star"] == [(True, 1.0), (True, 0.4)]
    eps = [json.loads(x) for x in open(tmp_path / "skill_grpo_star" / "episodes" / "update_0000.jsonl")]
    assert all("Walk around the box" in e["first_prompt"] for e in eps)
    m = got["skill_grpo_star"][0]
    assert "loss/opd" not in m and "loss/pg" in m and m["skill_rate"] == 0.0      # the skill is context, no teacher
    subset = set(envs.train_subset(1_000_000, 0.00001, 0).tolist())                 # 10 of Sokoban's tasks
    assert eps and all(e["task_id"] in subset for e in eps)
    shutil.rmtree(tmp_path / "skill_grpo_star" / "checkpoint")


def test_train_fraction_subset():
    """--train_fraction f: the first ceil(f n) of a seeded permutation, the same for a seed, another for
    another seed; f = 1 is every task in order (the data order of a full run is unchanged)."""
    for f, n, k in ((0.2, 10, 2), (0.6, 5, 3), (0.4, 7, 3), (1.0, 6, 6), (1e-9, 100, 1)):
        ids = envs.train_subset(n, f, 0)
        assert len(ids) == k and len(set(ids.tolist())) == k and all(0 <= i < n for i in ids)
    assert envs.train_subset(1000, 0.2, 3).tolist() == envs.train_subset(1000, 0.2, 3).tolist()
    assert envs.train_subset(1000, 0.2, 3).tolist() != envs.train_subset(1000, 0.2, 4).tolist()
    assert envs.train_subset(6, 1.0, 5).tolist() == list(range(6))
    assert set(envs.train_subset(1000, 0.2, 3).tolist()) < set(envs.train_subset(1000, 0.4, 3).tolist())


# ----------------------------------------------------------------------------- a NaN cannot poison the weights

def test_nan_gradient_skips_the_step_and_is_counted(smol):
    """An injected NaN gradient (a hook on one weight): update_policy skips the AdamW step, zeroes the grads,
    counts the skip (update/skipped_steps) and leaves every weight finite and unchanged; three skips in a row
    (across updates) stop the run naming the update; a finite step moves the weights and resets the count."""
    import copy
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_update import fixed_rows
    base, tok = smol
    model = copy.deepcopy(base)                      # the session's model keeps its weights
    rows = fixed_rows(model, n=4)
    cfg = seed.Config(algo="grpo", micro_batch_size=4, mini_batch_size=4, kl_coef=0.0, ent_coef=0.0,
                      dtype="float32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w = model.model.norm.weight
    hook = w.register_hook(lambda g: torch.full_like(g, float("nan")))
    from types import SimpleNamespace
    run = SimpleNamespace(cfg=cfg, model=model, opt=opt, tok=tok, world=1, device=torch.device("cpu"), rank=0,
                          skip_streak=0)
    step = lambda u: seed.update_policy(run, rows, update=u)[:2]
    sums, norms = step(7)
    assert sums["skipped_steps"] == 1 and norms == [] and run.skip_streak == 1
    assert seed.loss_metrics(sums, norms, seed.ALGOS["grpo"])["update/skipped_steps"] == 1
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.isfinite(v).all() and torch.equal(v, before[k]), k
    step(8)
    with pytest.raises(RuntimeError, match="update 9: 3 optimizer steps in a row"):
        step(9)
    hook.remove()
    run.skip_streak = 2
    sums, norms = step(10)
    assert sums["skipped_steps"] == 0 and len(norms) == 1 and math.isfinite(norms[0]) and run.skip_streak == 0
    assert not torch.equal(model.model.norm.weight, before["model.norm.weight"])


# ----------------------------------------------------------------------------- the per-update teacher diagnostics

class _RandomEZPoints:
    """An engine that answers every actor prompt with a random EZPoints token in the env's JSON format (so every
    response has action tokens); no weights to push."""
    def __init__(self, tok, max_model_len=2048):
        import random
        self.tok, self.rng, self.max_model_len = tok, random.Random(0), max_model_len

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        from envs.ezpoints import TOKENS
        out = []
        for _ in range(len(prompt_ids_list) * n):
            ids = self.tok.encode(json.dumps({"thoughts": "a token", "action": self.rng.choice(TOKENS)}),
                                  add_special_tokens=False) + [self.tok.eos_token_id]
            out.append((ids, [-1.0] * len(ids)))
        return out

    def push_weights(self, model):
        pass

    def sleep(self):
        pass

    def close(self):
        pass


def test_teacher_diagnostics_in_metrics(tmp_path, monkeypatch):
    """A seed.py run writes the tie share, the teacher's shift on action tokens and the gate-advantage covariance
    into metrics.jsonl (static_skills: a library skill is the teacher), and every episode record keeps its skill."""
    lib = analyzer.SkillLibrary()
    lib.add("ezpoints", "ezpoints", "write a formula that equals 12", "Add the two card values, then write '='.")
    lib.save(str(tmp_path / "skills.jsonl"))
    tok = rollout.load_model(rollout.EMBEDDED)[1]
    monkeypatch.setattr(rollout, "make_engine", lambda *a, **kw: _RandomEZPoints(tok))
    out = str(tmp_path / "run")
    seed.main(["--env", "ezpoints", "--init", "", "--algo", "static_skills", "--skill_library", str(tmp_path / "skills.jsonl"),
               "--out", out, "--updates", "1", "--tasks_per_update", "2", "--group_size", "2", "--max_steps", "2",
               "--max_tokens", "32", "--micro_batch_size", "4", "--eval_every", "0", "--kl_coef", "0", "--save_every", "5"])
    m = lines(out)[0]
    assert 0 <= m["diag/tied_groups"] <= 1 and m["diag/action_tokens"] > 0
    assert m["diag/delta_action_p5"] <= m["diag/delta_action_p50"] <= m["diag/delta_action_p95"]
    assert m["diag/gate_std_action"] > 0 and m["diag/gate_std_response"] > 0 and 0 <= m["diag/action_shift_share"] <= 1
    assert math.isfinite(m["diag/gate_adv_cov"])                      # 4 episodes: several rows, never nan
    assert all(k in m for k in ("diag/delta_thought_p50", "diag/delta_action_mean", "sec/diagnostics"))
    assert 0 <= m["diag/opd_skill_mass"] <= 1 and 0 <= m["diag/decision_token_share"] <= 1   # Appendix A's split
    eps = [json.loads(x) for x in open(os.path.join(out, "episodes", "update_0000.jsonl"))]
    assert eps and all(e["skill"] == "Add the two card values, then write '='." for e in eps)
    shutil.rmtree(os.path.join(out, "checkpoint"), ignore_errors=True)


def test_one_mini_batch_update_returns_its_forward_as_pi_old(smol):
    """With one mini-batch (seed.old_logprobs: None, no old pass), update_policy returns the update's own forward
    as log pi_old, which the per-update diagnostics read instead of a pass of their own: it equals the no-grad
    pass of the weights before the step, row by row and token by token, in any row order; with rows.old given it
    returns None."""
    import copy
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_update import fixed_rows
    base, tok = smol
    model = copy.deepcopy(base)
    rows = fixed_rows(model, n=5)
    rows.old = None
    cfg = seed.Config(algo="seed", micro_batch_size=2, mini_batch_size=8, kl_coef=0.0, ent_coef=0.0, dtype="float32")
    from types import SimpleNamespace
    expected = grpo.batch_logprobs(model, rows, tok.pad_token_id, cfg.micro_batch_size)   # the weights before the step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = SimpleNamespace(cfg=cfg, model=model, opt=opt, tok=tok, world=1, device=torch.device("cpu"), rank=0,
                          mini_batch_size=8, skip_streak=0, no_grad_model=model)
    assert seed.old_logprobs(run, rows) is None                                    # 5 rows, one mini-batch of 8
    _, _, own = seed.update_policy(run, rows, order=[3, 0, 4, 1, 2])
    assert rows.old is None and len(own) == 5
    for got, want in zip(own, expected):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
    rows.old = expected
    assert seed.update_policy(run, rows)[2] is None


def test_engine_and_trainer_agree_in_a_vllm_run(tmp_path, monkeypatch, vllm_engine, model_path):
    """Two updates of a run on the session's float32 vLLM engine (seed.build_run, rl_update): the engine's own
    log-probs of its sampled tokens equal the trainer's log pi_old to float32 rounding (diag/engine_lp_diff_*), before
    the first push and after it (a push that left stale weights in the engine would show here as ~0.1 or more)."""
    base, _, _ = rollout.load_model(model_path)
    vllm_engine.push_weights(base)                      # the session's engine holds the run's starting weights
    monkeypatch.setattr(rollout, "make_engine", lambda *a, **kw: vllm_engine)
    monkeypatch.setattr(vllm_engine, "close", lambda: None)
    cfg = seed.parse_config(["--env", "sokoban", "--algo", "grpo", "--out", str(tmp_path / "run"), "--updates", "2",
                             "--tasks_per_update", "1", "--group_size", "4", "--max_steps", "2", "--max_tokens", "16",
                             "--engine", "vllm", "--eval_every", "0", "--micro_batch_size", "4", "--kl_coef", "0",
                             "--lr", "1e-4", "--save_every", "99"])
    seed.validate(cfg)
    run = seed.build_run(cfg)
    try:
        gaps = [seed.rl_update(u, run)[0] for u in range(2)]
    finally:
        vllm_engine.push_weights(base)                  # the session's engine goes back to the base weights
    for m in gaps:
        assert m["diag/engine_lp_diff_mean"] <= 1e-4 and m["diag/engine_lp_diff_max"] <= 1e-3, m
    assert m["lr"] == 1e-4


class _WebShopScript(_RandomEZPoints):
    """An engine that plays every WebShop episode the same three turns (search a lamp, click the first result,
    buy it), one turn per generate call; no weights to push."""
    TURNS = ("search[wooden desk lamp]", "click[b001]", "click[buy now]")

    def __init__(self, tok, max_model_len=4096):
        super().__init__(tok, max_model_len)
        self.turn = 0

    def generate(self, prompt_ids_list, temperature, max_tokens, n=1):
        text = f"<think>next</think><action>{self.TURNS[self.turn % 3]}</action>"
        self.turn += 1
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return [(ids, [-1.0] * len(ids)) for _ in range(len(prompt_ids_list) * n)]


def test_webshop_score_in_a_runs_metrics(tmp_path, monkeypatch):
    """Table 1 reports WebShop's score beside its success: the adapter's score of each episode (on the stand-in shop,
    tests/test_envs.py: WebShop's data can't be fetched here) reaches the episode records, the update's metrics
    (`score`, their mean) and the evaluation's (`eval/test/score`). The script buys product b001 every time: 0.5 on
    the goals that ask for it (no option chosen), 0.1 on the others, never a win."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_envs import StandInShop
    from envs import webshop
    tok = rollout.load_model(rollout.EMBEDDED)[1]
    monkeypatch.setattr(rollout, "make_engine", lambda *a, **kw: _WebShopScript(tok))
    monkeypatch.setattr(webshop, "official_env", lambda *a, **kw: StandInShop())
    out = str(tmp_path / "run")
    seed.main(["--env", "webshop", "--init", "", "--algo", "grpo", "--out", out, "--updates", "1",
               "--tasks_per_update", "4", "--group_size", "2", "--max_steps", "3", "--max_tokens", "32",
               "--micro_batch_size", "8", "--eval_every", "1", "--eval_tasks", "8", "--kl_coef", "0", "--save_every", "5"])
    m = lines(out)[0]
    eps = [json.loads(x) for x in open(os.path.join(out, "episodes", "update_0000.jsonl"))]
    assert sorted({e["score"] for e in eps}) <= [0.1, 0.5] and not any(e["won"] for e in eps)
    assert m["score"] == pytest.approx(sum(e["score"] for e in eps) / len(eps)) and m["success"] == 0.0
    assert m["eval/test/score"] == pytest.approx((2 * 0.5 + 6 * 0.1) / 8)   # test goals 0..7: b001 is asked by 0 and 4
    shutil.rmtree(os.path.join(out, "checkpoint"), ignore_errors=True)


def test_opd_only_moves_the_policy_toward_the_teachers_action(tokenizer):
    """opd_only (the gated OPD term at weight 1, no GRPO term) with a fixed teacher that prefers one action of a toy
    env: over a few AdamW steps on the student's own samples (drawn from its probabilities over four answers), the
    preferred answer's probability rises, although the rewards (advantage +1 on another answer) point elsewhere:
    no GRPO term acts. A real gradient test on a tiny random Llama (seconds)."""
    from types import SimpleNamespace
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import ToyEnv
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    env = ToyEnv()
    env.reset(seed=4)
    prompt = rollout.chat_ids(tokenizer, env.prompt())
    answers = [tokenizer.encode(f"<think>t</think><action>guess {k}</action>", add_special_tokens=False)
               for k in (2, 4, 5, 7)]
    best, rewarded = 2, 0                                       # the teacher prefers "guess 5"; GRPO would push "guess 2"
    cfg = seed.Config(algo="opd_only", kl_coef=0.0, ent_coef=0.0, dtype="float32", lr=1e-2)
    run = SimpleNamespace(cfg=cfg, model=model, tok=tokenizer, world=1, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    rng = np.random.default_rng(0)

    def share():   # the policy's probability of the preferred answer among the four
        with torch.no_grad():
            lp, _, _ = grpo.response_logprobs(model, [prompt] * 4, answers, tokenizer.pad_token_id)    # [4, R]
        seq = torch.stack([lp[i, :len(a)].sum() for i, a in enumerate(answers)])                    # [4]
        return torch.softmax(seq, 0), lp

    start = share()[0][best].item()
    for _ in range(12):
        p, lp = share()
        picks = rng.choice(4, size=8, p=p.numpy() / p.numpy().sum()).tolist()   # the student's own samples
        old = [lp[i, :len(answers[i])].clone() for i in picks]
        skill = [o + (2.0 if i == best else -2.0) for i, o in zip(picks, old)]   # the teacher's scores
        rows = grpo.Rows([prompt] * 8, [answers[i] for i in picks], torch.tensor([1.0 if i == rewarded else -1.0
                         for i in picks]), torch.ones(8), old, None, skill)
        n_tok = float(sum(len(answers[i]) for i in picks))
        opt.zero_grad()
        loss, sums, _ = seed.micro_loss(run, rows, n_tok, n_tok)
        loss.backward()
        opt.step()
        assert "pg" not in sums and sums["opd"] != 0
    end = share()[0][best].item()
    assert start < 0.4 and end > 0.8, (start, end)
