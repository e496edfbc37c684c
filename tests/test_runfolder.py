"""The run folder (runfolder.py): --resume refuses a folder whose config.json differs outside
RESUME_MAY_CHANGE (before any model loads), continues from checkpoint.old after a kill between
save_checkpoint's two renames, and --track logs metrics.jsonl's lines (tensorboard and wandb, offline),
importing neither package without it. A tiny random Llama stands in for the policy: no model is loaded."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import rollout
import runfolder
import seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--env", "sokoban", "--engine", "hf"]


def a_run(tmp_path, *flags):
    """A folder as a SEED run leaves it after update 0 and its checkpoint (the checkpoint a stub)."""
    out = str(tmp_path / "run")
    cfg = seed.parse_config(BASE + ["--out", out, *flags])
    runfolder.open_folder(cfg, 0, 1)
    runfolder.write_metrics(out, {"update": 0, "success": 0.5})
    os.makedirs(os.path.join(out, "checkpoint"))
    open(os.path.join(out, "checkpoint", "trainer_state.pt"), "w").close()
    return out


@pytest.mark.parametrize("flags, named", [
    (["--algo", "grpo"], ["--algo 'seed' there, 'grpo' now"]),
    (["--lambda_opd", "0.1", "--kl_coef", "0"], ["--lambda_opd 0.01 there, 0.1 now", "--kl_coef 0.01 there, 0.0 now"]),
    (["--model", "other", "--seed", "3"], ["--model", "--seed 0 there, 3 now"]),
    (["--env", "ezpoints"], ["--env 'sokoban' there, 'ezpoints' now", "--max_steps 15 there, 5 now"]),
])
def test_resume_with_other_settings_stops_naming_each_field(flags, named, tmp_path, capsys, monkeypatch):
    """./run.sh alfworld grpo after a SEED run in the same folder used to continue SEED's checkpoint as GRPO."""
    out = a_run(tmp_path)
    saved = open(os.path.join(out, "config.json")).read()
    monkeypatch.setattr(rollout, "load_policy", lambda *a, **kw: pytest.fail("a model was loaded"))
    argv = BASE + ["--out", out, "--resume", *flags]
    if "--env" in flags:
        argv = argv[2:]
    with pytest.raises(SystemExit) as e:
        seed.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--resume" in err and out in err
    for words in named:
        assert words in err, err
    assert open(os.path.join(out, "config.json")).read() == saved   # left as it was


def test_resume_may_change_cadence_and_reporting(tmp_path):
    out = a_run(tmp_path)
    cfg = seed.parse_config(BASE + ["--out", out, "--resume", "--updates", "300", "--eval_every", "2",
                                    "--eval_tasks", "8", "--eval_greedy", "--save_every", "3",
                                    "--micro_batch_size", "1"])
    assert runfolder.open_folder(cfg, 0, 1) is True
    assert json.load(open(os.path.join(out, "config.json")))["updates"] == 300
    assert runfolder.read_metrics(out) == [{"update": 0, "success": 0.5}]


def test_without_resume_a_run_is_never_overwritten(tmp_path, capsys):
    out = a_run(tmp_path)
    with pytest.raises(SystemExit):
        runfolder.open_folder(seed.parse_config(BASE + ["--out", out]), 0, 1)
    assert "already holds a run" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a kill inside save_checkpoint

