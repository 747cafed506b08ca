"""Shared test setup.

The Triton interpreter must be chosen before triton is first imported, so this runs at collection
start: without CUDA every kernel test runs under TRITON_INTERPRET=1 (CPU), with CUDA natively.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each
    torch.set_num_threads(1)


def _patch_language_once_per_launch() -> None:
    """Under the interpreter every call of a jit helper inside a kernel (ours and triton's own,
    such as tl.sum) patches triton.language again, a walk over all its members: ~40% of an
    interpreted kernel's time. A launch here patches `tl` and `tl.core` once for all the helpers
    its grid calls, and restores them when the grid ends."""
    import types

    import triton.language as tl
    from triton.runtime import interpreter

    needed = ("_patch_lang", "GridExecutor", "InterpretedFunction", "InterpreterError")
    if not all(hasattr(interpreter, name) for name in needed):
        return  # another triton's interpreter: run it as it is, only slower
    both = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})
    running = []  # one entry per launch whose grid is being interpreted

    def launch(self, *args, **kwargs):
        scope = interpreter._patch_lang(both)
        running.append(self)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.pop()
            scope.restore()

    def helper(self, *args, **kwargs):
        if not running:
            return helper_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    grid_call = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__
    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = helper


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """The `tiny` preset checkpoint (seed 0), written once per test session."""
    from dsv4ray.model.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("tiny")), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    from dsv4ray.model import load_reference

    return load_reference(tiny_ckpt, torch.float32)


def pytest_collection_modifyitems(session, config, items):
    """The suite runs on two xdist workers (pyproject's addopts: -n 2 --dist loadfile), each
    taking whole files in collection order: the files of tests/ray (actors, Serve apps, Ray
    heads of their own; most of the suite's time) go first, so that short files fill the end
    of the run on both workers rather than one long file on one. The order holds only with
    --no-loadscope-reorder (also in addopts): by default xdist queues the files with the most
    tests first, which puts the long one-test files of tests/ray last, and a worker takes its
    next file while two tests of the current one remain, so both end on long files."""
    order = ("tests/ray/", "tests/engine/", "tests/kernels/", "tests/unit/")

    def rank(item) -> int:
        return next((i for i, p in enumerate(order) if item.nodeid.startswith(p)), len(order))

    items.sort(key=rank)


def pytest_runtest_setup(item):
    """The local Ray that tests/ray's ray_session started idles at ~5% of a core (GCS, raylet,
    agents, idle workers) while the rest of the suite runs on this worker: it is shut down
    before the first test outside tests/ray, and started again for a test of tests/ray that
    comes after that (only an order other than the one below makes one)."""
    options = getattr(item.config, "local_ray_options", None)
    if options is None:
        return
    import ray

    in_ray = item.nodeid.startswith("tests/ray/")
    if not in_ray and ray.is_initialized():
        ray.shutdown()
    elif in_ray and not ray.is_initialized():
        ray.init(**options)
