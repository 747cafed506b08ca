"""Speculative decoding in the one request model (pure Python on ints).

The MTP draft worker proposes k tokens per request after every step that samples (chain
drafting: one candidate per draft step). A running request whose only uncomputed token is its
last one and that holds drafts schedules 1 + d tokens: its last token at position
p = num_computed_tokens, then d drafts at p + 1 .. p + d. d counts against the step's budget like
a prefill chunk and is capped by max_tokens and max_model_len, so a verified step never writes
past where plain decoding would stop. The last stage scores all d + 1 positions: row j's target
token t_j is compared with the draft at p + 1 + j, a = the number of leading matches, and the
request appends drafts[:a] + [t_a], checking its stop conditions after each token, so a request
that stops mid-draft ends exactly where plain decoding ends. num_computed_tokens becomes
p + 1 + a; what the step wrote for positions p + 1 + a .. p + d belongs to rejected drafts:

    full pages        pages wholly past the request's tokens are freed; the stages cut their
                      page tables to RequestDiff.num_pages
    compressor rings  the stages reset the C128 ring rows of the rejected positions
                      (RequestDiff.rejected); C4 rows (16 with speculation) and window slots
                      are rewritten before anything reads them again
    snapshot          one taken at a page boundary past p + 1 + a is dropped, not promoted
    window pages      stay with the request: its next step writes them

In process the engine commits a step without waiting for its draft pass: each request that
drafted holds k PENDING_DRAFT ids (``Scheduler.expect_drafts``), the next plan schedules them as
drafts (plan.draft_lookahead), the stages fill them from the proposals still on the device, and
their values replace the placeholders (``Scheduler.keep_drafts``) before that step is settled and
committed (worker/spec/draft_fill.py). A plan that skips such a request reads its proposals first.

Rings are doubled with speculation (C4 16 rows, C128 256): a step writes up to d rows past the
commit point, and the rows the next step reads (the 7 C4 rows, or the C128 block's rows, before
it) must survive them, hence MAX_DRAFT_STEPS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dsv4ray.config_error import is_int
from dsv4ray.engine.plan import NO_DRAFTS
from dsv4ray.engine.request import Request

# C4 rings of 16 rows: rows of positions p - 7 .. p - 1 survive writes up to p + 8.
MAX_DRAFT_STEPS = 8


@dataclass(frozen=True)
class SpecConfig:
    """num_steps: draft tokens proposed per request and step (0 = off); eagle_topk: candidates
    per draft step (1 = chain drafting; more would be tree drafting, which is not built)."""

    num_steps: int = 0
    eagle_topk: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.num_steps) or not 0 <= self.num_steps <= MAX_DRAFT_STEPS:
            raise ValueError(
                f"speculative_num_steps must be an int in [0, {MAX_DRAFT_STEPS}] (the doubled "
                f"compressor rings hold that many draft rows), got {self.num_steps!r}"
            )
        if not is_int(self.eagle_topk) or self.eagle_topk < 1:
            raise ValueError(f"speculative_eagle_topk must be an int >= 1, got {self.eagle_topk!r}")
        if self.eagle_topk > 1 and not self.enabled:  # with drafts, the draft layer names why
            raise ValueError(
                f"speculative_eagle_topk={self.eagle_topk}: tree drafting is not supported "
                "(and speculative_num_steps is 0: no drafts at all); leave it at 1"
            )

    @property
    def enabled(self) -> bool:
        return self.num_steps > 0

    def check_draft_layer(self, mtp_ratio: int | None, missing_tensors: Sequence[str]) -> None:
        """ValueError unless the checkpoint's draft layer can serve this config: it exists with
        all its tensors (missing_tensors names those the checkpoint lacks), is window-only
        (ratio 0) or DSA-style (ratio 4), and drafting is a chain (a DSA-style draft reuses the
        target's top-k across draft steps, valid only when every step extends the same row)."""
        if not self.enabled:
            return
        if mtp_ratio is None:
            raise ValueError(
                f"speculative_num_steps={self.num_steps} needs an MTP layer; the checkpoint's "
                "config has none (num_nextn_predict_layers = 0)"
            )
        if missing_tensors:
            shown = ", ".join(missing_tensors[:4])
            more = f" and {len(missing_tensors) - 4} more" if len(missing_tensors) > 4 else ""
            raise ValueError(
                f"speculative_num_steps={self.num_steps} needs the MTP layer's tensors; the "
                f"checkpoint lacks {shown}{more}"
            )
        if mtp_ratio not in (0, 4):
            raise ValueError(
                f"speculative_num_steps needs a window-only (0) or DSA-style (4) draft layer; "
                f"the last compress_ratios entry is {mtp_ratio}"
            )
        if self.eagle_topk > 1 and mtp_ratio == 4:
            raise ValueError(
                f"speculative_eagle_topk={self.eagle_topk} asks for tree drafting, but the "
                "draft layer is DSA-style (last compress_ratios entry 4): it reuses the "
                "target's top-k at later draft steps, which is valid only for chain drafting "
                "(speculative_eagle_topk=1); tree drafting reorders candidate rows"
            )
        if self.eagle_topk > 1:
            raise ValueError(
                f"speculative_eagle_topk={self.eagle_topk}: tree drafting is not supported; "
                "use 1 (chain drafting)"
            )


def draft_len(req: Request, budget: int, max_model_len: int, page_size: int | None = None) -> int:
    """Drafts a running decode schedules behind its last token: no more than it holds, the
    budget left after its last token, the tokens it may still generate after the bonus one,
    or the room left below max_model_len; none when penalties count its tokens (a draft's
    penalties would count the drafts before it). A grammar's drafts are verified under the
    mask that follows the drafts before them (worker/sampling/grammar.py).
    page_size (with prefix caching): a step ends at the next page boundary at the latest, so
    the request reaches each boundary with a step that ends there and whose drafts were all
    accepted; that step's snapshot caches the page (a step across a boundary takes none, and
    one that ends there but rejects a draft drops it: decoded pages were almost never cached)."""
    if req.num_tokens - req.num_computed_tokens != 1 or not req.draft_token_ids:
        return 0
    if req.sampling.penalizes:
        return 0
    left = req.sampling.max_tokens - req.num_output_tokens - 1
    room = max_model_len - req.num_tokens - 1
    to_page = page_size - 1 - req.num_computed_tokens % page_size if page_size else room
    return max(0, min(len(req.draft_token_ids), budget - 1, left, room, to_page))


def append_verified(
    req: Request, tokens: list[int], stop_reason: Callable[[Request], str | None]
) -> tuple[list[int], str | None]:
    """Appends verified tokens one at a time until one meets a stop condition; returns the
    tokens appended and the stop reason (None if none stopped)."""
    appended = []
    for token in map(int, tokens):
        req.token_ids.append(token)
        appended.append(token)
        reason = stop_reason(req)
        if reason is not None:
            return appended, reason
    return appended, None


def rejected_span(req: Request, end: int) -> tuple[int, int] | None:
    """Positions [num_computed_tokens, end) the step wrote for drafts that were rejected."""
    return (req.num_computed_tokens, end) if req.num_computed_tokens < end else None


@dataclass(frozen=True)
class Resume:
    """Where a request stands when the pipeline restarts under it (its draft worker died):
    its tokens so far become the prompt, the rest of its budget the new max_tokens (and of its
    min_tokens the new min_tokens)."""

    prompt_token_ids: list[int]
    max_tokens: int
    seed: int
    min_tokens: int = 0


def resume_point(req: Request) -> Resume | None:
    """None for a request that has generated nothing (it simply starts again)."""
    if req.num_output_tokens == 0:
        return None
    sp, done = req.sampling, req.num_output_tokens
    return Resume(list(req.token_ids), sp.max_tokens - done, req.seed, max(0, sp.min_tokens - done))


def resume_points(scheduler, req_ids) -> dict[str, Resume]:
    """Resume points of the scheduler's requests among req_ids that generated something."""
    points = {}
    for req_id in req_ids:
        point = resume_point(scheduler.get_request(req_id))
        if point is not None:
            points[req_id] = point
    return points


# The draft worker's counters (DraftResult.stats per step): passes run (and of them those
# replayed from a CUDA graph), tokens proposed, chain-step rows whose attention read step 0's
# reused top-k, passes that raised (their steps ran without proposals).
DRAFT_STAT_NAMES = ("num_draft_passes", "num_draft_graph_passes", "num_drafted_tokens")
DRAFT_STAT_NAMES += ("num_topk_reuse_rows", "num_failed_draft_passes")
# Engine counters (EngineCore.stats): drafts verified and accepted, then the draft worker's.
STAT_NAMES = ("num_verify_steps", "num_draft_tokens", "num_accepted_draft_tokens")
STAT_NAMES += DRAFT_STAT_NAMES


def describe(num_steps: int) -> str:
    return f"MTP drafts on ({num_steps} per step)" if num_steps else "no drafts"


def count_drafts(plan, outcome, result, outputs, stats: dict[str, int]) -> None:
    """Adds a committed step's drafts to each request's metrics (outputs: req_id ->
    RequestOutput) and to the engine's counters, with the draft worker's step counters."""
    for entry in plan.batch:
        if entry.num_drafts and entry.req_id in outcome.applied:
            accepted = outcome.accepted_drafts.get(entry.req_id, 0)
            metrics = outputs[entry.req_id].metrics
            metrics.num_draft_tokens += entry.num_drafts
            metrics.num_accepted_draft_tokens += accepted
            stats["num_verify_steps"] += 1
            stats["num_draft_tokens"] += entry.num_drafts
            stats["num_accepted_draft_tokens"] += accepted
    for name, value in (result.spec or NO_DRAFTS).stats.items():
        stats[name] = stats.get(name, 0) + value
