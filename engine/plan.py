"""Messages between the scheduler and the pipeline stages (plain dataclasses, msgpack-encodable).

Index spaces the ids in a plan live in (every stage uses the same ids for its own layers):

    full slot f of a request (f = token position)  ->  page_ids[f // 256] * 256 + f % 256
    compressed slot of f in a ratio-r pool (r = 4, 128; the C4 indexer pool like C4)
        = page_ids[f // 256] * (256 // r) + (f % 256) // r      (same page id in every pool)
    window slot of position p = window_page_ids[p // 128] * 128 + p % 128
    compressor-state ring row of p = ring of state_slot, row p % ring_len (8 for C4, 128 for C128)
    cached-state slot: a copy of the C4 rings (main + indexer) at a 256-token boundary

A stage applies a plan in this order: drop finished_ids and preempted_ids; create new_requests
(reset the rings of state_slot, or copy the C4 rings from cached-state slot state_copy_from: the
C128 ring is empty at the page boundary where a prefix hit resumes); apply diffs; run the batch;
then for each (req_id, slot) in snapshots copy that request's C4 rings into cached-state slot.
(A finished id may reappear in new_requests of the same plan when a caller reuses the id.)
Stages apply plans in step order, so diffs stay valid with several micro-batches in flight.

Speculative decoding (engine/spec.py): an entry with num_drafts > 0 runs the request's last token
then num_drafts draft tokens; the last stage samples at every one of those positions, accepts the
longest prefix of drafts its own tokens match and reports them in StageResult.spec.accepted (the
token after them in sampled). With a draft worker (plan.drafts) the last stage then hands it, in
residual / topk, the rows of every position whose next token is known (accepted positions, and
whole prefill chunks, whose next token is in plan.drafts.next_tokens), and the draft worker
returns the result with its proposals in spec.proposals. In process a replayed verification
hands its rows over on the device instead (handoff), the proposals stay there (spec.pending) and
the next plan's plan.drafts.lookahead entries are filled from them (worker/spec/draft_fill.py);
a draft actor holds them (spec.held) for the next plan's stages to read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from dsv4ray.cache.hicache import HostOps
from dsv4ray.engine.handoff import HandoffReports, Handoffs, KVCheck, KVSend, to_dict

if TYPE_CHECKING:
    import torch


LOOKAHEAD_TOKEN = -1  # a token id the last stage fills from the previous plan's samples
FLUSH_STEP = -2  # step id of a lagged pipeline's flush: a plan without a batch
NO_RESULT = -3  # step id of what a lagging last stage returns when no step was held
PENDING_DRAFT = -1  # a draft id the stages fill from the draft worker's last proposals


@dataclass
class NewRequest:
    """A request a stage has not seen (or sees again after preemption), in full.

    window_page_ids[i] holds positions [128 i, 128 i + 128); -1 = not resident. state_copy_from:
    cached-state slot to copy into the rings, -1 = start from empty rings, STATE_TRANSFERRED
    (engine/handoff.py) = a prefill engine wrote the rings: keep them. sampling: the
    SamplingParams fields (``SamplingParams.to_dict``); seed: the request's generator seed.
    """

    req_id: str
    state_slot: int
    page_ids: list[int]
    window_page_ids: list[int]
    num_computed_tokens: int
    state_copy_from: int
    sampling: dict[str, Any]
    seed: int
    # what sampling controls read (engine/sampling.py): the prompt's length, every token so far
    # when penalties count them, the ids min_tokens holds back (eos unless ignored, stop ids)
    prompt_len: int = 0
    history: list[int] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)


@dataclass
class RequestDiff:
    """What changed for a running request since the stages last heard of it."""

    req_id: str
    new_page_ids: list[int] = field(default_factory=list)  # appended to the page table
    new_window_pages: list[tuple[int, int]] = field(default_factory=list)  # (window idx, page id)
    freed_window_idxs: list[int] = field(default_factory=list)  # no longer resident
    # a rollback of rejected drafts (applied first): the page table keeps its first num_pages
    # pages (-1: unchanged); rejected = [first, end) positions whose C128 ring rows are reset
    num_pages: int = -1
    rejected: list[int] = field(default_factory=list)


@dataclass
class BatchEntry:
    """num_tokens tokens of req_id at positions start_pos.. ; sample: the step reaches the
    request's last token, so the last stage samples one token for it."""

    req_id: str
    start_pos: int
    num_tokens: int
    sample: bool
    num_drafts: int = 0  # the entry's last num_drafts tokens are drafts to verify


