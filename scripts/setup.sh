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

[ -f .tiny/config.json ] || dsv4ray make-tiny --out .tiny
dsv4ray generate --pp 2 --model checkpoints/stdlib-tiny --max-tokens 96 "def fibonacci(n):"
