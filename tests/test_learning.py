"""bench/learning.py's bookkeeping, on hand-written metrics lines in seed.py's format (no model): which runs
count as finished, the area under the held-out curve, and one arm minus another (SEED - (w/o OPD)) paired by seed at matched updates
(mean, standard error and Student's t 95% interval)."""
import json
import os

import pytest

from bench import learning


def write_run(folder, updates, evals):
    """A run folder's metrics.jsonl: the --eval_first line (update -1), then one line per update; `evals`
    maps updates done -> held-out success."""
    os.makedirs(folder, exist_ok=True)
    lines = [{"update": -1, "eval/test/success": evals[0], "eval_greedy/test/success": evals[0]}]
    for u in range(updates):
        m = {"update": u, "success": 0.5, "length": 4.0, "invalid_rate": 0.1, "sec/total": 12.0,
             "diag/tied_groups": 0.25} | ({"diag/gate_std_response": 0.2} if "seed-" in folder else {})
        if u + 1 in evals:
            m |= {"eval/test/success": evals[u + 1], "eval_greedy/test/success": evals[u + 1], "sec/eval": 2.0}
        lines.append(m)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)


def test_auc_is_the_mean_success_over_the_updates():
    assert learning.auc({0: 0.0, 2: 1.0, 4: 1.0}) == 0.75
    assert learning.auc({0: 0.3}) != learning.auc({0: 0.3})      # one point: nan, not a number


def test_table_pairs_seeds_and_stops_at_the_update_every_run_reached(tmp_path, monkeypatch):
    monkeypatch.setattr(learning, "RESULTS", str(tmp_path / "results"))
    args, _ = learning.parse_args(["--algos", "seed,grpo", "--seeds", "2", "--updates", "4", "--eval_every", "2"])
    cache = str(tmp_path / "cache")
    write_run(f"{cache}/runs/seed-s0", 4, {0: 0.1, 2: 0.4, 4: 0.6})
    write_run(f"{cache}/runs/seed-s1", 4, {0: 0.2, 2: 0.3, 4: 0.5})
    write_run(f"{cache}/runs/grpo-s0", 4, {0: 0.1, 2: 0.2, 4: 0.3})
    write_run(f"{cache}/runs/grpo-s1", 3, {0: 0.2, 2: 0.2})          # killed after 3 updates
    lines = lambda algo, s: learning.lines_of(args, cache, algo, s)
    assert learning.finished(lines("seed", 1), 4) and not learning.finished(lines("grpo", 1), 4)
    res = learning.report(args, cache, "bench/learning.py ...")
    md = open(tmp_path / "results" / args.name / "table.md").read()
    assert "at 2 (T=0.4)" in md                                      # the last evaluation all runs reached
    # (0.4 - 0.2, 0.3 - 0.2): mean, SE = sample std 0.0707 / sqrt(2), 95% interval 0.15 ± t(1) 12.706 x SE
    assert "| 2 | +0.150 ± 0.050 [-0.485, +0.785] |" in md
    assert "| 0 | +0.000 ± 0.000 [+0.000, +0.000] |" in md and "| 4 |" not in md
    assert "| 0.250 ± 0.000 | 0.200 ± 0.000 |" in md and "| 0.250 ± 0.000 | - |" in md   # ties; gate std where scored
    assert "| seed | 0.400 | 0.300 |" in md and "| grpo | 0.200 | 0.200 |" in md      # by seed, at 2
    assert os.path.getsize(tmp_path / "results" / args.name / "curves.png") > 10_000
    assert [len(r["lines"]) for r in res["grpo"]] == [4, 3]


def test_sokoban_chance_is_exact_at_one_step():
    """With a 1-step budget every room is a one-push room with a single winning move: a uniform mover wins
    exactly a quarter of them, and the four repeated moves win each room exactly once between them."""
    from bench import sokoban_chance
    uniform, by_plan, constant = sokoban_chance.chance(1, 8)
    assert uniform == 0.25 and list(by_plan) == [1] and by_plan[1][1] == 8
    assert abs(sum(constant.values()) - 1.0) < 1e-12


