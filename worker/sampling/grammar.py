"""Structured output on the last stage: one llguidance matcher per constrained request, advanced
by its drawn tokens, and the token mask of its next draw.

The matcher has consumed every token the request drew before, except the one of its previous
step, which the device may still be computing when the next step is launched: that one is read
(``PendingSample``'s host copy, waiting for that step's draw only, never for the forward of
the step being launched) and consumed when the next step samples. A request that comes back
after a preemption replays the tokens it generated (``NewRequest.history``). A constraint with
an ``after_token`` leaves its row free (no mask) until that token is drawn, and its matcher
starts with the token after it. A row whose
matcher is done allows only the end of sequence; a matcher in error (a token it could not
take) fails its row alone. Rows without a grammar are not touched.

A step that verifies drafts scores a request at d + 1 positions: row j's mask is the
matcher's after the first j drafts (consumed, then rolled back). A draft the grammar refuses
ends the rows that count: the target's token at its row is drawn under the mask, so it cannot
equal that draft, and the rows after it are never accepted (they repeat its mask). After the
draw the matcher consumes what the verification keeps: the drafts equal to the target's
tokens, then the target's token after them.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from dsv4ray.engine.plan import NewRequest
from dsv4ray.engine.structured import grammar
from dsv4ray.kernels.dispatch import apply_token_masks
from dsv4ray.worker.sampling.sampler import to_device


class Grammars:
    """model_path: the checkpoint (its tokenizer.json); vocab_size: the logits' width."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_id: int) -> None:
        self.model_path, self.vocab_size, self.eos = model_path, vocab_size, eos_token_id
        self.tokenizer = None  # llguidance's view of the vocabulary, made with the first grammar
        self.matchers: dict = {}  # req_id -> LLMatcher
        # req_id -> (PendingSample, first row, drafts) of its last draw
        self.pending: dict[str, tuple] = {}
        self.waiting: dict[str, int] = {}  # req_id -> the after_token its matcher waits for
        self.num_words = (vocab_size + 31) // 32  # int32 words of a packed token mask

    def add(self, new: NewRequest) -> None:
        """A request with a structured_output constraint gets its matcher (and replays what it
        generated before a preemption)."""
        self.drop(new.req_id)
        spec = new.sampling.get("structured_output")
        if spec is None:
            return
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer(), grammar(spec))
        generated = new.history[new.prompt_len :]
        after = spec.get("after_token")
        if after is not None:
            if after not in generated:
                self.waiting[new.req_id] = after
            generated = generated[generated.index(after) + 1 :] if after in generated else []
        if generated and not matcher.consume_tokens(generated):
            raise ValueError(f"structured_output: {matcher.get_error()}"[:300])
        self.matchers[new.req_id] = matcher

    def drop(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.pending.pop(req_id, None)
        self.waiting.pop(req_id, None)

    def constrains(self, req_ids) -> bool:
        """Whether any of these requests has a grammar."""
        return any(r in self.matchers for r in req_ids)

    def mask(self, logits: torch.Tensor, req_ids: list[str],
             drafts: dict[str, list[int]] | None = None) -> torch.Tensor:  # fmt: skip
        """logits [R, V] with every token the rows' grammars forbid at -inf (rows without one
        unchanged; a new tensor when any row has one). A request's consecutive rows score its
        positions in order, after its drafts (req_id -> the step's drafts; none: one row)."""
        groups: dict[str, list[int]] = {}
        for i, req_id in enumerate(req_ids):
            if req_id in self.matchers:
                groups.setdefault(req_id, []).append(i)
        mask_of = np.full(len(req_ids), -1, dtype=np.int32)  # row -> its mask, -1: none
        allowed = []
        for req_id, idx in groups.items():
            self._catch_up(req_id)
            tokens = (drafts or {}).get(req_id, [])[: len(idx) - 1]
            for i, words in zip(idx, self._masks(req_id, tokens), strict=True):
                if words is not None:  # None: free until the after_token
                    mask_of[i] = len(allowed)
                    allowed.append(words)
        if not allowed:
            return logits
        # the row map and masks in one copy
        packed = to_device(np.concatenate([mask_of, *allowed]), torch.int32, logits.device)
        return apply_token_masks(logits.float().contiguous(), packed, self.num_words)

    def record(self, req_ids: list[str], pending,
               drafts: dict[str, list[int]] | None = None) -> None:  # fmt: skip
        """The rows' draw (``PendingSample``), which each constrained request consumes before
        its next one (its drafts the target's tokens kept, then the token after them)."""
        for row in range(len(req_ids) - 1, -1, -1):  # a request's first row last
            req_id = req_ids[row]
            if req_id in self.matchers:
                self.pending[req_id] = (pending, row, list((drafts or {}).get(req_id, [])))

    def _masks(self, req_id: str, tokens: list[int]) -> list:
        """The allowed tokens ([W] int32 packed, None: free) at each of len(tokens) + 1
        positions, the j-th after tokens[:j]; the matcher ends where it was."""
        matcher, waiting = self.matchers[req_id], self.waiting.get(req_id)
        out, consumed = [], 0
        for j in range(len(tokens) + 1):
            out.append(None if waiting is not None else self._allowed(matcher))
            if j == len(tokens):
                break
            if waiting is not None:
                waiting = None if tokens[j] == waiting else waiting
            elif matcher.is_stopped() or matcher.try_consume_tokens([tokens[j]]) != 1:
                out += [out[-1]] * (len(tokens) - j)  # rows never accepted
                break
            else:
                consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return out

    def _catch_up(self, req_id: str) -> None:
        last = self.pending.pop(req_id, None)
        if last is None:
            return
        pending, first, drafts = last
        outcomes = pending.result()  # the previous step's draw, done by now
        kept = 0
        while kept < len(drafts) and outcomes[first + kept].token_id == drafts[kept]:
            kept += 1
        for token in [*drafts[:kept], outcomes[first + kept].token_id]:
            if req_id in self.waiting:
                if token == self.waiting[req_id]:
                    del self.waiting[req_id]  # the constraint starts with the next token
            elif token >= 0:
                self.matchers[req_id].consume_token(token)

    def _allowed(self, matcher) -> np.ndarray:
        """[W] int32, bit t % 32 of word t // 32 set where the matcher lets the next token be t
        (only eos once it is done, nothing once it is in error: that row fails alone)."""
        if matcher.is_error():
            return np.zeros(self.num_words, dtype=np.int32)
        if matcher.is_stopped():
            words = np.zeros(self.num_words, dtype=np.int32)
            words.view(np.uint32)[self.eos // 32] = np.uint32(1 << (self.eos % 32))
            return words
        return np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[: self.num_words]

    def _tokenizer(self):
        if self.tokenizer is None:
            from llguidance import LLTokenizer

            path = os.path.join(self.model_path, "tokenizer.json")
            self.tokenizer = LLTokenizer(path, n_vocab=self.vocab_size, eos_token=self.eos)
        return self.tokenizer
