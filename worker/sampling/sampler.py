"""Sampling on the last stage: one batched pass over every sampling row of a step.

``sample_batch(logits [R, V] fp32, rows, positions, num_top)`` does greedy, temperature, top-k and
top-p for all R rows at once with per-row parameters as tensors, gathers the requested logprobs in
the same pass and copies one [R, 1 + 2 n] float64 tensor to the host (sampled ids, then the sampled
token's logprob and the top n (logprob, id) pairs where asked). ``sample_batch_async`` issues that
copy without waiting for it (the engine overlaps the wait with its next step's host work).

Seeded sampling is counter-based, so it is batch-invariant: the token a request samples at
sequence position p is ``argmax_v(filtered(logits / T)[v] + G(seed, p, v))``, where G is Gumbel
noise made from an integer hash of (seed, p, v) alone (Gumbel-max draws v with probability
softmax(filtered(logits / T))[v]). No generator state lives between steps: a request's tokens
depend only on its own logits, seed and positions, not on its row, on what else shares the
batch, or on preemption and recompute.

On CUDA the noise, the add and the argmax run fused in one Triton pass (kernels/sampler.py);
its torch reference there (``gumbel_noise`` over the ``mix32`` hash) runs elsewhere.
``ReferenceSampler`` and ``reference_logprobs`` are the per-request torch reference the batched
pass is tested against (the same filtering rules, ``torch.multinomial`` draws).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from dsv4ray.engine.sampling import GREEDY_BELOW, INT64
from dsv4ray.kernels import dispatch
from dsv4ray.kernels.sampler import MASK32, mix32

log = logging.getLogger("dsv4ray.worker")


@dataclass(frozen=True)
class SamplingRow:
    """One request's validated sampling parameters (temperature 0.0 = greedy, top_k -1 = off,
    min_p 0.0 = off)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float = 0.0

    @classmethod
    def from_plan(cls, params: dict, seed: int) -> SamplingRow:
        """ValueError naming the field when a value would break (or silently skew) the pass."""
        temperature = params.get("temperature", 0.0)
        top_p, top_k = params.get("top_p", 1.0), params.get("top_k", -1)
        if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not _is_int(top_k) or (top_k != -1 and top_k < 1):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {top_k!r}")
        if not _is_int(seed) or not -INT64 <= seed < INT64:
            raise ValueError(f"seed must be a 64-bit signed int, got {seed!r}")
        min_p = params.get("min_p", 0.0)
        if not _is_number(min_p) or not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
        temperature = 0.0 if temperature < GREEDY_BELOW else float(temperature)
        return cls(temperature, float(top_p), int(top_k), int(seed), float(min_p))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def columns(self) -> tuple:
        """The row's first three upload columns: temperature, top_p, top_k (any k >= 2**31
        keeps every token, and stays exact in float64)."""
        return self.temperature, self.top_p, min(self.top_k, 2**31)

    @functools.cached_property
    def _seed_key(self) -> int:
        seed = self.seed & (2**64 - 1)
        return mix32((seed & MASK32) ^ mix32(seed >> 32))

    def key(self, position: int) -> int:
        """The noise key of the token drawn at this sequence position, in [0, 2**32)."""
        return mix32(self._seed_key ^ mix32(position & MASK32))

    def filters(self, vocab_size: int) -> bool:
        return self.top_p < 1.0 or 0 < self.top_k < vocab_size


GREEDY = SamplingRow(0.0, 1.0, -1, 0)


@dataclass
class Sampled:
    """One row's outcome: a token id (and logprobs when asked), or why it has none."""

    token_id: int = -1
    logprobs: list | None = None  # [logprob, [[token id, logprob], ...]]
    error: str | None = None


def sample_batch(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    positions: list[int],
    num_top: list[int | None],
) -> list[Sampled]:
    """logits [R, V] fp32; rows, positions (sequence position of the token drawn) and num_top
    (None = no logprobs) are per row. A row whose logits are not finite fails alone; should the
    batched pass raise, each row is retried on its own so only the offending one fails."""
    return sample_batch_async(logits, rows, positions, num_top).result()


