"""The scheduler's per-request record (pure Python).

token_ids = prompt + generated tokens; num_computed_tokens of them have KV in the pools. The ids a
running request holds (one reference each in the allocators):

    page_ids[i]          full page of positions [256 i, 256 i + 256)
    window_pages[i]      window page of positions [128 i, 128 i + 128), only near the front
    state_slot           its compressor-state rings
    snapshot             newest committed (boundary, window page of [b - 128, b), cached-state slot)
    pending_snapshot     taken by the step in flight; replaces snapshot at commit
    share_boundaries     boundaries whose snapshot (with the pages before it) is handed to the
                         radix index at commit instead of waiting for the release
    draft_token_ids      the draft worker's proposals for the positions after the last token
                         (engine/spec.py); the stages learn of a rollback through cut_pages and
                         rejected

A preempted request holds none of them and keeps its tokens (recomputed as prompt).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dsv4ray.cache.radix import RadixNode
from dsv4ray.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestSnapshot:
    """C4 rings copied to state_slot after the step that reached boundary (page-aligned);
    window_page_id holds positions [boundary - 128, boundary) and is pinned by this snapshot."""

    boundary: int
    window_page_id: int
    state_slot: int


@dataclass(frozen=True)
class FinishedRequest:
    """What the scheduler reports when a request ends."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    num_host_cached_tokens: int = 0


@dataclass(eq=False)
class Request:
    req_id: str
    token_ids: list[int]
    sampling: SamplingParams
    seed: int
    prompt_len: int = field(init=False)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_host_cached_tokens: int = 0  # the part of it loaded from the host tier
    use_prefix_cache: bool = True
    admit_seq: int = -1  # larger = admitted later (preemption picks the largest)
    in_flight_step: int | None = None
    samples_in_flight: bool = False  # the step in flight samples the request's next token
    lookahead_step: int | None = None  # a second step in flight: the token after that one
    # ids held while running
    state_slot: int = -1
    state_copy_from: int = -1
    page_ids: list[int] = field(default_factory=list)
    window_pages: dict[int, int] = field(default_factory=dict)
    node: RadixNode | None = None  # locked radix node of the prefix hit
    snapshot: RequestSnapshot | None = None
    pending_snapshot: RequestSnapshot | None = None
    later_snapshot: RequestSnapshot | None = None  # taken by the lookahead step in flight
    # boundaries whose snapshot goes to the radix index as soon as it is committed
    share_boundaries: tuple[int, ...] = ()
    # what the stages know: everything up to the last plan, except these pending changes
    known_to_stages: bool = False
    num_synced_pages: int = 0
    new_windows: list[tuple[int, int]] = field(default_factory=list)
    freed_windows: list[int] = field(default_factory=list)
    # speculative decoding: proposals, and a rollback the stages have not heard of yet
    draft_token_ids: list[int] = field(default_factory=list)
    cut_pages: int = -1  # the page table was cut to this many pages
    rejected: tuple[int, int] | None = None  # positions [a, b) written for rejected drafts

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def reset_cache_state(self) -> None:
        """Forget every held id (after the scheduler gave them back) and computed progress."""
        self.num_computed_tokens = 0
        self.in_flight_step = self.lookahead_step = None
        self.state_slot = self.state_copy_from = -1
        self.page_ids, self.window_pages = [], {}
        self.node = self.snapshot = self.pending_snapshot = self.later_snapshot = None
        self.share_boundaries = ()
        self.num_synced_pages = 0
        self.new_windows, self.freed_windows = [], []
        self.draft_token_ids, self.cut_pages, self.rejected = [], -1, None