@dataclass
class DraftPlan:
    """A step plan's section for the draft worker that follows the last stage."""

    # non-sampling entries' next token (their chunk's last row drafts from it)
    next_tokens: dict[str, int] = field(default_factory=dict)
    # entries whose drafts the previous plan's draft pass proposed and that have not reached the
    # host: token_ids holds PENDING_DRAFT there; the stages fill them (on the device in process,
    # from the draft actor's held proposals otherwise) before they settle the step
    # (worker/spec/draft_fill.py)
    lookahead: list[str] = field(default_factory=list)


@dataclass
class StepPlan:
    """One engine step. token_ids holds the batch's tokens flattened in batch order.
    logprobs: req_id -> number of top logprobs wanted, for sampling entries that asked.
    full_logits: requests whose every scheduled token's logits the last stage returns (scoring
    prompts, e.g. teacher-forced comparisons; filled by the engine, not the scheduler).
    prompt_logprobs: req_id -> [top n, the prompt's next token at each of the entry's positions
    that has one]: the last stage returns their logprobs (filled by the engine).
    eager: run without captured CUDA graphs (the startup warm-up compiles the eager kernels).
    lookahead: requests whose entry is the one token their previous plan samples (token_ids
    holds LOOKAHEAD_TOKEN there; the last stage fills it from that plan's sampled ids)."""

    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    diffs: list[RequestDiff] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    batch: list[BatchEntry] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    snapshots: list[tuple[str, int]] = field(default_factory=list)
    logprobs: dict[str, int] = field(default_factory=dict)
    full_logits: list[str] = field(default_factory=list)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    eager: bool = False
    lookahead: list[str] = field(default_factory=list)
    # the driver keeps another plan in flight behind this one: the last stage launches this
    # step, then returns the previous lagged step's result, settled (a FLUSH_STEP plan returns
    # it alone; worker/stage_worker.py ``step``)
    lag: bool = False
    # with lag, the last stage's sampled ids go back to the first stage (overlap scheduling:
    # the next plan's lookahead entries read them there)
    take: bool = False
    # speculative decoding: a draft worker follows the last stage (engine/spec.py); None: none
    drafts: DraftPlan | None = None
    # host tier copies, run before the step (cache/hicache.py); None: none
    host: HostOps | None = None
    # prefill/decode handoffs, run after the step (engine/handoff.py); None: none
    kv: Handoffs | None = None

    @property
    def has_host_ops(self) -> bool:
        return bool(self.host)

    @property
    def draft(self) -> bool:
        """A draft worker follows the last stage."""
        return self.drafts is not None

    @property
    def draft_lookahead(self) -> list[str]:
        """The entries whose drafts are still PENDING_DRAFT (DraftPlan.lookahead)."""
        return self.drafts.lookahead if self.drafts is not None else []

    def __post_init__(self) -> None:
        num_tokens = sum(entry.num_tokens for entry in self.batch)
        if num_tokens != len(self.token_ids):
            raise ValueError(
                f"batch schedules {num_tokens} tokens but token_ids has {len(self.token_ids)}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StageResult:
    """What a stage hands on: tensors for the next stage (the compiled graph moves them: NCCL on
    GPUs, shared memory on CPUs), or on the last stage the sampled tokens. errors: req_id -> why
    it could not sample; failed: the step's compute failed on some stage (every stage still
    applied the plan's bookkeeping)."""

    step_id: int
    # [T, hc * hidden] and [T, k] logical C4 positions (-1 = none); from the last stage to a
    # draft worker: the rows of the positions it drafts from (worker/spec/verify.py)
    residual: torch.Tensor | None = None
    topk: torch.Tensor | None = None
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)  # [logprob, [[id, lp], ...]]
    full_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # req_id -> [n, V] fp32
    # req_id -> per position of the plan's prompt_logprobs targets: [[token, logprob, rank], ...]
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    failed: str | None = None
    spec: DraftResult | None = None  # speculative decoding: verification and draft proposals
    kv: HandoffReports | None = None  # the reports of the plan's handoffs
    # the last stage's sampling still on the device (a deferred step): StageWorker.finish reads
    # it into sampled / logprobs / errors; never set on a result that leaves the process
    pending: Any = None
    # a replayed verification's rows for the draft worker of the same process
    # (worker/spec/verify.Handoff); never set on a result that leaves the process
    handoff: Any = None
    # to a draft actor: residual / topk are a replayed verification's slotted rows and token_ids
    # the target's token per batch token (the draft drafts from them on the device)
    verified: bool = False
    # overlap scheduling over several stages (worker/graphs/overlap.py): the last stage's
    # sampled ids [R] for the first stage's table, and the step's token ids [T] as the first
    # stage filled them, for the stages after it
    samples: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    # stages on one GPU: where the rows above wait in device memory (worker/graphs/device_link.py's
    # LinkTicket; residual, topk and token_ids are then None)
    link: Any = None

    def spec_section(self) -> DraftResult:
        """``spec``, made on first use."""
        if self.spec is None:
            self.spec = DraftResult()
        return self.spec


