"""Kernel backend choice: Triton on CUDA machines, the torch references elsewhere.

`backend()` resolves once: $DSV4RAY_KERNELS ("torch" | "triton") if set, else "triton" when CUDA is
available, else "torch"; the choice is logged on "dsv4ray.kernels". Tests force a backend with
`set_backend(name)` or `with use_backend(name):` (the Triton path runs on CPU tensors under
TRITON_INTERPRET=1). Every public op below calls the chosen implementation with the same arguments.
"""

import logging
import os
from contextlib import contextmanager

import torch

from dsv4ray.kernels import compress, hisparse_swap, indexer, sampler, token_mask, transfer
from dsv4ray.kernels import sparse_mqa as _sparse_mqa
from dsv4ray.kernels import store_kv as _store_kv
from dsv4ray.kernels.bits import interpreting

BACKENDS = ("torch", "triton")
ENV_VAR = "DSV4RAY_KERNELS"
log = logging.getLogger("dsv4ray.kernels")
_state = {"backend": None}


def _resolve() -> str:
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if name and name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {name!r}")
    source = ENV_VAR if name else "auto"
    name = name or ("triton" if torch.cuda.is_available() else "torch")
    log.info("kernel backend: %s (%s)", name, source)
    return name


def backend() -> str:
    """The active kernel backend, "triton" or "torch" (resolved on first use)."""
    if _state["backend"] is None:
        _state["backend"] = _resolve()
    return _state["backend"]


def set_backend(name: str | None) -> None:
    """Force a backend ("torch" or "triton"); None forgets the choice (the next call resolves)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _state["backend"] = name


@contextmanager
def use_backend(name: str):
    """Run a block with backend `name`, restoring the previous choice afterwards."""
    previous = _state["backend"]
    set_backend(name)
    try:
        yield
    finally:
        _state["backend"] = previous


def for_device(device: torch.device) -> None:
    """A stage on a CPU device of a machine with CUDA takes the torch references (the Triton
    kernels need device tensors; TRITON_INTERPRET=1 runs them on CPU tensors). An explicit
    DSV4RAY_KERNELS=triton there is refused by name."""
    if device.type == "cuda" or backend() != "triton" or interpreting():
        return
    if os.environ.get(ENV_VAR, "").strip().lower() == "triton":
        raise ValueError(
            f"{ENV_VAR}=triton runs Triton kernels, which need a CUDA device (this stage runs "
            "on CPU); unset it or set TRITON_INTERPRET=1"
        )
    log.info("kernel backend: torch (a stage on the CPU of a machine with CUDA)")
    set_backend("torch")


def _pick(triton_fn, torch_fn):
    return triton_fn if backend() == "triton" else torch_fn


def store_kv(x, pages, slots, layout) -> None:
    """See kernels/store_kv.py."""
    _pick(_store_kv.store_kv, _store_kv.store_kv_ref)(x, pages, slots, layout)


def compress_norm_rope_store(*args, **kwargs) -> None:
    """See kernels/compress.py."""
    _pick(compress.compress_norm_rope_store, compress.compress_norm_rope_store_ref)(*args, **kwargs)


def reset_state(state_kv, state_score, slots) -> None:
    """Empty compressor rings (kv = 0, score = -inf); one torch implementation for both backends."""
    compress.reset_state(state_kv, state_score, slots)


def transfer_cache_dsv4_mla(src_layers, dst_layers, src_indices, dst_indices, layout) -> None:
    """See kernels/transfer.py."""
    fn = _pick(transfer.transfer_cache_dsv4_mla, transfer.transfer_cache_dsv4_mla_ref)
    fn(src_layers, dst_layers, src_indices, dst_indices, layout)


def transfer_page_rows(src_layers, dst_layers, src_pages, dst_pages) -> None:
    """See kernels/transfer.py."""
    _pick(transfer.transfer_page_rows, transfer.transfer_page_rows_ref)(
        src_layers, dst_layers, src_pages, dst_pages
    )


def hisparse_swap_in(
    topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters
):
    """See kernels/hisparse_swap.py."""
    fn = _pick(hisparse_swap.hisparse_swap_in, hisparse_swap.hisparse_swap_in_ref)
    return fn(topk, req_slots, new_pos, page_table, req_rows, row_pos, row_age, clock, counters)


def indexer_topk(q, weights, k_pages, page_table, req_idx, bound, topk, layout) -> torch.Tensor:
    """See kernels/indexer.py."""
    return _pick(indexer.indexer_topk, indexer.indexer_topk_ref)(
        q, weights, k_pages, page_table, req_idx, bound, topk, layout
    )


def compile_indexer_variants(num_heads: int, layout, device) -> None:
    """Compiles every tile variant of the indexer's scores kernel (Triton on a GPU, else none)."""
    if backend() == "triton" and torch.device(device).type == "cuda":
        indexer.compile_variants(num_heads, layout, device)


def sparse_mqa(
    q,
    window_pages,
    window_slots,
    comp_pages,
    comp_slots,
    sink,
    scale,
    window_layout,
    comp_layout=None,
) -> torch.Tensor:
    """See kernels/sparse_mqa.py."""
    return _pick(_sparse_mqa.sparse_mqa, _sparse_mqa.sparse_mqa_ref)(
        q,
        window_pages,
        window_slots,
        comp_pages,
        comp_slots,
        sink,
        scale,
        window_layout,
        comp_layout,
    )


def gumbel_argmax(values, vocab_ids, key) -> torch.Tensor:
    """See kernels/sampler.py. Picked by the tensors' device whatever the backend: the Triton
    pass on CUDA, the torch reference elsewhere."""
    fn = sampler.gumbel_argmax if values.is_cuda else sampler.gumbel_argmax_ref
    return fn(values, vocab_ids, key)


def apply_token_masks(logits, packed, num_words) -> torch.Tensor:
    """See kernels/token_mask.py. Picked by the tensors' device whatever the backend: the Triton
    pass on CUDA, the torch reference elsewhere."""
    fn = token_mask.apply_token_masks if logits.is_cuda else token_mask.apply_token_masks_ref
    return fn(logits, packed, num_words)
