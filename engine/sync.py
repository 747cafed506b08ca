"""What the stages know of a request: its NewRequest in full, then RequestDiffs (pure Python).

A request's ids change in the scheduler (pages grow, window pages come and go, a rollback cuts
its pages); the stages hear of each change once, in the next plan, because the request records
what it has not told them yet (``num_synced_pages``, ``new_windows``, ``freed_windows``,
``cut_pages``, ``rejected``).
"""

from __future__ import annotations

from dsv4ray.engine.plan import NewRequest, RequestDiff
from dsv4ray.engine.request import Request


def new_request(req: Request, eos_token_id: int | None = None) -> NewRequest:
    """The request in full (first admission, or again after preemption); nothing is pending."""
    windows = [-1] * (max(req.window_pages) + 1)
    for idx, page_id in req.window_pages.items():
        windows[idx] = page_id
    req.known_to_stages = True
    req.num_synced_pages = len(req.page_ids)
    req.new_windows, req.freed_windows = [], []
    req.cut_pages, req.rejected = -1, None
    return NewRequest(
        req_id=req.req_id,
        state_slot=req.state_slot,
        page_ids=list(req.page_ids),
        window_page_ids=windows,
        num_computed_tokens=req.num_computed_tokens,
        state_copy_from=req.state_copy_from,
        sampling=req.sampling.to_dict(),
        seed=req.seed,
        prompt_len=req.prompt_len,
        history=list(req.token_ids) if req.sampling.reads_history else [],
        stop_ids=_held_back(req.sampling, eos_token_id),
    )


def _held_back(params, eos_token_id: int | None) -> list[int]:
    """The ids ``min_tokens`` keeps from being drawn (none without min_tokens)."""
    if not params.min_tokens:
        return []
    eos = [] if eos_token_id is None or params.ignore_eos else [eos_token_id]
    return sorted({*eos, *params.stop_token_ids})


def pop_diff(req: Request) -> RequestDiff | None:
    """The changes the stages have not heard of (None if there are none)."""
    new_pages = req.page_ids[req.num_synced_pages :]
    rollback = req.cut_pages >= 0 or req.rejected is not None
    if not (new_pages or req.new_windows or req.freed_windows or rollback):
        return None
    diff = RequestDiff(
        req.req_id,
        new_pages,
        req.new_windows,
        req.freed_windows,
        req.cut_pages,
        list(req.rejected or ()),
    )
    req.num_synced_pages = len(req.page_ids)
    req.new_windows, req.freed_windows = [], []
    req.cut_pages, req.rejected = -1, None
    return diff
