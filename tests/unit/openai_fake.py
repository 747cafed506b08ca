"""A scripted engine behind the ``EngineClient`` protocol, for HTTP tests without Ray or a model.

It answers every request with ``reply`` (token ids) the way ``AsyncEngine`` streams: one update
per token with its text delta (the tokenizer's incremental decoding), the last one with the
``RequestOutput``; ``max_tokens`` cuts the reply ("length"), else it ends with "stop". Knobs
script the failures the HTTP layer must answer: ``fail`` (raised before the first update),
``abort_after`` (tokens before the engine aborts the request with ``abort_reason``) and ``gate``
(an event every request waits for before its first token). Prompt ids outside the vocabulary are
a ValueError before the first update, as in the engine.
"""

from __future__ import annotations

import asyncio
import json
import os

from dsv4ray.engine.checks import check_sampling
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.core import RequestUpdate
from dsv4ray.engine.outputs import RequestMetrics, RequestOutput
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.model.tiny import tiny_config
from dsv4ray.text.tokenizer import StreamDecoder, Tokenizer
from dsv4ray.text.tokenizer_files import write_byte_tokenizer

SAMPLED_LOGPROB = -0.05  # every scripted token is the most likely one (greedy)


def write_checkpoint_files(out_dir: str) -> str:
    """The tiny checkpoint's config and tokenizer, without weights."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(tiny_config().to_official_dict(), f)
    write_byte_tokenizer(out_dir)
    return out_dir


SENTENCEPIECE_PIECES = ["<unk>", "<s>", "▁hello", "▁world", "!", "▁x", "<0xE6>", "<0x97>", "<0xA5>"]


def write_sentencepiece_tokenizer(out_dir: str) -> dict[str, int]:
    """A SentencePiece-style tokenizer.json (Llama's decoder: spaces as ▁, byte fallback, the
    text's first space stripped) over SENTENCEPIECE_PIECES, <s> special -> piece ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    ids = {p: i for i, p in enumerate(SENTENCEPIECE_PIECES)}
    hf = HFTokenizer(models.WordLevel(ids, unk_token="<unk>"))
    hf.add_special_tokens(["<s>"])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    hf.save(os.path.join(out_dir, "tokenizer.json"))
    return ids


class FakeEngine:
    def __init__(self, model_dir: str, max_model_len: int = 256) -> None:
        self.config = EngineConfig.build(model_dir, use_ray=False)
        self.tokenizer = Tokenizer(model_dir)
        self.max_model_len = max_model_len
        self.vocab_size = tiny_config().vocab_size
        self.reply = self.tokenizer.encode("Hello, world!", add_bos=False)
        self.requests: list[tuple[list[int], SamplingParams, str]] = []
        self.aborted: list[str] = []  # requests whose stream closed before they finished
        self.fail: Exception | None = None
        self.abort_after: int | None = None
        self.abort_reason = "the engine failed while the request ran"
        self.gate: asyncio.Event | None = None
        self.num_cached_tokens = 0
        self.sampled_logprob = lambda params: SAMPLED_LOGPROB  # every scripted token's
        self.events: list[tuple[str, str]] = []  # ("start" | "first token", request id)

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary")
        check_sampling(params, self.vocab_size)  # as EngineCore.add_request
        self.requests.append((ids, params, request_id))
        self.events.append(("start", request_id))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        finished = False
        try:
            async for update in self._updates(ids, params, request_id):
                finished = update.output is not None
                yield update
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def _updates(self, ids: list[int], params: SamplingParams, request_id: str):
        reply = self.reply[: params.max_tokens]
        decoder = StreamDecoder(self.tokenizer, self.tokenizer.answer_context(ids))  # as the engine
        for i, token in enumerate(reply):
            if i == self.abort_after:
                yield RequestUpdate(request_id, output=self._output(ids, reply[:i], params, True))
                return
            await asyncio.sleep(0)  # other requests run between steps
            update = RequestUpdate(request_id, [token], decoder.push([token]))
            if params.logprobs is not None:  # as the engine records them, per step
                update.logprobs = [self._step_logprobs(token, params.logprobs, params)]
            if i == 0:
                update.prompt_logprobs = self._prompt_logprobs(ids, params)
                self.events.append(("first token", request_id))
            if i == len(reply) - 1:
                update.output = self._output(ids, reply, params, False)
            yield update

    def _output(self, ids, generated, params: SamplingParams, aborted: bool) -> RequestOutput:
        if aborted:
            finish = "abort"
        else:
            finish = "length" if len(generated) == params.max_tokens else "stop"
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._step_logprobs(t, params.logprobs, params) for t in generated]
        return RequestOutput(
            request_id="",
            prompt_token_ids=ids,
            token_ids=list(generated),
            text=self.tokenizer.decode_after(self.tokenizer.answer_context(ids), generated),
            logprobs=logprobs,
            finish_reason=finish,
            metrics=RequestMetrics(len(ids), self.num_cached_tokens),
            error=self.abort_reason if aborted else None,
            prompt_logprobs=self._prompt_logprobs(ids, params),
        )

    def _step_logprobs(self, token: int, num_top: int, params) -> dict[int, float]:
        """The sampled token and the ``num_top`` best, as the engine records them."""
        others = [(token + 1 + k) % self.vocab_size for k in range(num_top)]
        sampled = self.sampled_logprob(params)
        return {token: sampled, **{t: -3.0 - k for k, t in enumerate(others)}}

    def _prompt_logprobs(self, ids: list[int], params) -> list | None:
        """RequestOutput.prompt_logprobs: token i has logprob -i / 10 at rank i + 1; the top n
        at its position are ids token + 7, token + 8, ... (logprob -0.01 * (k + 1))."""
        if params.prompt_logprobs is None:
            return None
        out = [None]
        for i, token in enumerate(ids[1:], start=1):
            top = [[(token + 7 + k) % self.vocab_size, -0.01 * (k + 1), k + 1]
                   for k in range(params.prompt_logprobs)]  # fmt: skip
            out.append([[token, -i / 10, i + 1], *top])
        return out

    async def stats(self) -> dict:
        if isinstance(self.fail, OSError):
            raise self.fail
        return {
            "num_running": 0,
            "num_waiting": 0,
            "num_pages": 16,
            "num_free_pages": 16,
            "num_cached_pages": 0,
            "num_preemptions": 0,
        }
