"""Every flag is checked at start-up (runfolder.FLAG_CHECKS, applied by check_common): a value out of range stops
seed.py / sft.py with exit status 2 and a message naming the flag, before any process group or model. And
WebShop's data flags reach the adapter (the authors' defaults: small catalogue, synthetic goals, train from 500)."""
import os
import sys
import types

import pytest

import envs
import runfolder
import seed
import sft
from envs import webshop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_envs import StandInShop  # noqa: E402

BASE = ["--env", "sokoban", "--engine", "hf"]   # sokoban: no data folder needed

# flag, bad value, words the message must hold (the flag's name first)
SEED_CASES = [
    ("group_size", "1", "--group_size must be at least 2"),           # measured: one update, then ZeroDivisionError
    ("temperature", "-1", "--temperature must be 0 or more"),         # measured: accepted
    ("lambda_opd", "-1", "--lambda_opd must be 0 or more"),           # measured: accepted
    ("tasks_per_update", "0", "--tasks_per_update must be positive"),
    ("eval_temperature", "-0.4", "--eval_temperature must be 0 or more"),
    ("kl_coef", "-0.01", "--kl_coef must be 0 or more"),
    ("ent_coef", "-0.001", "--ent_coef must be 0 or more"),
    ("beta_opd", "-5", "--beta_opd must be 0 or more"),
    ("weight_decay", "-0.01", "--weight_decay must be 0 or more"),
    ("lr", "0", "--lr must be positive"),
    ("lr", "-1e-6", "--lr must be positive"),
    ("lr", "nan", "--lr must be positive"),
    ("lr", "inf", "--lr must be positive"),
    ("grad_clip", "0", "--grad_clip must be positive"),
    ("clip_low", "1", "--clip_low must be in [0, 1)"),
    ("clip_low", "-0.2", "--clip_low must be in [0, 1)"),
    ("clip_high", "-0.2", "--clip_high must be 0 or more"),
    ("dual_clip", "1", "--dual_clip must be greater than 1"),
    ("gpu_memory_utilization", "0", "--gpu_memory_utilization must be in (0, 1]"),
    ("gpu_memory_utilization", "1.5", "--gpu_memory_utilization must be in (0, 1]"),
    ("eval_every", "-1", "--eval_every must be 0 (never) or more"),
    ("eval_tasks", "-1", "--eval_tasks must be 0 (the whole split) or more"),
    ("save_every", "0", "--save_every must be positive"),                # was (u + 1) % 0
    ("train_fraction", "0", "--train_fraction must be in (0, 1]"),
    ("train_fraction", "1.5", "--train_fraction must be in (0, 1]"),
    ("updates", "-1", "--updates must be 0 or more"),
    ("seed", "-1", "--seed must be 0 or more"),
    ("history_length", "-1", "--history_length must be 0 or more"),
    ("max_steps", "0", "--max_steps must be positive"),
    ("max_prompt_tokens", "0", "--max_prompt_tokens must be positive"),
    ("mini_batch_size", "0", "--mini_batch_size must be positive"),
    ("analyzer_retries", "-1", "--analyzer_retries must be 0 or more"),
    ("max_step_skills", "-1", "--max_step_skills must be 0 or more"),
    ("webshop_train_from", "100", "--webshop_train_from must be 500 or more"),
    ("track", "mlflow", "unknown --track 'mlflow'"),
]