@dataclass
class DraftResult:
    """A stage result's speculative-decoding section: what the last stage's verification
    accepted, and what the draft worker proposed for the next step."""

    accepted: dict[str, list[int]] = field(default_factory=dict)  # drafts accepted before sampled
    accepted_logprobs: dict[str, list[Any]] = field(default_factory=dict)  # theirs, where asked
    proposals: dict[str, list[int]] = field(default_factory=dict)  # for the next step, read back
    stats: dict[str, int] = field(default_factory=dict)  # the draft worker's step counters
    # an in-process draft worker's proposals still on their way to the host
    # (worker/spec/draft.PendingDrafts): the next plan's entries take them on the device
    pending: Any = None
    # a draft actor's proposals of this step, held there for the next plans' stages (the
    # requests whose next plan schedules PENDING_DRAFT drafts; worker/spec/draft_fill.py)
    held: list[str] = field(default_factory=list)
    # the plan's DraftPlan.lookahead proposals as they reached the host (req_id -> drafts)
    resolved: dict[str, list[int]] = field(default_factory=dict)


NO_DRAFTS = DraftResult()  # what a result without a section reads as (never written)


def encode(plan: StepPlan) -> bytes:
    """msgpack bytes of a plan: requests, diffs and entries as arrays of their fields in
    declaration order (a step's plan is encoded on the driver's critical path, so no generic
    dataclass walk); ``decode`` restores them."""
    raw = {name: getattr(plan, name) for name in _PLAIN_FIELDS}
    raw["new_requests"] = [_fields(r, _NEW_FIELDS) for r in plan.new_requests]
    raw["diffs"] = [_fields(d, _DIFF_FIELDS) for d in plan.diffs]
    raw["batch"] = [_fields(e, _ENTRY_FIELDS) for e in plan.batch]
    host = plan.host
    raw["host"] = None if host is None else _fields(host, _HOST_FIELDS)
    raw["drafts"] = None if plan.drafts is None else _fields(plan.drafts, _DRAFT_FIELDS)
    kv = plan.kv
    raw["kv"] = (
        None if kv is None else [[to_dict(m) for m in kv.sends], [to_dict(m) for m in kv.checks]]
    )
    return msgpack.packb(raw, use_bin_type=True)


def decode(data: bytes) -> StepPlan:
    """Inverse of ``encode``."""
    raw = msgpack.unpackb(data, raw=False)
    plan = StepPlan(
        step_id=raw["step_id"],
        new_requests=[NewRequest(*item) for item in raw["new_requests"]],
        diffs=[_diff(*item) for item in raw["diffs"]],
        batch=[BatchEntry(*item) for item in raw["batch"]],
        token_ids=raw["token_ids"],
    )
    if raw["host"] is not None:
        plan.host = HostOps(*([tuple(op) for op in ops] for ops in raw["host"]))
    if raw["drafts"] is not None:
        plan.drafts = DraftPlan(*raw["drafts"])
    if raw["kv"] is not None:
        sends, checks = raw["kv"]
        plan.kv = Handoffs(
            [KVSend.from_dict(m) for m in sends], [KVCheck.from_dict(m) for m in checks]
        )
    for name in _PLAIN_FIELDS:
        value = raw[name]
        if name == "snapshots":
            value = [tuple(pair) for pair in value]
        setattr(plan, name, value)
    return plan


def _fields(obj, names: tuple[str, ...]) -> list:
    return [getattr(obj, name) for name in names]


def _diff(req_id, new_page_ids, new_window_pages, *rest) -> RequestDiff:
    return RequestDiff(req_id, new_page_ids, [tuple(pair) for pair in new_window_pages], *rest)


_HOST_FIELDS = tuple(f.name for f in dataclasses.fields(HostOps))
_DRAFT_FIELDS = tuple(f.name for f in dataclasses.fields(DraftPlan))
_NEW_FIELDS = tuple(f.name for f in dataclasses.fields(NewRequest))
_DIFF_FIELDS = tuple(f.name for f in dataclasses.fields(RequestDiff))
_ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(BatchEntry))
_NESTED = {"new_requests", "diffs", "batch", "host", "kv", "drafts"}
_PLAIN_FIELDS = tuple(f.name for f in dataclasses.fields(StepPlan) if f.name not in _NESTED)
