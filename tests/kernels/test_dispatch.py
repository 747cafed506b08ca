"""kernels/dispatch.py: backend resolution, overrides, and that ops reach the chosen backend."""

import logging

import pytest
import torch

from dsv4ray.cache.page_layout import layout_for
from dsv4ray.kernels import dispatch, store_kv


def test_auto_backend_follows_cuda_and_is_logged(monkeypatch, caplog):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.set_backend(None)
    with caplog.at_level(logging.INFO, logger="dsv4ray.kernels"):
        name = dispatch.backend()
        dispatch.backend()
    assert name == ("triton" if torch.cuda.is_available() else "torch")
    assert [r.getMessage() for r in caplog.records] == [f"kernel backend: {name} (auto)"]


@pytest.mark.parametrize("name", dispatch.BACKENDS)
def test_environment_variable_overrides(monkeypatch, name):
    monkeypatch.setenv(dispatch.ENV_VAR, name)
    dispatch.set_backend(None)
    assert dispatch.backend() == name


def test_unknown_names_are_refused(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    dispatch.set_backend(None)
    with pytest.raises(ValueError, match=dispatch.ENV_VAR):
        dispatch.backend()
    with pytest.raises(ValueError, match="torch"):
        dispatch.set_backend("numpy")


def test_use_backend_restores_the_previous_choice():
    dispatch.set_backend("torch")
    with dispatch.use_backend("triton"):
        assert dispatch.backend() == "triton"
    assert dispatch.backend() == "torch"


@pytest.mark.parametrize("name", dispatch.BACKENDS)
def test_ops_call_the_chosen_implementation(monkeypatch, name, device):
    calls = []
    monkeypatch.setattr(store_kv, "store_kv", lambda *a: calls.append("triton"))
    monkeypatch.setattr(store_kv, "store_kv_ref", lambda *a: calls.append("torch"))
    lay = layout_for("window", "fp8")
    with dispatch.use_backend(name):
        dispatch.store_kv(torch.zeros(1, 512, device=device), None, None, lay)
    assert calls == [name]


def test_both_backends_store_the_same_bytes(device):
    lay = layout_for("window", "fp8")
    x, slots = torch.randn(5, 512, device=device), torch.tensor([4, -1, 0, 9, 130], device=device)
    pages = {}
    for name in dispatch.BACKENDS:
        pages[name] = torch.zeros(2, lay.page_bytes, dtype=torch.uint8, device=device)
        with dispatch.use_backend(name):
            dispatch.store_kv(x, pages[name], slots, lay)
    assert torch.equal(pages["torch"], pages["triton"])


def test_a_cpu_stage_on_a_machine_with_cuda_takes_the_references(monkeypatch):
    """The auto backend follows torch.cuda.is_available(); a stage whose device is the CPU of
    such a machine (device="cpu") must not launch Triton kernels on CPU tensors."""
    previous = dispatch._state["backend"]
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        dispatch.set_backend(None)
        assert dispatch.backend() == "triton"
        dispatch.for_device(torch.device("cuda"))
        assert dispatch.backend() == "triton"
        dispatch.for_device(torch.device("cpu"))
        assert dispatch.backend() == "torch"
        monkeypatch.setenv(dispatch.ENV_VAR, "triton")
        dispatch.set_backend(None)
        with pytest.raises(ValueError, match="DSV4RAY_KERNELS=triton .* CUDA device"):
            dispatch.for_device(torch.device("cpu"))
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs them on CPU tensors
        dispatch.for_device(torch.device("cpu"))
        assert dispatch.backend() == "triton"
    finally:
        dispatch.set_backend(previous)
