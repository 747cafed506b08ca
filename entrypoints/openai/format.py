"""OpenAI response bodies and stream chunks built from engine outputs (plain dicts).

``CompletionFormat`` renders ``/v1/completions`` objects (``text_completion``), ``ChatFormat``
renders ``/v1/chat/completions`` objects (``chat.completion`` and ``chat.completion.chunk``).
Logprobs: the engine records, per generated token, ``{sampled id: logprob, top ids: logprob}``;
completions render the legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset`` lists (each ``top_logprobs`` entry holds the sampled token beside the top n, so
``logprobs: 0`` gives the sampled token's alone), chat renders ``content: [{token, logprob,
bytes, top_logprobs}]``. A stream's chunk carries the logprobs of the tokens it brings (clients
concatenate chunk logprobs: the joined result is the same as without streaming). A chat answer
generated in thinking mode carries its reasoning (the text up to ``</think>``) as
``reasoning_content`` beside ``content``, in the message and in the stream's deltas alike. With
tools (entrypoints/tool_calls.py), the content's call block becomes ``tool_calls``: in a stream,
each call is one delta with its id, name and whole arguments, sent when its invoke is complete
and checked; text that may start a block is held back until it is decided.
"""

from __future__ import annotations

import codecs
import copy
import json
import os
import re
import time
import uuid