@pytest.mark.parametrize("flag, value, words", SEED_CASES, ids=[f"{f}={v}" for f, v, _ in SEED_CASES])
def test_seed_flag_out_of_range_stops_at_start_up(flag, value, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(seed, "build_run", lambda cfg: pytest.fail("got past the start-up checks"))
    stops_naming(seed.main, BASE + ["--out", str(tmp_path / "run"), f"--{flag}={value}"], words, capsys)


def stops_naming(main, argv, words, capsys):
    """main(argv) stops at start-up (exit status 2) with `words` in its message."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err, err


SFT_CASES = [
    ("k0", "0", "--k0 must be positive"),
    ("lr", "0", "--lr must be positive"),
    ("temperature", "-1", "--temperature must be 0 or more"),
    ("val_fraction", "1", "--val_fraction must be in [0, 1)"),
    ("warmup_ratio", "-0.1", "--warmup_ratio must be in [0, 1)"),
    ("grad_clip", "-1", "--grad_clip must be positive"),
    ("weight_decay", "-1", "--weight_decay must be 0 or more"),
    ("replay", "-1", "--replay must be 0 or more"),
]


@pytest.mark.parametrize("flag, value, words", SFT_CASES, ids=[f"{f}={v}" for f, v, _ in SFT_CASES])
def test_sft_flag_out_of_range_stops_at_start_up(flag, value, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sft.parallel, "setup_dist", lambda s: pytest.fail("got past the start-up checks"))
    stops_naming(sft.main, ["--env", "sokoban", "--out", str(tmp_path / "ckpt"), f"--{flag}={value}"], words, capsys)


def test_every_numeric_field_has_a_range():
    """A new numeric field of seed.Config or sft.SFTConfig joins FLAG_CHECKS (or this list says why not)."""
    import dataclasses
    unchecked = {"retriever_url"}
    for cls in (seed.Config, sft.SFTConfig):
        for f in dataclasses.fields(cls):
            if f.type in (int, float, "int", "float") and f.name not in unchecked:
                assert f.name in runfolder.FLAG_CHECKS, f"{cls.__name__}.{f.name} has no range check"


def test_defaults_pass_every_check(tmp_path):
    for env in envs.NAMES:
        if env == "alfworld":
            continue   # needs its games; the ranges are the same
        cfg = seed.parse_config(["--env", env, "--out", str(tmp_path / env)])
        runfolder.check_flags(cfg)
        runfolder.check_flags(sft.SFTConfig(env=env, out=str(tmp_path / "sft")))


@pytest.mark.parametrize("out, words", [
    ("/proc/seed-run", "--out /proc/seed-run cannot be written"),   # measured: FileNotFoundError traceback
    ("/proc/a/b/c", "--out /proc/a/b/c cannot be written"),
    ("FILE", "is a file, not a folder"),
    ("FILE/run", "is a file, not a folder"),
])
def test_unwritable_out_stops_at_start_up(out, words, tmp_path, capsys, monkeypatch):
    (tmp_path / "FILE").write_text("x")
    out = out.replace("FILE", str(tmp_path / "FILE"))
    words = words.replace("FILE", str(tmp_path / "FILE"))
    monkeypatch.setattr(seed, "build_run", lambda cfg: pytest.fail("got past the start-up checks"))
    with pytest.raises(SystemExit) as e:
        seed.main(BASE + ["--out", out])
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and "--out" in err, err


def test_writable_out_is_not_created_by_the_check(tmp_path):
    out = tmp_path / "a" / "b"
    runfolder.check_writable(str(out))
    assert not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------- WebShop's data flags

def test_webshop_flags_default_to_the_authors_and_reach_the_adapter(monkeypatch):
    """ppo_trainer.yaml:372-374 (use_small True, human_goals False); envs.py:141-144 (train = goals 500 on)."""
    calls = []

    def stand_in(num_products=None, human_goals=False, session_prefix="", small=True):
        calls.append({"small": small, "human_goals": human_goals, "num_products": num_products})
        return StandInShop(n_goals=1600)

    monkeypatch.setattr(webshop, "official_env", stand_in)
    cfg = seed.parse_config(["--env", "webshop"])
    assert (cfg.webshop_small, cfg.webshop_human_goals, cfg.webshop_train_from) == (True, False, 500)
    train, test = envs.from_config(cfg, "train"), envs.from_config(cfg, "test")
    assert calls[-1] == {"small": True, "human_goals": False, "num_products": None}
    assert train.goal_ids[0] == 500 and train.num_tasks == 1100 and test.goal_ids == list(range(500))
    cfg = seed.parse_config(["--env", "webshop", "--no-webshop_small", "--webshop_human_goals",
                             "--webshop_train_from", "1500"])
    train = envs.from_config(cfg, "train")
    assert calls[-1] == {"small": False, "human_goals": True, "num_products": None}
    assert train.goal_ids[0] == 1500 and train.num_tasks == 100
    scfg = sft.SFTConfig(env="webshop", webshop_human_goals=True)   # Stage 1 plays the same shop
    envs.from_config(scfg, "train")
    assert calls[-1]["human_goals"] is True
    with pytest.raises(ValueError, match="test goals"):
        webshop.WebShopEnv(text_env=StandInShop(), train_from=100)


def test_webshop_catalogue_flag_picks_the_product_file(tmp_path, monkeypatch):
    """small -> data/items_shuffle_1000.json, else data/items_shuffle.json (env_manager.py:1174-1179), beside the
    package's DEFAULT_FILE_PATH; a missing file names the set-up step."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "items_shuffle_1000.json").write_text("[]")
    made = []

    class TextEnv:
        def __init__(self, **kw):
            made.append(kw)
            self.server = types.SimpleNamespace(goals=[])

    pkg = types.ModuleType("web_agent_site")
    mods = {"web_agent_site": pkg, "web_agent_site.envs": types.ModuleType("web_agent_site.envs"),
            "web_agent_site.envs.web_agent_text_env": types.ModuleType("web_agent_site.envs.web_agent_text_env"),
            "web_agent_site.utils": types.ModuleType("web_agent_site.utils")}
    mods["web_agent_site.envs.web_agent_text_env"].WebAgentTextEnv = TextEnv
    mods["web_agent_site.utils"].DEFAULT_FILE_PATH = str(data / "items_shuffle_1000.json")
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(webshop, "_SERVERS", {})
    webshop.official_env(human_goals=False, small=True)
    assert made[-1]["file_path"] == str(data / "items_shuffle_1000.json") and made[-1]["human_goals"] is False
    with pytest.raises(RuntimeError, match="items_shuffle.json.*-d all"):
        webshop.official_env(small=False)
    (data / "items_shuffle.json").write_text("[]")
    webshop.official_env(human_goals=True, small=False)
    assert made[-1]["file_path"] == str(data / "items_shuffle.json") and made[-1]["human_goals"] is True
