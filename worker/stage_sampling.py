"""The last stage's sampling: each request's sampling row and controls, a step's draw, and
where the drawn ids go next.

A request's ``SamplingRow`` is made when the stage first hears of it (or the reason its
parameters were refused, so that one request cannot fail the batch); its controls live in
``LogitsProcessors``. A step samples every sampling entry in one batched pass over the logits
of the entries' last rows (worker/sampling/sampler.py), after the controls; the drawn ids stay on
the device (``StageResult.pending``) until the step is settled, and go on toward the first
stage's table of sampled ids for the next plan's lookahead entries (worker/graphs/overlap.py). A
step that verifies drafts samples every scored position (worker/spec/verify.py). It stays beside
StageWorker rather than in worker/sampling/ because it joins sampling with verification
(worker/spec/), which samples through worker/sampling/ itself.
"""

from __future__ import annotations

import torch

from dsv4ray.engine.plan import NewRequest, StageResult, StepPlan
from dsv4ray.worker.batch import BatchMeta
from dsv4ray.worker.graphs.overlap import SampledTokens
from dsv4ray.worker.sampling.grammar import Grammars
from dsv4ray.worker.sampling.logits_processors import LogitsProcessors
from dsv4ray.worker.sampling.sampler import GREEDY, SamplingRow, sample_batch_async
from dsv4ray.worker.spec.verify import sample_with_drafts, verify_rows

PROMPT_LOGPROB_ROWS = 512  # prompt rows whose logits are computed at once


