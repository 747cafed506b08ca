#!/usr/bin/env bash
# Sets up a development machine from a fresh clone: .venv with every dependency, the random tiny
# checkpoint in .tiny/ (tests and benchmarks), then one generation from the trained
# checkpoints/stdlib-tiny on a local Ray (pp 2). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip

# CUDA present = a working nvidia-smi (torch is not installed yet); never nvcc.
if nvidia-smi >/dev/null 2>&1; then
  extra="pd-cuda13"
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch>=2.11"
else
  extra="pd-cpu"
  # the CPU build; a bare `torch` requirement would download a several-GB CUDA build
  python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e ".[test,$extra]"

# The Mooncake engine (prefill/decode handoffs) links libibverbs even for TCP; a fresh Debian
# machine lacks it. Installed only when the import fails (root, or passwordless sudo).
if ! python -c "import mooncake.engine" 2>/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  apt_quiet() { DEBIAN_FRONTEND=noninteractive $sudo apt-get "$@" >/dev/null 2>&1; }
  if command -v apt-get >/dev/null; then
    apt_quiet install -y -q libibverbs1 \
      || { apt_quiet update -q && apt_quiet install -y -q libibverbs1; } || true
  fi
  python -c "import mooncake.engine" 2>/dev/null \
    || echo "setup: the Mooncake engine does not load (needs libibverbs1): no prefill/decode" >&2
fi

[ -f .tiny/config.json ] || dsv4ray make-tiny --out .tiny
dsv4ray generate --pp 2 --model checkpoints/stdlib-tiny --max-tokens 96 "def fibonacci(n):"
