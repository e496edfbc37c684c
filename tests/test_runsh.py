"""run.sh's paper rows (README: one command per paper row): each row's algorithm, start, Stage 1 and run folder,
read from the commands run.sh would start (a stand-in venv whose torchrun and python print their arguments)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fake_repo(tmp_path):
    shutil.copy(os.path.join(ROOT, "run.sh"), tmp_path / "run.sh")
    for name in ("requirements-cpu.txt", "requirements-gpu.txt", "requirements-extra.txt"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for tool in ("python", "torchrun"):
        (bin_ / tool).write_text(f'#!/bin/bash\necho "{tool.upper()} $*"\n')
        (bin_ / tool).chmod(0o755)
    key = subprocess.run("bash -c 'source <(sed -n \"/^has_gpu()/,/^up_to_date()/p\" run.sh); req_key'",
                         shell=True, cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / ".venv" / ".seed-setup").write_text(key + "\n")
    return tmp_path


def recipe(repo, *args, **env):
    """run.sh in the fake repository, with its fake .venv (a caller's $SEED_VENV, as `SEED_VENV=... ./run.sh test`
    sets, would send run.sh to the real one)."""
    clean = {k: v for k, v in os.environ.items() if k != "SEED_VENV"}
    p = subprocess.run(["bash", "run.sh", *args], cwd=repo, capture_output=True, text=True, timeout=60,
                       env=dict(clean, **env))
    lines = [x for x in p.stdout.splitlines() if x.startswith("TORCHRUN")]
    return p.returncode, lines, p.stderr


@pytest.mark.parametrize("args, algo, init, folder, stage1", [
    (["alfworld"], "seed", "runs/sft-alfworld", "runs/seed-alfworld", True),
    (["alfworld", "seed"], "seed", "runs/sft-alfworld", "runs/seed-alfworld", True),
    (["alfworld", "grpo"], "grpo", "", "runs/grpo-alfworld", False),
    (["alfworld", "vanilla"], "vanilla", "", "runs/vanilla-alfworld", False),
    (["alfworld", "wo_sft"], "seed", "", "runs/wo_sft-alfworld", False),
    (["alfworld", "wo_opd"], "grpo", "runs/sft-alfworld", "runs/wo_opd-alfworld", True),
    (["alfworld", "static_skills"], "static_skills", "runs/sft-alfworld", "runs/static_skills-alfworld", True),
    (["sokoban", "skill_grpo"], "skill_grpo", "", "runs/skill_grpo-sokoban", True),
    (["alfworld", "rlsd"], "rlsd", "", "runs/rlsd-alfworld", False),
    (["alfworld", "--lr", "2e-6"], "seed", "runs/sft-alfworld", "runs/seed-alfworld", True),
    (["alfworld", "grpo", "--train_fraction", "0.2"], "grpo", "", "runs/grpo-alfworld-f0.2", False),
])
def test_each_row_has_its_start_and_folder(fake_repo, args, algo, init, folder, stage1):
    rc, lines, err = recipe(fake_repo, *args)
    assert rc == 0, err
    assert len(lines) == (2 if stage1 else 1), lines
    if stage1:
        assert " sft.py " in lines[0] and "--out runs/sft-" in lines[0]
    cmd = lines[-1].split()
    assert cmd[cmd.index("--algo") + 1] == algo and cmd[cmd.index("--out") + 1] == folder
    i = cmd.index("--init")
    assert (cmd[i + 1] if not cmd[i + 1].startswith("--") else "") == init   # '' prints as nothing
    assert "--resume" in cmd and cmd[cmd.index("--updates") + 1] == "150"
    if args[1:2] == ["--lr"] or "--train_fraction" in args:
        assert cmd[-2:] == args[-2:]                                        # extra flags reach seed.py last
    if algo == "skill_grpo":
        assert cmd[cmd.index("--skill_library") + 1] == "runs/sft-sokoban/skills.jsonl"


def test_unknown_row_stops(fake_repo):
    rc, lines, err = recipe(fake_repo, "alfworld", "ppo")
    assert rc == 2 and not lines and "unknown row 'ppo'" in err


def test_several_nodes(fake_repo):
    rc, lines, err = recipe(fake_repo, "alfworld", "grpo", NNODES="2", NODE_RANK="1", RDZV_ENDPOINT="h:29400")
    assert rc == 0, err
    assert lines[-1].startswith("TORCHRUN --nnodes=2 --node_rank=1 --nproc_per_node=8 --rdzv_backend=c10d "
                                "--rdzv_endpoint=h:29400 seed.py")
