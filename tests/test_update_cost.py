"""bench/update_cost.py's numbers, on hand-written phase seconds (no model): medians and spread over the
repeats, the shared-phase check and its 15 % rule, the like-for-like ratio, the ABBA order, and which
Stage-1 checkpoint `--init auto` picks."""
import os

import pytest

from bench import update_cost as uc


def phases(collect, analyze, logprobs, rescore, update, push, other=1.0):
    p = dict(collect=collect, analyze=analyze, logprobs=logprobs, rescore=rescore, update=update, push=push)
    return p | {"other": other, "total": sum(p.values()) + other}


def test_summarize_is_median_min_max_over_repeats():
    reps = [phases(10, 0, 20, 0, 50, 1), phases(30, 0, 22, 0, 40, 1), phases(12, 0, 21, 0, 45, 2)]
    s = uc.summarize(reps)
    assert s["collect"] == (12, 10, 30)           # one slow repeat moves the median by nothing
    assert s["update"] == (45, 40, 50)
    assert s["total"] == (82, 81, 94)
    assert s["push"] == (1, 1, 2)


def test_like_for_like_adds_only_seeds_own_phases_to_grpos_update():
    g = phases(20, 0, 15, 0, 60, 0.5, other=4.5)          # total 100
    s = phases(21, 12, 15.5, 13, 58, 0.5, other=5)
    r = uc.ratios(g, s)
    assert r["like_for_like"] == pytest.approx((100 + 12 + 13) / 100)
    assert r["measured"] == pytest.approx(s["total"] / 100)
    assert r["shared"]["collect"] == pytest.approx(21 / 20)
    assert r["shared_sum"] == pytest.approx((21 + 15.5 + 58 + 0.5) / (20 + 15 + 60 + 0.5))
    assert not r["noisy"] and r["off"] == []
    assert uc.headline(r) == "seed/grpo update time: 1.25 like for like, 1.25 measured"


def test_the_issues_run_is_noise_dominated_and_gets_no_ratio():
    """The single-shot run that printed 0.47: grpo's shared phases took 2-4x seed's on the same rows."""
    g = phases(178.8, 0, 102.6, 0, 338.2, 1.0)
    s = phases(37.1, 30.0, 43.9, 0, 164.0, 1.0)
    r = uc.ratios(g, s)
    assert r["noisy"] and {"collect", "logprobs", "update", "all shared"} <= set(r["off"])
    line = uc.headline(r)
    assert "noise-dominated" in line and "like for like" not in line and f"{r['measured']:.2f}" not in line


def test_fifteen_percent_rule_on_phases_that_matter():
    g = phases(20, 0, 20, 0, 50, 0.5, other=9.5)          # total 100
    assert not uc.ratios(g, phases(20, 9, 20, 9, 57, 0.5))["noisy"]       # update +14 %
    r = uc.ratios(g, phases(20, 9, 20, 9, 58, 0.5))                       # update +16 %
    assert r["noisy"] and r["off"] == ["update"]
    assert not uc.ratios(g, phases(20, 9, 20, 9, 50, 1.5))["noisy"]       # push 3x, but 0.5 % of the update
    assert uc.ratios(g, phases(20, 9, 16, 9, 50, 0.5))["off"] == ["logprobs"]   # -20 %
    # each large phase within the limit, a small one far off: their sum decides
    g = phases(20, 0, 20, 0, 50, 5, other=5)               # push: 5 % of the update
    assert uc.ratios(g, phases(22, 9, 22, 9, 55, 20))["off"] == ["all shared"]     # (22+22+55+20) / 95 = 1.25


def test_abba_order_and_timed_updates():
    assert uc.order(4) == [("grpo", "seed"), ("seed", "grpo"), ("grpo", "seed"), ("seed", "grpo")]
    lines = [{"sec/collect": 9.0, "sec/total": 20.0}, {"sec/collect": 3.0, "sec/update": 4.0, "sec/total": 10.0}]
    sec, n = uc.phase_seconds(lines, skip_first=True)
    assert n == 1 and sec["collect"] == 3.0 and sec["other"] == 3.0 and sec["analyze"] == 0.0
    assert uc.phase_seconds(lines, skip_first=False)[0]["collect"] == 6.0


def test_init_auto_is_the_bench_copy(tmp_path, monkeypatch):
    copy = tmp_path / "cache" / "demo-sft"
    os.makedirs(copy)
    monkeypatch.setattr(uc, "BENCH_SFT", str(copy))
    (copy / "stage1.json").write_text("{}")
    assert uc.stage1_checkpoint("auto") == (str(copy), "the bench's ALFWorld Stage 1")
    assert uc.stage1_checkpoint("")[0] == ""
    with pytest.raises(SystemExit, match="not a checkpoint folder"):
        uc.stage1_checkpoint(str(tmp_path / "nowhere"))
