"""Training text for the trained tiny checkpoint: the Python standard library's own sources.

Files: every ``*.py`` under a root (by default ``sysconfig.get_paths()["stdlib"]``) outside the
directories in EXCLUDED_DIRS, in sorted relative-path order. A file is held out when
sha256(relative path) mod 1000 < HELD_OUT_PER_MILLE, so the split depends on paths alone.
Each split is one token stream: a file's bytes as byte tokens (b + 2), then eos.

Samples are [bos] + stream[s : s + seq_len + 1] with s a line start (the first byte of a file or
a byte after a newline), so a prompt that begins a line right after bos looks like training text.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

import torch

BOS_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2
NEWLINE_ID = ord("\n") + BYTE_OFFSET
HELD_OUT_PER_MILLE = 50
# Installed packages, test suites (large generated data files among them) and pydoc's topic dump
# (prose, not code).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"}
)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str) -> list[str]:
    """Relative paths of the ``.py`` files under ``root`` outside EXCLUDED_DIRS, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
    if not found:
        raise FileNotFoundError(f"no .py files under {root!r}")
    return sorted(found)


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE


@dataclass(frozen=True)
class Split:
    """One split's token stream [n] (int16) and the offsets [m] (int64) where lines start."""

    tokens: torch.Tensor
    line_starts: torch.Tensor
    num_files: int

    @property
    def num_bytes(self) -> int:
        return self.tokens.numel() - self.num_files  # one eos per file


@dataclass(frozen=True)
class Corpus:
    root: str
    train: Split
    held_out: Split


def load_corpus(root: str | None = None) -> Corpus:
    root = root or stdlib_root()
    files = source_files(root)
    held = [f for f in files if is_held_out(f)]
    train = [f for f in files if not is_held_out(f)]
    if not held or not train:
        raise ValueError(
            f"{root!r} holds {len(files)} source files: too few for both a training and a "
            "held-out split"
        )
    return Corpus(root, _split(root, train), _split(root, held))


def _split(root: str, files: list[str]) -> Split:
    parts = []
    eos = torch.tensor([EOS_ID], dtype=torch.int16)
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        byte_ids = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
        if byte_ids is not None:
            parts.append(byte_ids.to(torch.int16) + BYTE_OFFSET)
        parts.append(eos)
    tokens = torch.cat(parts)
    after = (tokens[:-1] == NEWLINE_ID) | (tokens[:-1] == EOS_ID)
    line_starts = torch.cat([torch.zeros(1, dtype=torch.int64), after.nonzero()[:, 0] + 1])
    return Split(tokens, line_starts, len(files))


def sample_batch(split: Split, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 2] int64 rows: bos, then seq_len + 1 tokens from a random line start."""
    span = seq_len + 1
    usable = split.line_starts[split.line_starts <= split.tokens.numel() - span]
    if usable.numel() == 0:
        raise ValueError(f"the split has {split.tokens.numel()} tokens, fewer than {span}")
    starts = usable[torch.randint(usable.numel(), (batch,), generator=gen)]
    return _rows(split.tokens, starts, span)


def eval_windows(split: Split, num_windows: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len + 2] rows (bos first) at evenly spaced offsets over the whole split."""
    span = seq_len + 1
    last = split.tokens.numel() - span
    if last < 0:
        raise ValueError(f"the held-out split has {split.tokens.numel()} tokens, fewer than {span}")
    n = max(1, min(num_windows, last // span + 1))  # windows never overlap
    starts = torch.linspace(0, last, n).long()
    return _rows(split.tokens, starts, span)


def _rows(tokens: torch.Tensor, starts: torch.Tensor, span: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(span)[None, :]
    bos = torch.full((starts.numel(), 1), BOS_ID, dtype=torch.int64)
    return torch.cat([bos, tokens[idx].long()], dim=1)
