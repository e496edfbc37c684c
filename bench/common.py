"""What the three benchmarks share: the machine description, the load check, the measured matmul peak,
per-phase peak memory, the generated ALFWorld games and realistic training rows (replayed from a run's
recorded episodes, or collected fresh). Benchmarks, not tests: nothing here asserts a speed."""
import glob
import json
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_CACHE = os.path.join(ROOT, ".cache", "bench")     # generated games, run folders, cached rows
PY = sys.executable
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ----------------------------------------------------------------------------- the machine

def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags():
    """The vector extensions that decide the matmul peak (AVX-512 / native bf16 or not)."""
    try:
        flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return ""
    keep = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in keep if f in flags) or "-"


def versions():
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("vllm", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = "not installed"
    return out


def machine():
    """One line per fact, for RESULTS.md."""
    v = versions()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "flags": cpu_flags(), "torch_threads": torch.get_num_threads(),
            "load_1min": round(os.getloadavg()[0], 2), **v}


def wait_quiet(max_load=2.5, max_wait_s=180, poll_s=60):
    """The cores are shared: wait (up to max_wait_s) for the 1-minute load to drop below max_load.
    -> the load when the measurement starts (recorded with the numbers)."""
    t0 = time.time()
    load = os.getloadavg()[0]
    while load > max_load and time.time() - t0 < max_wait_s:
        print(f"[bench] 1-minute load {load:.2f} > {max_load}; waiting {poll_s} s", flush=True)
        time.sleep(poll_s)
        load = os.getloadavg()[0]
    if load > max_load:
        print(f"[bench] load still {load:.2f}; measuring anyway (recorded with the results)", flush=True)
    return round(load, 2)


def run_py(argv, log, tag="bench"):
    """One child python process (a script and its flags) from the repository root, its output appended to
    `log`; a failure stops the benchmark with the log's tail. -> wall seconds."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), PYTHONUNBUFFERED="1")
    print(f"[{tag}] {' '.join(argv)}  (log: {os.path.relpath(log, ROOT)})", flush=True)
    t = time.perf_counter()
    with open(log, "a") as f:
        p = subprocess.run([PY, *argv], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        sys.exit(f"{argv[0]} failed (exit {p.returncode}); last output:\n{open(log).read()[-3000:]}")
    return time.perf_counter() - t


def matmul_peak(dtype, n_max=2048, reps=5, budget_s=1.0):
    """Best-of-`reps` FLOP/s of torch.matmul on [n, n] x [n, n] in `dtype`, all torch threads, per second of
    wall time and per second of process CPU time (all threads together; robust to other processes taking
    the cores). n doubles from 256 up to n_max while one product takes under budget_s (a CPU without native
    bf16 runs bf16 matmul through a slow fallback at ~1 GFLOP/s: there 2048^3 would take a minute).
    -> (wall FLOP/s, CPU FLOP/s, n)."""
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.matmul(a, b)                                    # warm-up (kernel selection, packing)
        (one, one_cpu) = clock(lambda: torch.matmul(a, b))[1:]
        if n >= n_max or one * 8 > budget_s:                 # the next size would take 8x longer
            break
        n *= 2
    best, best_cpu = one, one_cpu
    for _ in range(reps - 1):
        _, w, c = clock(lambda: torch.matmul(a, b))
        best, best_cpu = min(best, w), min(best_cpu, c)
    return 2 * n ** 3 / best, 2 * n ** 3 / best_cpu, n


def clock(fn):
    """-> (fn(), wall seconds, process CPU seconds over all threads)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


# ----------------------------------------------------------------------------- memory

def reset_peak_rss():
    """Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM), so a phase's peak can be read."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb():
    """VmHWM (peak resident set since the last reset) in MiB; falls back to ru_maxrss (peak since start)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb():
    import psutil
    return psutil.Process().memory_info().rss / 2 ** 20


# ----------------------------------------------------------------------------- data

def games_dir(n_train=16):
    """Generated ALFWorld games (official layout) under .cache/bench/alfworld, made once (~1 min)."""
    out = os.path.join(BENCH_CACHE, "alfworld")
    if not glob.glob(os.path.join(out, "json_2.1.1", "train", "*", "*", "game.tw-pddl")):
        os.makedirs(out, exist_ok=True)
        print(f"[bench] generating {n_train} ALFWorld games into {out}", flush=True)
        subprocess.run([PY, "-m", "envs.alfworld_gen", "--out", out, "--train", str(n_train), "--valid_seen", "2",
                        "--valid_unseen", "2", "--seed", "0", "--workers", "1", "--overwrite"], cwd=ROOT, check=True)
    return out


def replay_rows(episodes_file, tokenizer):
    """Training rows (prompt ids, response ids) of a recorded episodes/update_XXXX.jsonl, rebuilt exactly:
    each episode is replayed in its env (same task id, same responses), so every prompt is the one the
    actor saw. Response ids are the recorded text re-tokenized (+ EOS), which matches the sampled length
    up to tokenization differences. The env settings come from the run's config.json."""
    import envs
    import rollout
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(episodes_file)))
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    kw = dict(split="train", history_length=cfg["history_length"], max_steps=cfg["max_steps"])
    if cfg["env"] == "alfworld":
        kw["data_dir"] = cfg.get("data_dir") or None
    env = envs.make(cfg["env"], **kw)
    rows = []
    for e, line in enumerate(open(episodes_file)):
        ep = json.loads(line)
        env.reset(seed=int(ep["task_id"]))
        for st in ep["steps"]:
            prompt = rollout.chat_ids(tokenizer, env.prompt())[-cfg["max_prompt_tokens"]:]
            resp = tokenizer(st["response"], add_special_tokens=False)["input_ids"][:cfg["max_tokens"] - 1]
            rows.append({"prompt": prompt, "response": resp + [tokenizer.eos_token_id], "episode": e,
                         "group": ep["group_id"], "skill": ep.get("skill"), "prompt_text": env.prompt()})
            env.step(st["response"])
    return rows


def latest_episodes(pattern=os.path.join(BENCH_CACHE, "runs", "*", "episodes", "update_*.jsonl")):
    files = sorted(glob.glob(pattern), key=os.path.getmtime)
    return files[-1] if files else None
