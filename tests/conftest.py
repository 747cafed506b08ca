"""Shared test setup.

The Triton interpreter must be chosen before triton is first imported, so this runs at collection
start: without CUDA every kernel test runs under TRITON_INTERPRET=1 (CPU), with CUDA natively.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """The `tiny` preset checkpoint (seed 0), written once per test session."""
    from dsv4ray.model.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("tiny")), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    from dsv4ray.model import load_reference

    return load_reference(tiny_ckpt, torch.float32)