class Tok:
    name_or_path = ""

    def save_pretrained(self, out):
        open(os.path.join(out, "tokenizer.json"), "w").write("{}")


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def step(model, opt):
    loss = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_kill_between_the_renames_resumes_from_checkpoint_old(tmp_path, monkeypatch, capsys):
    """save_checkpoint: checkpoint -> checkpoint.old, then checkpoint.tmp -> checkpoint. A kill between the two
    leaves no checkpoint/: --resume continues from checkpoint.old (its update, optimizer, data order), keeping the
    metric lines up to it, instead of starting over and dropping them."""
    out = str(tmp_path / "run")
    cfg = seed.parse_config(BASE + ["--out", out, "--save_every", "1"])
    runfolder.open_folder(cfg, 0, 1)
    model, tok = tiny_model(), Tok()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data_rng = np.random.default_rng(0)
    step(model, opt)
    runfolder.write_metrics(out, {"update": 0, "success": 0.25})
    data_rng.random(3)
    runfolder.save_checkpoint(out, 1, model, opt, tok, data_rng)      # a whole checkpoint after update 0
    saved_rng = data_rng.bit_generator.state
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    step(model, opt)
    runfolder.write_metrics(out, {"update": 1, "success": 0.5})
    real = os.replace

    def killed(src, dst):                                              # the kill: after the first rename
        real(src, dst)
        if dst.endswith(".old"):
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(runfolder.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        runfolder.save_checkpoint(out, 2, model, opt, tok, data_rng)
    monkeypatch.setattr(runfolder.os, "replace", real)
    assert not os.path.exists(os.path.join(out, "checkpoint")) and os.path.isdir(os.path.join(out, "checkpoint.old"))

    cfg = seed.parse_config(BASE + ["--out", out, "--save_every", "1", "--resume"])
    assert runfolder.open_folder(cfg, 0, 1) is True
    assert "continuing from checkpoint.old" in capsys.readouterr().out
    from transformers import LlamaForCausalLM
    model2 = LlamaForCausalLM.from_pretrained(os.path.join(out, "checkpoint"))
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_weights[k]), k
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    rng2 = np.random.default_rng(0)
    assert runfolder.resume(out, model2, opt2, rng2) == 1
    assert rng2.bit_generator.state == saved_rng and opt2.state_dict()["state"]
    assert runfolder.read_metrics(out) == [{"update": 0, "success": 0.25}]   # update 1 is redone, not lost
    # the next save after a kill that left both folders (.old not yet removed) still swaps
    os.makedirs(os.path.join(out, "checkpoint.old"))
    runfolder.save_checkpoint(out, 2, model2, opt2, tok, rng2)
    assert sorted(os.listdir(out)) == ["checkpoint", "config.json", "episodes", "metrics.jsonl"]


# ----------------------------------------------------------------------------- --track

def test_track_tensorboard_logs_every_metric_line_and_the_config(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = str(tmp_path / "run")
    cfg = seed.parse_config(BASE + ["--out", out, "--track", "tensorboard"])
    runfolder.open_folder(cfg, 0, 1)
    lines = [{"update": -1, "eval/test/success": 0.25},
             {"update": 0, "success": 0.5, "loss/opd": 0.125, "gate/std": float("nan"), "note": "x", "flag": True},
             {"update": 1, "success": 0.75, "loss/opd": 0.0625, "eval/test/success": 0.5}]
    for m in lines:
        runfolder.write_metrics(out, m)
    runfolder.close_tracker(out)
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got == {"success": [(0, 0.5), (1, 0.75)], "loss/opd": [(0, 0.125), (1, 0.0625)],
                   "eval/test/success": [(-1, 0.25), (1, 0.5)]}
    text = [t for t in acc.Tags()["tensors"] if t.startswith("config")]
    assert text, acc.Tags()
    config = acc.Tensors(text[0])[0].tensor_proto.string_val[0].decode()
    assert '"track": "tensorboard"' in config and '"algo": "seed"' in config


def test_track_wandb_offline(tmp_path, monkeypatch):
    """--track wandb (offline: no account, no network) writes a wandb run in the run folder and keeps its id."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "run")
    cfg = seed.parse_config(BASE + ["--out", out, "--track", "wandb"])
    runfolder.open_folder(cfg, 0, 1)
    runfolder.write_metrics(out, {"update": 0, "success": 0.5})
    runfolder.close_tracker(out)
    assert os.path.exists(os.path.join(out, "wandb_id"))
    assert any(f.endswith(".wandb") for _, _, fs in os.walk(os.path.join(out, "wandb")) for f in fs)


def test_no_track_imports_no_tracker(tmp_path):
    """Without --track neither package is imported (a subprocess: this test process may hold them)."""
    code = f"""
import sys, runfolder, seed
cfg = seed.parse_config({BASE!r} + ["--out", {str(tmp_path / 'run')!r}])
seed.validate(cfg)
runfolder.open_folder(cfg, 0, 1)
runfolder.write_metrics(cfg.out, {{"update": 0, "success": 0.5}})
runfolder.plot_curves(cfg.out, runfolder.read_metrics(cfg.out))
print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorboard", "wandb", "tensorboardX")
             or m == "torch.utils.tensorboard"))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"
