"""Training-step efficiency of Stage 2 (the joint-objective update and the no-grad log-prob passes of Algorithm 1).

Measured in one run on this machine:
  * the matmul peak: torch.matmul on large square matrices, float32 and bfloat16, all torch threads;
  * padding waste (padded tokens / real tokens) of the micro-batches, on realistic rows (replayed from a
    run's recorded episodes/update_XXXX.jsonl), in row order (seed.py before its length sorting) and
    length-sorted (seed.py now: grpo.by_length, by (prompt, response) length);
  * achieved FLOP/s of one no-grad log-prob pass (grpo.response_logprobs per micro-batch, counted
    2 x params x tokens) and of the update (seed.micro_loss per micro-batch, backward, grad clip, AdamW:
    seed.update_policy's step with the micro-batches laid out here; counted 6 x params x tokens), for
    each layout, on a subset of those rows.

    .venv/bin/python bench/train_step.py                       # rows from the newest bench run
    .venv/bin/python bench/train_step.py --episodes runs/x/episodes/update_0000.jsonl --rows 32
"""
import argparse
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402


# ----------------------------------------------------------------------------- micro-batch layouts

def layout_waste(rows, batches):
    """Padded tokens / real tokens when each batch is laid out as [left-padded prompt | right-padded
    response] (grpo.response_logprobs). rows: list of (prompt_len, response_len); batches: index lists."""
    real = sum(p + r for p, r in rows)
    cells = sum(len(b) * (max(rows[i][0] for i in b) + max(rows[i][1] for i in b)) for b in batches if b)
    return (cells - real) / real


def chunks(idx, size):
    return [list(idx[i:i + size]) for i in range(0, len(idx), size)]


def by_length(rows, idx):
    """The fix, as grpo.by_length does it: sort by (prompt length, response length). rows: [(P, R)]."""
    return sorted(idx, key=lambda i: rows[i])


def update_batches(rows, mini, micro, seed, sort):
    """seed.update_policy: rows shuffled, split into mini-batches, micro-batches of `micro` rows. sort=True
    sorts inside each mini-batch (same rows per optimizer step, so the same gradient). -> [[micro-batch]]
    per mini-batch, flattened."""
    order = np.random.default_rng([seed, 0, 0]).permutation(len(rows))
    out = []
    for part in np.array_split(order, max(1, math.ceil(len(rows) / mini))):
        part = list(part)
        out += chunks(by_length(rows, part) if sort else part, micro)
    return out


def pass_batches(rows, micro, sort):
    """grpo.batch_logprobs: rows in episode order in chunks of `micro`; sort=True: globally by length."""
    idx = list(range(len(rows)))
    return chunks(by_length(rows, idx) if sort else idx, micro)


def padding_table(rows, mini, micro, seed):
    lens = [(len(r["prompt"]), len(r["response"])) for r in rows]
    return [
        ("update (shuffled rows)", layout_waste(lens, update_batches(lens, mini, micro, seed, False)),
         layout_waste(lens, update_batches(lens, mini, micro, seed, True))),
        ("no-grad pass (old / ref, episode order)", layout_waste(lens, pass_batches(lens, micro, False)),
         layout_waste(lens, pass_batches(lens, micro, True))),
    ]


# ----------------------------------------------------------------------------- FLOP counts

def flop_counts(model):
    """Parameter counts for the FLOP formulas: all parameters (the usual 6 N T), and the parts an exact
    count separates (embedding/LM head, computed only on the kept R+1 positions by logits_to_keep)."""
    n_all = sum(p.numel() for p in model.parameters())
    n_emb = model.get_input_embeddings().weight.numel()
    return n_all, n_emb


def exact_fwd_flops(cfg, n_all, n_emb, tied, batches, lens):
    """Forward matmul FLOPs actually asked for: linear layers on every real token, the LM head on the
    response positions, attention scores and values (QK^T and AV: 4 d per (query, key) pair, causal)."""
    n_body = n_all - n_emb * (1 if tied else 2)
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    total = 0
    for b in batches:
        for i in b:
            p, r = lens[i]
            t = p + r
            total += 2 * n_body * t + 2 * n_emb * (r + 1) + L * 4 * d * t * (t + 1) / 2
    return total


