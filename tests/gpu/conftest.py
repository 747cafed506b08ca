"""Every GPU test starts with the device as free as a fresh process would find it: stage and
draft actors size their pools from the memory free when they start, so blocks this test process
still caches from an earlier test would shrink them (and the draft actor's headroom) below what a
user's engine gets."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_cached_device_memory():
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
