"""The token picture and the demo's last lines (runfolder.write_token_page, runfolder.what_seed_did, diagnostics.shown_rows):
rows picked from one update are written to tokens.json and tokens.html; the page holds each row's skill and one
shaded token per response token; the summary names the episode, its skill, the moved tokens and the update's
sizes. Where Chromium is installed the page is also rendered headless and the screenshot is not blank (the content
checks run everywhere). The quiet console leaves SEED_VERBOSE=1 alone."""
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import grpo
import diagnostics
import opd
import runfolder
from rollout import Episode, Step

SKILL = "Avoid <guessing> & play the cards' sum first."


def an_update(tokenizer):
    """Two episodes of one task (a won and a lost one, with skills), their rows with lp_old and lp_skill."""
    eps, steps = [], []
    for e, won in enumerate((True, False)):
        ep = Episode(task_id=3, group_id=0, env="ezpoints", task="Make 12 from 5 and 7.", won=won,
                     reward=10.0 * won, skill=SKILL if won else "Never repeat a card.")
        for t, text in enumerate(['{"thoughts": "add", "action": "5"}', '{"thoughts": "then", "action": "+"}'][:1 + e]):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ep.steps.append(Step(prompt_text="p", prompt_ids=[1, 2], response_ids=ids, response_text=text,
                                 engine_logprobs=[0.0] * len(ids), observation="o", action=text[-4:-2], valid=True))
        eps.append(ep)
        steps += ep.steps
    row_episode = [e for e, ep in enumerate(eps) for _ in ep.steps]
    g = torch.Generator().manual_seed(0)
    lp = [-torch.rand(len(s.response_ids), generator=g) * 3 for s in steps]          # [tokens] each
    rows = grpo.Rows([s.prompt_ids for s in steps], [torch.tensor(s.response_ids) for s in steps],
                     adv=torch.tensor([1.0, -0.5, -0.5]), has_skill=torch.ones(3),
                     lp_skill=[x + torch.randn(len(x), generator=g) for x in lp])
    return rows, lp, steps, eps, row_episode


def test_page_holds_the_skill_and_one_shaded_token_per_response_token(tokenizer, tmp_path):
    rows, lp, steps, eps, row_episode = an_update(tokenizer)
    shown = diagnostics.shown_rows(tokenizer, rows, lp, steps, eps, row_episode)
    assert [r["won"] for r in shown] == [True, False, False]   # the won episode first, then the lost one, every step
    for r, s, old, sk in zip(shown, steps, lp, rows.lp_skill):
        assert "".join(t[0] for t in r["tokens"]) == tokenizer.decode(s.response_ids, skip_special_tokens=True)
        gate = opd.gates(old, sk)
        assert np.allclose([t[3] for t in r["tokens"]], gate.numpy(), atol=1e-4)
    path = runfolder.write_token_page(str(tmp_path), 7, shown)
    assert path == str(tmp_path / "tokens.html")
    page = open(path).read()
    assert "Avoid &lt;guessing&gt; &amp; play the cards&#x27; sum first." in page and "Never repeat a card." in page
    spans = re.findall(r"<span class='tok' style='background:rgba\((\d+),\d+,\d+,([\d.]+)\)' title='student", page)
    assert len(spans) == sum(len(s.response_ids) for s in steps)   # one shaded span per response token
    gates = [t[3] for r in shown for t in r["tokens"]]
    for (red, alpha), g in zip(spans, gates):                         # green where g > 0.5, red below
        assert (red == "46") == (g >= 0.5) and abs(float(alpha) - min(abs(g - 0.5) * 2, 1)) < 0.011
    assert json.load(open(tmp_path / "tokens.json"))["update"] == 7

    runfolder.write_metrics(str(tmp_path), {"update": 7, "success": 0.5, "loss/opd": 0.02, "loss/pg": -0.01,
                                            "gate/mean": 0.49, "gate/std": 0.1, "diag/tied_groups": 0.5})
    lines = runfolder.what_seed_did(str(tmp_path))
    text = "\n".join(lines)
    assert "update 7" in lines[0] and "won episode" in lines[0] and SKILL in text and "Make 12" in text
    assert "OPD loss 0.02," in text and "tied groups 0.50" in text and "tokens.html" in text
    assert len(lines) <= 8 and all(len(x) < 400 for x in lines)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium:   # a real rendering where a browser exists: the screenshot is not blank
        png = tmp_path / "tokens.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=900,600",
                        "file://" + path], capture_output=True, timeout=120)
        from PIL import Image
        px = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)
        assert len(np.unique(px, axis=0)) > 50                               # text and shades, not one colour
        assert ((px[:, 1] > px[:, 0] + 40) & (px[:, 1] > 120)).any()         # some green
        assert ((px[:, 0] > px[:, 1] + 40) & (px[:, 0] > 120)).any()         # some red


def test_no_rows_without_a_rescore(tokenizer, tmp_path):
    rows, lp, steps, eps, row_episode = an_update(tokenizer)
    rows.lp_skill = None
    assert diagnostics.shown_rows(tokenizer, rows, lp, steps, eps, row_episode) == []
    assert runfolder.write_token_page(str(tmp_path), 0, []) is None and not os.listdir(tmp_path)


def test_quiet_console_leaves_verbose_alone(monkeypatch):
    monkeypatch.setenv("SEED_VERBOSE", "1")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert runfolder.quiet_console() is False and "VLLM_LOGGING_LEVEL" not in os.environ
    assert runfolder.progress_off(False) is True and runfolder.progress_off(True) is None


def test_quiet_console_turns_the_libraries_down(monkeypatch):
    import warnings
    import transformers
    for k in ("SEED_VERBOSE", "VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(k, raising=False)
    level = transformers.utils.logging.get_verbosity()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert runfolder.quiet_console() is True
            warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
            warnings.warn("ours", UserWarning)
        assert [str(w.message) for w in seen] == ["ours"]   # the project's own warnings stay
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
        assert not transformers.utils.logging.is_progress_bar_enabled()
    finally:
        transformers.utils.logging.set_verbosity(level)
        transformers.utils.logging.enable_progress_bar()
