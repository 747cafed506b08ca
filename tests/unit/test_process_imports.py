"""What each kind of process loads: a Serve replica (the HTTP ingress included) imports
``entrypoints.serve`` and must not pay for torch or Triton (seconds of CPU and ~250 MB per
replica); a driver of Ray stage actors builds no kernels, so it imports neither Triton nor the
network, nor torch (the pools it sizes are counted in pure Python; the stage actors allocate
them). Each check runs in a fresh interpreter, since this one already holds both."""

import subprocess
import sys

import pytest

CASES = {
    "dsv4ray.entrypoints.serve": ("torch", "triton"),
    "dsv4ray.entrypoints.job": ("torch", "triton"),
    "dsv4ray.model.checkpoint_check": ("torch", "triton"),
    "dsv4ray.cluster.pipeline": ("torch", "triton", "dsv4ray.model.stage", "dsv4ray.kernels"),
    "dsv4ray.cluster.pd": ("torch", "triton"),
    "dsv4ray.entrypoints.engines": ("torch", "triton"),
    "dsv4ray.entrypoints.job_replica": ("torch", "triton"),
}


@pytest.mark.parametrize("module", sorted(CASES))
def test_a_process_imports_only_what_it_runs(module):
    code = (
        f"import sys, {module}\nprint(' '.join(m for m in {CASES[module]!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"importing {module} loaded {out.stdout.split()}"


def test_checkpoint_error_is_one_class_wherever_it_is_imported_from():
    from dsv4ray.model.checkpoint_check import CheckpointError
    from dsv4ray.model.weights import CheckpointError as FromWeights

    assert FromWeights is CheckpointError and issubclass(CheckpointError, ValueError)