@dataclass
class PendingSample:
    """A launched sampling pass: the ids on the device, and their host copy on its way.
    token_ids [R] int64 (-1 where the logits are not finite) stays usable on the device (a
    lookahead step reads it); ``result`` waits for the copy and unpacks it."""

    token_ids: torch.Tensor
    host: torch.Tensor | None = None  # [R, 1 + 2 n] float64, pinned on CUDA
    event: torch.cuda.Event | None = None
    num_top: list | None = None
    outcomes: list[Sampled] | None = None  # already known (the row-by-row path)

    def result(self) -> list[Sampled]:
        if self.outcomes is None:
            if self.event is not None:
                self.event.synchronize()
            self.outcomes = _unpack(self.host.tolist(), self.num_top)
        return self.outcomes


def sample_batch_async(logits, rows, positions, num_top, raw=None) -> PendingSample:
    """``sample_batch`` without waiting for the device: the host copy is issued, not awaited.
    raw: the logits before sampling controls (worker/sampling/logits_processors.py), which logprobs
    report; None: logits themselves."""
    raw = logits if raw is None else raw
    try:
        return _sample_pass(logits, rows, positions, num_top, raw)
    except Exception as exc:  # a row that escaped validation: find it, serve the others
        log.warning("batched sampling failed (%r); sampling row by row", exc)
    out = []
    for i in range(len(rows)):
        try:
            one = (logits[i : i + 1], rows[i : i + 1], positions[i : i + 1], num_top[i : i + 1],
                   raw[i : i + 1])  # fmt: skip
            out += _sample_pass(*one).result()
        except Exception as exc:
            out.append(Sampled(error=f"sampling failed: {type(exc).__name__}: {exc}"[:300]))
    ids = torch.tensor([o.token_id if o.error is None else -1 for o in out])
    return PendingSample(ids.to(logits.device), outcomes=out)


def _sample_pass(logits, rows, positions, num_top, raw) -> PendingSample:
    num_rows, vocab_size = logits.shape
    drawn = [i for i, row in enumerate(rows) if not row.is_greedy]
    if len(drawn) < num_rows:
        token_ids = logits.argmax(-1)  # [R] greedy
    else:  # every row draws: each is written below
        token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    filtering = [i for i in drawn if rows[i].filters(vocab_size)]
    plain = [i for i in drawn if not rows[i].filters(vocab_size)]
    if drawn:  # one upload; rows that filter (and need the sort) come first
        params = _upload(filtering + plain, rows, positions, logits.device)
        for part, filters in ((params[: len(filtering)], True), (params[len(filtering) :], False)):
            if part.shape[0] == num_rows:  # every row, in order
                token_ids = _draw(logits, part, filters)
            elif part.shape[0]:
                idx = part[:, 4].long()
                drawn_ids = _draw(logits.index_select(0, idx), part, filters)
                token_ids = token_ids.index_copy(0, idx, drawn_ids)
    row_max = logits.amax(-1)  # NaN propagates; x - x is 0 only where x is finite
    token_ids = token_ids.masked_fill(row_max - row_max != 0, -1)
    packed = token_ids.double()[:, None]  # ids < 2**53 are exact in float64
    if any(n is not None for n in num_top):
        packed = torch.cat([packed, _logprob_columns(raw, token_ids, num_top)], dim=1)
    if not packed.is_cuda:
        return PendingSample(token_ids, packed, None, num_top)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)  # the step's one device-to-host copy
    event = torch.cuda.Event()
    event.record()
    return PendingSample(token_ids, host, event, num_top)


def _upload(drawn: list[int], rows: list[SamplingRow], positions: list[int], device):
    """[S, 6] float64 on the device for the S rows that draw: temperature, top_p, top_k, noise
    key, row index (all exact in float64), min_p, moved in one copy."""
    table = [(*rows[i].columns, rows[i].key(positions[i]), i, rows[i].min_p) for i in drawn]
    return to_device(table, torch.float64, device)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array as a device tensor without blocking the host. On CUDA the copy is
    from pinned staging and asynchronous (the caching host allocator reuses a buffer only once
    its copy is done): a copy from pageable memory would wait for the step's forward, and the
    host would lose its lead."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _draw(logits: torch.Tensor, params: torch.Tensor, filters: bool) -> torch.Tensor:
    """logits [S, V] of rows that draw -> [S] token ids by Gumbel-max over the filtered,
    tempered logits."""
    temperature, top_p = params[:, 0].float(), params[:, 1].float()
    top_k, key = params[:, 2].long(), params[:, 3].long()
    scaled = _min_p(logits / temperature[:, None], params[:, 5].float())
    if not filters:
        return _argmax_noised(scaled, None, key)
    values, order = scaled.sort(dim=-1, descending=True)
    values = _filter_sorted(values, top_k, top_p)
    return order.gather(1, _argmax_noised(values, order, key)[:, None]).squeeze(1)