# ----------------------------------------------------------------------------- timing

def make_rows(sub):
    import grpo
    adv = torch.tensor(np.random.default_rng(0).standard_normal(len(sub)), dtype=torch.float32)
    return grpo.Rows([r["prompt"] for r in sub], [r["response"] for r in sub], adv, torch.ones(len(sub)))


LAYOUTS = ("row order", "length-sorted")   # --one_row adds "one row": a forward per row, no padding at all
                                          # (what packing buys, without a varlen attention kernel)


def layout_batches(lens, layout, cfg, seed):
    """-> (no-grad pass micro-batches, update mini-batches as lists of micro-batches)."""
    micro = 1 if layout == "one row" else cfg.micro_batch_size
    sort = layout != "row order"
    idx = list(range(len(lens)))
    passes = chunks(by_length(lens, idx) if sort else idx, micro)
    order = np.random.default_rng([seed, 0, 0]).permutation(len(lens))
    minis = [chunks(by_length(lens, list(p)) if sort else list(p), micro)
             for p in np.array_split(order, max(1, math.ceil(len(lens) / cfg.mini_batch_size)))]
    return passes, minis


@torch.no_grad()
def run_pass(grpo, model, rows, batches, pad_id):
    """One no-grad log-prob pass over the rows in these micro-batches -> per-row 1-D log-probs."""
    out = [None] * len(rows)
    for b in batches:
        lp, _, _ = grpo.response_logprobs(model, [rows.prompts[i] for i in b], [rows.responses[i] for i in b], pad_id)
        for k, i in enumerate(b):
            out[i] = lp[k, :len(rows.responses[i])].clone()
    return out


def run_update(seed_mod, model, opt, rows, minis, cfg, pad_id):
    """seed.update_policy's optimizer steps with the given micro-batches: per mini-batch, the joint loss
    of each micro-batch as its share of the mini-batch token mean (seed.micro_loss), backward, clip, AdamW."""
    for micros in minis:
        n_tok = float(sum(len(rows.responses[i]) for b in micros for i in b))
        opt.zero_grad(set_to_none=True)
        for b in micros:
            run = SimpleNamespace(cfg=cfg, model=model, tok=SimpleNamespace(pad_token_id=pad_id), world=1,
                                  device=torch.device("cpu"))
            loss, _, _ = seed_mod.micro_loss(run, rows.take(b), n_tok, n_tok)   # every row has a skill
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()


