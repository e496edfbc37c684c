"""Beyond one node (docs/gpu.md: beyond one node): the multi-node launch, two torchrun "nodes" of one process each on
this machine, joined through a c10d rendezvous on loopback (gloo), runs the same policy update as one node of two
processes. The update is tests/dist_update.py's (seed.update_policy on fixed rows), so a change to that entry
point is made in one place for both tests."""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
RUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_node(out):
    p = subprocess.run(RUN + ["--standalone", "--nproc_per_node=2", "tests/dist_update.py", out], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.load(open(out))


def two_nodes(out):
    """docs/gpu.md's multi-node command with --nnodes 2 --nproc_per_node 1, both nodes on loopback (node 0 hosts the
    rendezvous store)."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(RUN + ["--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "1",
                                     "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                                     "--rdzv_conf", f"is_host={int(r == 0)}", "--rdzv_id", "seed-test",
                                     "tests/dist_update.py", out],
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return json.load(open(out))


def test_two_nodes_equal_one_node_of_two_processes(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    a = one_node(str(tmp_path / "one" / "update.json"))
    b = two_nodes(str(tmp_path / "two" / "update.json"))
    assert a["world"] == b["world"] == 2 and b["rank_max_diff"] == 0.0
    assert len(a["grad_norms"]) == 2 and a["grad_norms"] == b["grad_norms"]
    assert a["sums"] == b["sums"]
    scale = max(v["norm"] for v in a["fingerprint"].values())
    assert scale > 1e-3, "the update did not move the parameters"
    assert a["fingerprint"] == b["fingerprint"]   # the same gloo reduction over the same two ranks: bit for bit
    # the run checkpoint written by the two-node job holds the same update (trainer state of both ranks)
    import torch
    state = torch.load(str(tmp_path / "two" / "checkpoint" / "trainer_state.pt"), weights_only=False)
    assert state["update"] == 1 and state["world"] == 2 and len(state["rng"]) == 2
