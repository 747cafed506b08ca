"""Shared test setup.

The Triton interpreter must be chosen before triton is first imported, so this runs at collection
start: without CUDA every kernel test runs under TRITON_INTERPRET=1 (CPU), with CUDA natively.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