def test_a_cache_built_with_other_warm_start_flags_stops_before_anything_runs(tmp_path, monkeypatch):
    """The config name holds the Stage-2 sizes only; a cached config whose warm start or Stage 1 was built
    with other flags must not be reused silently."""
    import pytest
    from bench import common
    monkeypatch.setattr(common, "BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(learning, "checkpoints", lambda *a: pytest.fail("checkpoints built before the check"))
    args, extra = learning.parse_args([])
    cache = tmp_path / "learning" / args.name
    cache.mkdir(parents=True)
    shared = learning.seed_argv(args, str(cache / "stage1"), extra)
    flags = {"warmup_tasks": 53, "warmup_lr": 2e-4, "stage1_tasks": 16, "stage1_k0": 2, "stage1_lr": 2e-4,
             "stage1_replay": 16}
    (cache / "bench_config.json").write_text(json.dumps({"seed_argv": shared, "checkpoint_flags": flags}))
    with pytest.raises(SystemExit, match="other flags"):
        learning.main(["--warmup_tasks", "400"])
    with pytest.raises(SystemExit, match="other flags"):
        learning.main(["--kl_coef", "0.5"])


def test_a_resume_may_change_the_evaluation_cadence(tmp_path, monkeypatch):
    """A later sitting may evaluate less often (--eval_every) on the cached runs; the check lets that through."""
    from bench import common
    monkeypatch.setattr(common, "BENCH_CACHE", str(tmp_path))
    ran = []
    monkeypatch.setattr(learning, "checkpoints", lambda *a: None)
    monkeypatch.setattr(learning, "run_all", lambda args, cache, shared, *a: ran.append(shared))
    monkeypatch.setattr(learning, "report", lambda *a: None)
    args, extra = learning.parse_args(["--eval_every", "3"])
    cache = tmp_path / "learning" / args.name
    cache.mkdir(parents=True)
    shared = learning.seed_argv(args, str(cache / "stage1"), extra)
    (cache / "bench_config.json").write_text(json.dumps({"seed_argv": shared}))
    learning.main(["--eval_every", "6"])
    assert ran and ran[0][ran[0].index("--eval_every") + 1] == "6"


def test_the_shared_start_is_evaluated_once(tmp_path, monkeypatch):
    """Every run starts from the same checkpoint, so only the first algo's seed 0 evaluates it (--eval_first);
    the other runs spend no time on the same numbers."""
    from bench import common
    calls = []
    monkeypatch.setattr(common, "run_py", lambda argv, log, tag: calls.append(argv) or 0.0)
    args, extra = learning.parse_args(["--algos", "seed,grpo", "--seeds", "2"])
    learning.run_all(args, str(tmp_path), learning.seed_argv(args, "stage1", extra), "warm", "stage1")
    runs = [(a[a.index("--algo") + 1], a[a.index("--seed") + 1], "--eval_first" in a) for a in calls]
    assert runs == [("seed", "0", True), ("grpo", "0", False), ("seed", "1", False), ("grpo", "1", False)]


def test_arms_start_where_their_paper_row_starts(tmp_path, monkeypatch):
    """grpo@warm is Table 1's GRPO: it starts from the warm start (no Stage 1) and evaluates that start itself;
    an arm's +flag=value pairs reach its seed.py run (a later flag wins over the shared ones)."""
    from bench import common
    calls = []
    monkeypatch.setattr(common, "run_py", lambda argv, log, tag: calls.append(argv) or 0.0)
    args, extra = learning.parse_args(["--algos", "grpo,grpo@warm,seed+lambda_opd=0.1", "--seeds", "1"])
    learning.run_all(args, str(tmp_path), learning.seed_argv(args, "stage1", extra), "warm", "stage1")
    last = lambda a, flag: a[len(a) - 1 - a[::-1].index(flag) + 1]      # the value argparse keeps
    assert [(last(a, "--algo"), last(a, "--init"), "--eval_first" in a) for a in calls] == [
        ("grpo", "stage1", True), ("grpo", "warm", True), ("seed", "stage1", False)]
    assert last(calls[2], "--lambda_opd") == "0.1" and "--lambda_opd" not in calls[0]
    assert learning.label("grpo").startswith("w/o OPD") and learning.label("grpo@warm").startswith("GRPO (Table 1")
    with pytest.raises(SystemExit, match="bad arm"):
        learning.arm_argv("grpo@base", "warm", "stage1")


def test_a_later_sitting_adds_seeds_and_finished_runs_outlive_the_cache(tmp_path, monkeypatch):
    """--first_seed 2 runs seeds 2 and 3 (the start evaluated by the first of them); a run's metrics are kept
    beside the results, so a machine without the cache skips it and still reports it."""
    from bench import common
    monkeypatch.setattr(learning, "RESULTS", str(tmp_path / "results"))
    calls = []

    def fake_run(argv, log, tag):                  # a finished run: its metrics.jsonl in its run folder
        calls.append(argv)
        write_run(argv[argv.index("--out") + 1], 2, {0: 0.1, 2: 0.3})
        return 0.0
    monkeypatch.setattr(common, "run_py", fake_run)
    args, extra = learning.parse_args(["--algos", "seed,grpo", "--seeds", "2", "--first_seed", "2", "--updates", "2",
                                       "--eval_every", "2"])
    learning.run_all(args, str(tmp_path / "cache"), learning.seed_argv(args, "stage1", extra), "warm", "stage1")
    runs = [(a[a.index("--algo") + 1], a[a.index("--seed") + 1], "--eval_first" in a) for a in calls]
    assert runs == [("seed", "2", True), ("grpo", "2", False), ("seed", "3", False), ("grpo", "3", False)]
    calls.clear()
    learning.run_all(args, str(tmp_path / "other_machine"), learning.seed_argv(args, "stage1", extra), "warm", "stage1")
    assert calls == []                                                  # the kept copies say: all done
    res = learning.report(args, str(tmp_path / "other_machine"), "bench/learning.py ...")
    assert [r["seed"] for r in res["grpo"]] == [2, 3]