def _min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tempered logits [S, V] with the tokens less likely than min_p times the likeliest at -inf
    (p / p_max < min_p exactly where the logit is below max + log(min_p))."""
    floor = scaled.amax(-1) + torch.log(min_p)  # -inf where min_p is 0
    return scaled.masked_fill(scaled < floor[:, None], float("-inf"))


def _argmax_noised(values: torch.Tensor, vocab_ids: torch.Tensor | None, key: torch.Tensor):
    """[S] column of the largest values + G(key, vocab id) per row (vocab id = column when
    vocab_ids is None): one fused Triton pass on CUDA, its torch reference elsewhere
    (kernels/sampler.py)."""
    return dispatch.gumbel_argmax(values, vocab_ids, key)


def _filter_sorted(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """values [S, V] sorted descending -> the same with the tokens top-k and top-p drop at -inf:
    values below the k-th are dropped, then the tail once the mass before a token reaches p
    (the top token always stays)."""
    vocab_size = values.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    kth = values.gather(1, (k - 1)[:, None])
    values = values.masked_fill(values < kth, float("-inf"))
    probs = torch.softmax(values, dim=-1)
    drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    return values.masked_fill(drop, float("-inf"))


def _logprob_columns(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list) -> torch.Tensor:
    """[R, 1 + 2 n] float64 (n = the largest num_top): the sampled token's logprob, n top
    logprobs, their n ids; NaN in rows that asked for none."""
    wanted = [i for i, n in enumerate(num_top) if n is not None]
    width = max(num_top[i] for i in wanted)
    idx = to_device(wanted, torch.long, logits.device)
    logp = torch.log_softmax(logits.index_select(0, idx), dim=-1)
    columns = [logp.gather(1, token_ids.index_select(0, idx).clamp(min=0)[:, None])]
    if width:
        top = torch.topk(logp, width, dim=-1)
        columns += [top.values, top.indices.to(logp.dtype)]
    out = torch.full(
        (logits.shape[0], 1 + 2 * width), float("nan"), dtype=torch.float64, device=logits.device
    )
    return out.index_copy(0, idx, torch.cat(columns, dim=1).double())


def _unpack(host: list[list[float]], num_top: list[int | None]) -> list[Sampled]:
    width = (len(host[0]) - 1) // 2 if host else 0
    out = []
    for values, n in zip(host, num_top):
        token = int(values[0])
        if token < 0:
            out.append(Sampled(error="sampling failed: the logits are not finite"))
            continue
        logprobs = None
        if n is not None:
            pairs = [[int(values[2 + width + j]), values[2 + j]] for j in range(n)]
            logprobs = [values[1], pairs]
        out.append(Sampled(token, logprobs))
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ReferenceSampler:
    """Torch reference: one request, one row at a time, a seeded ``torch.Generator``."""

    def __init__(self, params: dict, seed: int) -> None:
        self.temperature = float(params.get("temperature", 0.0))
        self.top_p = float(params.get("top_p", 1.0))
        self.top_k = int(params.get("top_k", -1))
        self.min_p = float(params.get("min_p", 0.0))
        self.gen = torch.Generator().manual_seed(int(seed))

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] fp32 -> token id."""
        if self.temperature == 0.0:
            return int(logits.argmax())
        return int(torch.multinomial(self.probs(logits).cpu(), 1, generator=self.gen))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] the distribution a non-greedy draw follows."""
        return torch.softmax(self._filtered(logits.float() / self.temperature), dim=-1)

    def _filtered(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_p > 0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < self.min_p * probs.max(), float("-inf"))
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # keep the first past p
            drop[0] = False  # a top_p below the top probability (or fp32's range) keeps the top
            logits = logits.masked_fill(
                torch.zeros_like(drop).scatter(0, order, drop), float("-inf")
            )
        return logits


def reference_logprobs(logits: torch.Tensor, token: int, num_top: int) -> list:
    """[sampled token's logprob, [[token id, logprob], ...] top num_top] from raw logits [V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, num_top) if num_top else None
    pairs = [[int(i), float(v)] for v, i in zip(top.values, top.indices)] if top is not None else []
    return [float(logp[token]), pairs]
