"""Which checkpoint a command serves when none is named."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

DEFAULT_MODEL_ENV = "DSV4RAY_MODEL"


def default_model() -> str:
    """``$DSV4RAY_MODEL``, else ``./.tiny`` when present, else ``.tiny`` beside the package."""
    if os.environ.get(DEFAULT_MODEL_ENV):
        return os.environ[DEFAULT_MODEL_ENV]
    if os.path.isdir(".tiny"):
        return os.path.abspath(".tiny")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package_root, ".tiny")


def model_path(path: str | None) -> str:
    """The named checkpoint (a folder, URI or Hugging Face id: sources.py), or the
    default, checked when local (model/checkpoint_check.py); a usage error
    (one line, exit code 2) names the folder without config.json or the broken file."""
    from dsv4ray.model.checkpoint_check import check_checkpoint
    from dsv4ray.model.weights import CheckpointError
    from dsv4ray.sources import is_remote

    path = path or default_model()
    if is_remote(path):
        return path  # a URI or a Hugging Face id: fetched (and checked) where engines start
    if not os.path.isfile(os.path.join(path, "config.json")):
        usage_exit(
            f"dsv4ray: no checkpoint at {path!r} (no config.json). Make the tiny one with "
            "`dsv4ray make-tiny --out .tiny` or pass --model /path/to/checkpoint."
        )
    try:
        check_checkpoint(path)
    except CheckpointError as exc:
        usage_exit(f"dsv4ray: bad checkpoint: {exc}")
    return path


def usage_exit(message: str) -> NoReturn:
    print(message, file=sys.stderr)
    raise SystemExit(2)