class StageSampling:
    """model: the last stage's (its head gives the logits); model_path: the checkpoint (the
    grammars' tokenizer); first: the first stage's table of sampled ids when this stage is
    also the first, else None."""

    def __init__(self, model, model_path: str, num_slots: int, device,
                 first: SampledTokens | None) -> None:  # fmt: skip
        self.model, self.device, self.first = model, device, first
        self.rows: dict[str, SamplingRow | str] = {}  # str: why the parameters were refused
        cfg = model.cfg
        self.controls = LogitsProcessors(num_slots, cfg.vocab_size, device)
        self.grammars = Grammars(model_path, cfg.vocab_size, cfg.eos_token_id)
        self.peer_tokens: SampledTokens | None = None  # the first stage's, over CUDA IPC

    def add(self, new: NewRequest) -> None:
        try:
            self.rows[new.req_id] = SamplingRow.from_plan(new.sampling, new.seed)
            self.controls.add(new)
            self.grammars.add(new)
        except ValueError as exc:  # refused here so that it cannot fail the whole batch
            self.rows[new.req_id] = f"sampling failed: ValueError: {exc}"[:300]

    def drop(self, req_id: str) -> None:
        self.rows.pop(req_id, None)
        self.controls.drop(req_id)
        self.grammars.drop(req_id)

    @property
    def follows_drafts(self) -> bool:
        """Whether a verification's rows need the step's drafts (a grammar masks each row after
        the drafts before it)."""
        return bool(self.grammars.matchers)

    def process(self, logits: torch.Tensor, req_ids: list[str], positions: list[int],
                drafts: dict[str, list[int]] | None = None):  # fmt: skip
        """Rows' logits [R, V] through their grammars and controls (each row draws the token
        at its position; a request's rows after its drafts, req_id -> drafts). Masks first:
        the controls see what a grammar leaves, so min_tokens never rules out a row's last
        allowed tokens (an answer the grammar has closed still ends)."""
        masked = self.grammars.mask(logits, req_ids, drafts)
        return self.controls.apply(masked, req_ids, positions)

    def drawn(self, req_ids: list[str], pending, drafts: dict[str, list[int]] | None = None):
        """A draw of these rows (``PendingSample``): the penalties count it, the grammars
        consume what its verification keeps before the rows' next draw."""
        self.controls.record(req_ids, pending.token_ids)
        self.grammars.record(req_ids, pending, drafts)

    def sample(self, plan: StepPlan, meta: BatchMeta, x, result: StageResult, tables,
               logits=None) -> None:  # fmt: skip
        """Samples the plan's sampling entries from x [T, hc, hidden], or from their logits
        [R, V] when a replayed graph computed them."""
        if plan.full_logits:
            self._full_logits(plan, x, result)
        if plan.prompt_logprobs:
            self._prompt_logprobs(plan, x, result)
        if any(e.num_drafts for e in plan.batch):
            sample_with_drafts(self.model, plan, x, self.rows, result, self)
            return
        if not meta.sample_req_ids:
            return
        if logits is None:
            logits = self.model.logits(x[meta.sample_idx])  # [R, V] fp32
        req_ids = meta.sample_req_ids
        # the token drawn follows the entry's last one: its position keys the seeded noise
        at = {e.req_id: e.start_pos + e.num_tokens for e in plan.batch if e.sample}
        positions = [at[req_id] for req_id in req_ids]
        rows = [self.rows[req_id] for req_id in req_ids]
        pending = sample_batch_async(
            self.process(logits, req_ids, positions),
            [row if isinstance(row, SamplingRow) else GREEDY for row in rows],
            positions,
            [plan.logprobs.get(req_id) for req_id in req_ids],
            raw=logits,
        )
        self.drawn(req_ids, pending)
        result.pending = (req_ids, rows, pending)
        self._share(plan, [tables[r].state_slot for r in req_ids], pending.token_ids, result)

    def verify(self, plan: StepPlan, logits: torch.Tensor, row_of, draft_fill=None):
        """A replayed verification's sampling pass over logits [T', V] (row_of: the row of each
        batch token), launched (worker/spec/verify.PendingVerify). draft_fill: the plan's drafts
        still on the device, read first when a grammar's masks follow them."""
        if draft_fill is not None and self.grammars.constrains(plan.draft_lookahead):
            draft_fill.resolve()
        return verify_rows(plan, logits, row_of, self.rows, self)

    def _share(self, plan: StepPlan, slots: list[int], token_ids, result: StageResult) -> None:
        """The drawn ids [R] (device) toward the first stage's table, for the next plan's
        lookahead entries (worker/graphs/overlap.py)."""
        if self.first is not None:  # this stage is also the first
            self.first.record(slots, token_ids)
        elif self.peer_tokens is not None:
            self.peer_tokens.record(slots, token_ids)
            self.peer_tokens.post()
        elif plan.take:  # through the graph's edge back to the first stage (``take``)
            result.samples = token_ids

    def _prompt_logprobs(self, plan: StepPlan, x: torch.Tensor, result: StageResult) -> None:
        """Each asking entry's prompt tokens: their logprob, rank and the top n at their
        position (the logits of the row before), in blocks of rows (a chunk's [rows, V] fp32
        logits would be gigabytes)."""
        start = 0
        for entry in plan.batch:
            asked = plan.prompt_logprobs.get(entry.req_id)
            if asked is not None:
                num_top, targets = asked
                rows = torch.arange(start, start + len(targets), device=self.device)
                entries = []
                for block in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                    block_rows = rows[block : block + PROMPT_LOGPROB_ROWS]
                    ids = targets[block : block + PROMPT_LOGPROB_ROWS]
                    entries += self._token_logprobs(x[block_rows], ids, num_top)
                result.prompt_logprobs[entry.req_id] = (entry.start_pos, entries)
            start += entry.num_tokens

    def _token_logprobs(self, x: torch.Tensor, ids: list[int], num_top: int) -> list:
        """x [n, ...] rows, ids [n] the tokens that follow them -> per row [[id, logprob,
        rank], then the num_top best that are not id]."""
        logprobs = torch.log_softmax(self.model.logits(x), dim=-1)  # [n, V] fp32
        target = torch.tensor(ids, device=logprobs.device)[:, None]
        chosen = logprobs.gather(1, target)  # [n, 1]
        rank = (logprobs > chosen).sum(dim=1) + 1
        top = logprobs.topk(num_top, dim=-1) if num_top else None
        chosen, rank = chosen[:, 0].tolist(), rank.tolist()
        top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top else ([], [])
        out = []
        for i, token in enumerate(ids):
            entry = [[token, chosen[i], rank[i]]]
            if top is not None:
                entry += [[t, lp, r + 1] for r, (t, lp) in enumerate(zip(top_ids[i], top_lps[i]))
                          if t != token]  # fmt: skip
            out.append(entry)
        return out

    def _full_logits(self, plan: StepPlan, x: torch.Tensor, result: StageResult) -> None:
        """One head pass and one host copy for every scored request's tokens."""
        spans, start = [], 0
        for entry in plan.batch:
            if entry.req_id in plan.full_logits:
                spans.append((entry.req_id, start, entry.num_tokens))
            start += entry.num_tokens
        if not spans:
            return
        rows = torch.cat([torch.arange(s, s + n) for _, s, n in spans]).to(self.device)
        logits = self.model.logits(x[rows]).cpu()  # [sum n, V] fp32
        offset = 0
        for req_id, _, num_tokens in spans:
            result.full_logits[req_id] = logits[offset : offset + num_tokens].clone()
            offset += num_tokens