from dsv4ray.engine.outputs import RequestOutput
from dsv4ray.entrypoints.openai.reasoning import ReasoningSplitter
from dsv4ray.entrypoints.tool_calls import ChatTools, finish, openai_call
from dsv4ray.text.tokenizer import BYTE_OF_CHAR


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: {...}`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def usage(outputs: list[RequestOutput], leaders: list[RequestOutput] | None = None) -> dict:
    """The usage of a response's engine requests: each prompt counted once (``leaders``: one
    output per prompt; all of them by default), every generated token counted."""
    leaders = outputs if leaders is None else leaders
    num_prompt = sum(len(out.prompt_token_ids) for out in leaders)
    num_completion = sum(len(out.token_ids) for out in outputs)
    cached = sum(out.metrics.num_cached_tokens for out in leaders)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class TokenBytes:
    """The exact bytes of a token id (a byte-level BPE token may hold part of a UTF-8
    character, which decoding it alone would turn into U+FFFD; a SentencePiece-style token's
    "▁" is the space it puts in front of its word, which decoding it alone strips)."""

    def __init__(self, model_path: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        kinds = _decoder_kinds(json.loads(self._tok.to_str()).get("decoder"))
        self._byte_level = "ByteLevel" in kinds  # DeepSeek's tokenizers are
        self._spaces = "Metaspace" in kinds or "Replace ▁" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        added = self._tok.get_added_tokens_decoder()
        self._added = set(added)
        self._special = {i for i, token in added.items() if token.special}
        self._byte_of = BYTE_OF_CHAR

    def __call__(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._added:
            if all(ch in self._byte_of for ch in piece):
                return bytes(self._byte_of[ch] for ch in piece)
        if self._spaces and token_id not in self._added:
            byte = _BYTE_PIECE.fullmatch(piece) if self._byte_fallback else None
            return bytes([int(byte[1], 16)]) if byte else piece.replace("▁", " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def in_text(self, token_id: int) -> bytes:
        """The bytes a token adds to a decoded text (special tokens are skipped there)."""
        return b"" if token_id in self._special else self(token_id)

    def opening(self, token_id: int) -> bytes:
        """The bytes a token adds as the first text of a decoded text: a SentencePiece-style
        decoder strips the space its "▁" stands for there (as it does decoding it alone)."""
        raw = self.in_text(token_id)
        if self._spaces and raw.startswith(b" "):
            if not self._tok.decode([token_id], skip_special_tokens=False).startswith(" "):
                return raw[1:]
        return raw


class TextOffsets:
    """Where each token of a sequence starts in its decoded text (``text_offset``): special
    tokens add nothing, and the tokens of a character split across them all start where it
    does."""

    def __init__(self, token_bytes: TokenBytes, start: int = 0, opens_text: bool = False) -> None:
        """start: the characters of the text before these tokens (an echoed prompt).
        opens_text: these tokens were decoded as a text of their own (no earlier text, e.g. a
        prompt of special tokens only), so the first of them that adds text adds its
        ``opening`` bytes."""
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = start
        self.opens_text = opens_text

    def next(self, token_id: int) -> int:
        offset = self.chars
        raw = self.token_bytes.in_text(token_id)
        if self.opens_text and raw:
            raw, self.opens_text = self.token_bytes.opening(token_id), False
        self.chars += len(self.decoder.decode(raw))
        return offset


def legacy_token(raw: bytes, token_id: int) -> str:
    """A token as the legacy completions logprobs name it (``tokens``, ``top_logprobs`` keys):
    its text, ``bytes:\\xe4\\xbd`` when its bytes are not whole UTF-8 characters, as OpenAI
    writes them, ``token_id:N`` when the tokenizer does not name the id; so that distinct
    tokens never share a key."""
    if not raw:
        return f"token_id:{token_id}"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """The steps of a tokenizer.json decoder (a Sequence's included): their types, and
    "Replace ▁" for a step that turns "▁" into spaces."""
    kinds: set[str] = set()
    for step in (decoder or {}).get("decoders") or ([decoder] if decoder else []):
        kinds |= _decoder_kinds(step) if step.get("type") == "Sequence" else {step.get("type")}
        pattern = step.get("pattern") or {}
        if step.get("type") == "Replace" and pattern.get("String") == "▁":
            kinds.add("Replace ▁")
    return kinds


class _Format:
    """What both endpoints share: ids, the model name, token strings, the top-n logprobs."""

    prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(
        self, model: str, token_bytes: TokenBytes, num_top: int | None, return_token_ids: bool
    ) -> None:
        self.request_id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.index = 0  # the choice this format renders (a response's choices share the id)
        self.prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs of the prompt
        self.show_prompt_logprobs: int | None = None  # prompt_logprobs: the top n to render
        self.model = model
        self.token_bytes = token_bytes
        self.num_top = num_top  # None: no logprobs
        self.return_token_ids = return_token_ids

    def _envelope(self, name: str, choices: list) -> dict:
        return {
            "id": self.request_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def legacy_token(self, token_id: int) -> str:
        return legacy_token(self.token_bytes(token_id), token_id)

    def _steps(self, token_ids: list[int], logprobs: list | None) -> list:
        """Per token: (token id, its logprob, the num_top best (id, logprob))."""
        steps = []
        for token_id, lps in zip(token_ids, logprobs or []):
            best = sorted(lps.items(), key=lambda item: -item[1])[: self.num_top]
            steps.append((token_id, lps[token_id], best))
        return steps

    def _choice_extras(self, output: RequestOutput | None, token_ids: list[int] | None,
                       logprobs: list | None = None) -> dict:  # fmt: skip
        """logprobs and, when asked for, the token ids: a response's own (``token_ids`` None),
        or a chunk's new ones with their ``logprobs``."""
        extras = {"logprobs": None}
        if self.num_top is not None:
            if token_ids is None:
                extras["logprobs"] = self.logprobs(self._steps(output.token_ids, output.logprobs))
            elif token_ids:
                extras["logprobs"] = self.logprobs(self._steps(token_ids, logprobs), stream=True)
        if self.return_token_ids:
            extras["token_ids"] = list(output.token_ids if token_ids is None else token_ids)
        return extras

    def logprobs(self, steps: list, stream: bool = False) -> dict:
        """The logprobs object of these tokens; stream: the next chunk's (offsets go on)."""
        raise NotImplementedError

    def sibling(self, index: int) -> _Format:
        """A format for another choice of the same response (same id, fresh state)."""
        other = copy.copy(self)
        other.index = index
        other.reset()
        return other

    def reset(self) -> None:
        """Per-choice stream state back to its start."""

    def response(self, choices: list[dict], usage_: dict) -> dict:
        return {**self._envelope(self.object_name, choices), "usage": usage_}

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage_}

    def rendered_prompt_logprobs(self) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id:
        {logprob, rank, decoded_token}} for the token and the top ``show_prompt_logprobs``."""
        if self.show_prompt_logprobs is None or self.prompt_logprobs is None:
            return None
        out = []
        for entries in self.prompt_logprobs:
            if entries is None:
                out.append(None)
                continue
            shown = [entries[0]] + [e for e in entries[1:] if e[2] <= self.show_prompt_logprobs]
            out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)}
                        for t, lp, rank in shown})  # fmt: skip
        return out


class CompletionFormat(_Format):
    """echo: the prompt's text, which then opens the choice's text (its tokens open the
    logprobs, the first with none; ``set_echo``)."""

    prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.echo: str | None = None
        self.prompt_ids: list[int] = []
        self.echo_offsets: list[int] = []  # where each prompt token starts in the echo
        self.answer_opens_text = False  # set_answer_opens_text
        self.reset()

    def set_echo(self, text: str, prompt_ids: list[int], offsets: list[int]) -> None:
        """The choice's text opens with the prompt's text, whose tokens (prompt_ids) start at
        offsets; the answer's then start after it."""
        self.echo, self.prompt_ids, self.echo_offsets = text, list(prompt_ids), list(offsets)
        self.reset()

    def set_answer_opens_text(self, opens: bool) -> None:
        """Whether the answer was decoded after no text of its prompt (its first space, on a
        SentencePiece-style tokenizer, is then dropped: ``TextOffsets``' opens_text)."""
        self.answer_opens_text = opens
        self.reset()

    def reset(self) -> None:
        self.offsets = self._answer_offsets()  # a stream's text so far
        self.opened = False  # a stream's first chunk (the echo, the prompt logprobs) went out

    def _answer_offsets(self) -> TextOffsets:
        """The answer's tokens' offsets: its text follows the echo."""
        return TextOffsets(self.token_bytes, len(self.echo or ""), self.answer_opens_text)

    def choice(self, output: RequestOutput) -> dict:
        extras = self._choice_extras(output, None)
        if self.echo is not None and extras["logprobs"] is not None:
            prompt = self._prompt_steps()
            extras["logprobs"] = self.logprobs(
                prompt + self._steps(output.token_ids, output.logprobs), prompt=len(prompt)
            )
        choice = {"index": self.index, "text": (self.echo or "") + output.text,
                  "finish_reason": output.finish_reason, **extras}  # fmt: skip
        if self.show_prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.rendered_prompt_logprobs()
        return choice

    def start_chunks(self) -> list[dict]:
        return []

    def chunk(self, text: str, token_ids: list[int], output: RequestOutput | None,
              logprobs: list | None = None) -> dict:  # fmt: skip
        opening, self.opened = not self.opened, True
        extras = self._choice_extras(output, token_ids, logprobs)
        if opening and self.echo is not None:
            text = self.echo + text
            if self.num_top is not None:
                prompt = self._prompt_steps()  # the prompt's tokens open them
                steps = prompt + self._steps(token_ids, logprobs)
                self.offsets = self._answer_offsets()  # not yet past this chunk's tokens
                extras["logprobs"] = self.logprobs(steps, stream=True, prompt=len(prompt))
        choice = {"index": self.index, "text": text,
                  "finish_reason": output.finish_reason if output else None, **extras}  # fmt: skip
        if opening and self.show_prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.rendered_prompt_logprobs()
        return self._envelope(self.chunk_object_name, [choice])

    def _prompt_steps(self) -> list:
        """The echoed prompt's tokens as logprob steps: (id, logprob, best); the first token
        has no logprob (None) and no alternatives."""
        steps = []
        for token_id, entries in zip(self.prompt_ids, self.prompt_logprobs or ()):
            if entries is None:
                steps.append((token_id, None, []))
                continue
            best = [(t, lp) for t, lp, rank in entries[1:] if rank <= self.num_top]
            steps.append((token_id, entries[0][1], best))
        return steps

    def logprobs(self, steps: list, stream: bool = False, prompt: int = 0) -> dict:
        """text_offset indexes the choice's text: the echoed prompt's tokens (the first prompt
        steps, at ``echo_offsets``), then the answer's (a stream's offsets go on from its
        earlier chunks)."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        at = self.offsets if stream else self._answer_offsets()
        for i, (token_id, logprob, best) in enumerate(steps):
            text = self.legacy_token(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            top = {**{self.legacy_token(t): lp for t, lp in best}, text: logprob}
            tops.append(None if logprob is None else top)
            offsets.append(self.echo_offsets[i] if i < prompt else at.next(token_id))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class ChatFormat(_Format):
    prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self, *args, thinking: bool = False, start: str = "start", tools: ChatTools | None = None
    ) -> None:
        """thinking: the answer's reasoning is given back as ``reasoning_content``; start:
        where the answer begins (text/chat_encoding.prefix_state); tools: the request's, whose
        calls are parsed out of the answer."""
        super().__init__(*args)
        self.start, self.thinking, self.tools = start, thinking, tools
        self.reset()

    def reset(self) -> None:
        self.splitter = ReasoningSplitter(self.start) if self.thinking else None
        self.parser = self.tools.parser() if self.tools is not None else None
        self.num_calls = 0  # calls streamed so far

    def response(self, choices: list[dict], usage_: dict) -> dict:
        body = super().response(choices, usage_)
        if self.show_prompt_logprobs is not None:  # the prompt's, once (vLLM's place)
            body["prompt_logprobs"] = self.rendered_prompt_logprobs()
        return body

    def choice(self, output: RequestOutput) -> dict:
        message = {"role": "assistant", "content": output.text}
        if self.splitter is not None:
            split = ReasoningSplitter(self.start).split(output.text)
            message["reasoning_content"], message["content"] = split
        finish_reason = output.finish_reason
        if self.tools is not None:
            content, calls, finish_reason = self.tools.answer(message["content"], finish_reason)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
        return {
            "index": self.index,
            "message": message,
            "finish_reason": finish_reason,
            **self._choice_extras(output, None),
        }

    def start_chunks(self) -> list[dict]:
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._envelope(self.chunk_object_name, [choice])]

    def chunk(self, text: str, token_ids: list[int], output: RequestOutput | None,
              logprobs: list | None = None) -> dict | None:  # fmt: skip
        delta = self._delta(text, last=output is not None)
        extras = self._choice_extras(output, token_ids, logprobs)
        if not delta and output is None and not any(extras.values()):
            return None  # text held back (a tool-call block or a thinking tag may start)
        choice = {
            "index": self.index,
            "delta": delta,
            "finish_reason": finish(output.finish_reason, self.num_calls) if output else None,
            **extras,
        }
        return self._envelope(self.chunk_object_name, [choice])

    def _delta(self, text: str, last: bool) -> dict:
        reasoning, content = "", text
        if self.splitter is not None:
            reasoning, content = self.splitter.push(text)
            if last:
                more_reasoning, more_content = self.splitter.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        delta = {"reasoning_content": reasoning} if reasoning else {}
        calls = []
        if self.parser is not None:
            content, calls = self._calls(content, last)
        delta = {**delta, "content": content} if content else delta
        return {**delta, "tool_calls": calls} if calls else delta

    def _calls(self, content: str, last: bool) -> tuple[str, list[dict]]:
        """The content delta -> (its text, its tool-call deltas)."""
        events = self.parser.push(content) + (self.parser.finish() if last else [])
        texts, calls = [], []
        for kind, value in events:
            if kind == "text":
                texts.append(value)
            elif self.tools.parallel or self.num_calls == 0:
                calls.append({"index": self.num_calls, **openai_call(value)})
                self.num_calls += 1
        return "".join(texts), calls

    def logprobs(self, steps: list, stream: bool = False) -> dict:
        content = []
        for token_id, logprob, best in steps:
            entry = self._token_entry(token_id, logprob)
            entry["top_logprobs"] = [self._token_entry(t, lp) for t, lp in best]
            content.append(entry)
        return {"content": content}

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        raw = self.token_bytes(token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}