# ----------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", default=None, help="a recorded episodes/update_XXXX.jsonl (default: newest bench run)")
    ap.add_argument("--rows", type=int, default=16, help="rows (steps) timed; the padding table uses all rows")
    ap.add_argument("--micro_batch", type=int, default=8, help="rows per forward (seed.py --micro_batch_size)")
    ap.add_argument("--mini_batch", type=int, default=256, help="rows per optimizer step (seed.py --mini_batch_size)")
    ap.add_argument("--repeats", type=int, default=2, help="timings per layout (interleaved; the best counts)")
    ap.add_argument("--one_row", action="store_true", help="also time one row per forward (no padding; slow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_wait", type=int, default=180, help="seconds to wait for a quiet machine")
    args = ap.parse_args(argv)

    import rollout
    import seed as seed_mod
    episodes = args.episodes or common.latest_episodes()
    if not episodes:
        sys.exit("no recorded episodes: run bench/update_cost.py first (it records runs under .cache/bench/runs), "
                 "or pass --episodes runs/<name>/episodes/update_XXXX.jsonl")
    model, tok, _ = rollout.load_model(rollout.EMBEDDED)
    rows = common.replay_rows(episodes, tok)
    print(f"[bench] {len(rows)} rows replayed from {episodes}", flush=True)

    load = common.wait_quiet(max_wait_s=args.max_wait)
    peaks = [(common.matmul_peak(torch.float32), common.matmul_peak(torch.bfloat16))]

    pad_rows = padding_table(rows, args.mini_batch, args.micro_batch, args.seed)
    sub = [rows[i] for i in sorted(np.random.default_rng(args.seed).choice(len(rows), min(args.rows, len(rows)),
                                                                             replace=False))]
    lens = [(len(r["prompt"]), len(r["response"])) for r in sub]
    T = sum(p + r for p, r in lens)
    cfg = seed_mod.Config(algo="seed", micro_batch_size=args.micro_batch, mini_batch_size=args.mini_batch)
    n_all, n_emb = flop_counts(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    trows = make_rows(sub)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    pad_id = tok.pad_token_id

    import grpo
    # warm-up: a forward and an optimizer step on two rows (oneDNN kernel choice, allocator, AdamW state)
    warm = trows.take([0, 1])
    warm.old = warm.ref = warm.lp_skill = run_pass(grpo, model, warm, [[0, 1]], pad_id)
    run_update(seed_mod, model, opt, warm, [[[0, 1]]], cfg, pad_id)
    best = {}
    for rep in range(args.repeats):          # layouts interleaved; the best of the repeats counts
        for layout in LAYOUTS + (("one row",) if args.one_row else ()):
            pb, minis = layout_batches(lens, layout, cfg, args.seed)
            ub = [b for m in minis for b in m]
            common.reset_peak_rss()
            lp, *sec_p = common.clock(lambda: run_pass(grpo, model, trows, pb, pad_id))
            mem_p = common.peak_rss_mb()
            trows.old, trows.ref, trows.lp_skill = lp, lp, lp
            common.reset_peak_rss()
            _, *sec_u = common.clock(lambda: run_update(seed_mod, model, opt, trows, minis, cfg, pad_id))
            mem_u = common.peak_rss_mb()
            print(f"[bench] repeat {rep} {layout}: pass {sec_p[0]:.1f} s ({sec_p[1]:.1f} CPU s), update {sec_u[0]:.1f} s "
                  f"({sec_u[1]:.1f} CPU s), load {os.getloadavg()[0]:.2f}", flush=True)
            r = best.setdefault(layout, {"layout": layout})
            for k, v in (("pass_s", sec_p[0]), ("pass_cpu", sec_p[1]), ("update_s", sec_u[0]), ("update_cpu", sec_u[1])):
                r[k] = min(r.get(k, float("inf")), v)
            r["pass_mb"], r["update_mb"] = mem_p, mem_u
            r["pass_waste"], r["update_waste"] = layout_waste(lens, pb), layout_waste(lens, ub)
            r["pass_fwd"] = exact_fwd_flops(model.config, n_all, n_emb, tied, pb, lens)
            r["update_fwd"] = exact_fwd_flops(model.config, n_all, n_emb, tied, ub, lens)
    results = []
    for r in best.values():
        r |= {"pass_flops": 2 * n_all * T / r["pass_s"], "update_flops": 6 * n_all * T / r["update_s"],
              "pass_flops_cpu": 2 * n_all * T / r["pass_cpu"], "update_flops_cpu": 6 * n_all * T / r["update_cpu"],
              "pass_exact": r["pass_fwd"] / r["pass_s"], "update_exact": 3 * r["update_fwd"] / r["update_s"]}
        results.append(r)
    peaks.append((common.matmul_peak(torch.float32), common.matmul_peak(torch.bfloat16)))   # load drifts: best of both
    peak = {k: max(p[i][j] for p in peaks) for k, (i, j) in
            {"fp32": (0, 0), "fp32_cpu": (0, 1), "bf16": (1, 0), "bf16_cpu": (1, 1)}.items()}
    peak["n32"], peak["n16"] = peaks[0][0][2], peaks[0][1][2]
    print(f"[bench] matmul peaks (fp32, bf16) before/after, wall GFLOP/s: "
          f"{[(round(a[0] / 1e9, 1), round(b[0] / 1e9, 1)) for a, b in peaks]}", flush=True)
    report(args, episodes, rows, sub, T, n_all, n_emb, load, peak, pad_rows, results)


def report(args, episodes, rows, sub, T, n_all, n_emb, load, peak, pad_rows, results):
    peak32, peak16 = peak["fp32"], peak["bf16"]
    m = common.machine()
    G = 1e9
    pl = [len(r["prompt"]) for r in rows]
    rl = [len(r["response"]) for r in rows]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores ({m['flags']}), torch {m['torch']} ({m['torch_threads']} threads), "
          f"1-min load at start {load}, now {m['load_1min']}")
    print(f"rows: {len(rows)} from {os.path.relpath(episodes, common.ROOT)}; prompt tokens mean {np.mean(pl):.0f} "
          f"(min {min(pl)}, max {max(pl)}); response tokens mean {np.mean(rl):.0f} (min {min(rl)}, max {max(rl)})")
    print(f"params N = {n_all / 1e6:.1f}M ({n_emb / 1e6:.1f}M embedding, tied LM head)")
    print(f"\nmatmul peak (best of 5, before and after the step): fp32 {peak32 / G:.1f} GFLOP/s (n={peak['n32']}; "
          f"{peak['fp32_cpu'] / G:.1f} per CPU-second), bf16 {peak16 / G:.1f} GFLOP/s (n={peak['n16']}; "
          f"{peak['bf16_cpu'] / G:.1f} per CPU-second)")
    print(f"\npadding waste, all {len(rows)} rows, micro-batch {args.micro_batch}, mini-batch {args.mini_batch}:")
    print(f"| micro-batches of | row order | length-sorted (seed.py now) |\n|---|---|---|")
    for name, before, after in pad_rows:
        print(f"| {name} | {before:.2f} | {after:.2f} |")
    print(f"\ntimed on {len(sub)} of those rows ({T} real tokens), fp32 training (the CPU dtype), best of {args.repeats}:")
    print("| phase | micro-batches | seconds | CPU s | padding waste | peak RSS MiB | GFLOP/s (6NT / 2NT) | / fp32 peak "
          "| per CPU-s / fp32 peak per CPU-s | / bf16 peak | GFLOP/s (exact count) |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for ph, k in (("no-grad pass", "pass"), ("update fwd+bwd+AdamW", "update")):
            f = r[f"{k}_flops"]
            print(f"| {ph} | {r['layout']} | {r[f'{k}_s']:.1f} | {r[f'{k}_cpu']:.1f} | {r[f'{k}_waste']:.2f} "
                  f"| {r[f'{k}_mb']:.0f} | {f / G:.1f} | {f / peak32:.2f} | {r[f'{k}_flops_cpu'] / peak['fp32_cpu']:.2f} "
                  f"| {f / peak16:.2f} | {r[f'{k}_exact'] / G:.1f} |")
    base = next(r for r in results if r["layout"] == "row order")
    best = max(results, key=lambda r: r["update_flops_cpu"])
    print(f"\nupdate, '{best['layout']}' vs row order: {base['update_s'] / best['update_s']:.2f}x wall, "
          f"{base['update_cpu'] / best['update_cpu']:.2f}x CPU time")
    print(f"training-step FLOP/s / fp32 matmul peak: {best['update_flops'] / peak32:.2f} wall, "
          f"{best['update_flops_cpu'] / peak['fp32_cpu']:.2f} per CPU-second (row order: "
          f"{base['update_flops'] / peak32:.2f}, {base['update_flops_cpu'] / peak['fp32_cpu']:.2f})")
    print(f"training-step FLOP/s / bf16 matmul peak: {best['update_flops'] / peak16:.2f} (row order: "
          f"{base['update_flops'] / peak16:.2f})")


if __name__ == "__main__":
    main()
