"""Kernel tests run the Triton kernels and their torch references side by side.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported); with CUDA the same tests run natively on the GPU.
"""

import pytest
import torch

from dsv4ray.kernels import dispatch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seeded_and_auto_backend():
    torch.manual_seed(0)
    yield
    dispatch.set_backend(None)
