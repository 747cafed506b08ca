"""Tokenizer of a checkpoint folder (``tokenizer.json`` + ``tokenizer_config.json``).

Adds the bos token the way the checkpoint asks, renders chat messages and detokenises
incrementally for streaming. Chat rendering, in order of precedence:

1. the checkpoint's jinja template (``chat_template`` in ``tokenizer_config.json``, or
   ``chat_template.jinja``), rendered as transformers renders it (``chat_template.py``), with
   ``chat_template_kwargs`` passed to it as template variables;
2. the DeepSeek-V4 chat format (``chat_encoding.py``) for a DeepSeek-V4 tokenizer without a
   template (one that has the ``<｜User｜>`` and ``<｜Assistant｜>`` tokens), which takes
   ``thinking`` and ``drop_thinking``;
3. otherwise a plain template: the bos token, one ``<|role|>content`` line per message, then
   ``<|assistant|>``.
"""

from __future__ import annotations

import codecs
import json
import logging
import os

from dsv4ray.text import chat_encoding
from dsv4ray.text.chat_template import ChatTemplateError, compile_template, render
from dsv4ray.text.tokenizer_files import bytes_to_unicode

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


BYTE_OF_CHAR = {ch: b for b, ch in bytes_to_unicode().items()}  # a byte-level character's byte
# prompt tokens an answer is decoded after (`Tokenizer.decode_after`): enough for a decoder's
# word boundary, few enough that a token costs little to decode
CONTEXT_TOKENS = 6


class Tokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}")
        self._tok = HFTokenizer.from_file(file)
        cfg = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        # tokenizer_config.json's special tokens, else the ids config.json gives the model
        self.bos_token = _token_text(cfg.get("bos_token")) or self._model_token(path, "bos")
        self.eos_token = _token_text(cfg.get("eos_token")) or self._model_token(path, "eos")
        self.add_bos = bool(cfg.get("add_bos_token", self.bos_token is not None))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = _jinja_template(path, cfg)
        dsv4 = all(self._tok.token_to_id(t) is not None for t in chat_encoding.SPECIAL_TOKENS)
        self.chat_format = "jinja" if self.chat_template else ("dsv4" if dsv4 else "default")
        if self.chat_format == "default":
            self.chat_template = DEFAULT_CHAT_TEMPLATE
        else:
            _check_template(path, self.chat_template)
        # a ByteLevel decoder alone: streams decode each token's bytes (``token_bytes``)
        self.byte_level = type(self._tok.decoder) is decoders.ByteLevel
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = {idx for idx, token in added.items() if token.special}
        self._token_bytes: dict[int, bytes] = {}

    def _model_token(self, path: str, which: str) -> str | None:
        """The text of config.json's ``<which>_token_id`` in this vocabulary (None: none)."""
        idx = _config_token_id(path, which)
        return self._tok.id_to_token(idx) if idx is not None else None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        add = self.add_bos if add_bos is None else add_bos
        if add and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def char_starts(self, text: str, ids: list[int]) -> list[int] | None:
        """Where each of ids, ``encode(text)``'s tokens, starts in text, in characters (special
        tokens' text included; a BOS that encode added at 0, the tokens of one character at
        its start); None when ids are not text's tokens."""
        enc = self._tok.encode(text, add_special_tokens=False)
        added = len(ids) - len(enc.ids)  # a BOS encode put in front, or none
        if added not in (0, 1) or list(ids[added:]) != enc.ids:
            return None
        if added and ids[0] != self.bos_token_id:
            return None
        return [0] * added + [start for start, _ in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def answer_context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last CONTEXT_TOKENS tokens, after which its answer is decoded
        (``decode_after``, ``StreamDecoder``): none for a byte-level tokenizer, and none when
        their text ends in U+FFFD (an unfinished or invalid byte-fallback run, which the
        answer's bytes would decode again)."""
        if self.byte_level:
            return []
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        return [] if self.decode(context).endswith("\ufffd") else context

    def decode_after(self, context: list[int], ids: list[int]) -> str:
        """The text ids add after ``context`` (the prompt's last tokens): ``decode(context +
        ids)`` past ``decode(context)``. A byte-level decoder gives a token the same text
        whatever precedes it, so there this is ``decode(ids)``; a SentencePiece-style decoder
        strips the space of a text's first token, which an answer's first token keeps after
        its prompt. Where the context's text is not a prefix of the whole (a byte-fallback run
        the answer completes), the answer is decoded alone."""
        if self.byte_level or not context:
            return self.decode(ids)
        head = self.decode(context)
        full = self.decode([*context, *ids])
        return full[len(head) :] if full.startswith(head) else self.decode(ids)

    def token_bytes(self, ids: list[int]) -> bytes:
        """The bytes a byte-level decoder turns ids into (``byte_level`` tokenizers only):
        ``decode(ids)`` is them decoded as UTF-8 with each invalid sequence replaced by U+FFFD.
        Special tokens and ids outside the vocabulary give none. Each id's bytes are worked out
        once, when it is first seen."""
        cache, out = self._token_bytes, []
        for idx in ids:
            data = cache.get(idx)
            if data is None:
                data = cache[idx] = self._bytes_of(idx)
            out.append(data)
        return b"".join(out)

    def _bytes_of(self, idx: int) -> bytes:
        token = self._tok.id_to_token(idx) if idx >= 0 else None
        if token is None or idx in self._special_ids:
            return b""
        try:
            return bytes([BYTE_OF_CHAR[ch] for ch in token])
        except KeyError:  # a character outside the byte alphabet: the token's own UTF-8
            return token.encode()

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """Rendered prompt text; a template that refuses the messages raises ValueError. tools:
        OpenAI function objects, rendered by the DeepSeek-V4 format only (its tool-call language
        is the one answers are parsed in)."""
        if self.chat_format == "dsv4":
            options = chat_encoding.ChatOptions.from_kwargs(chat_template_kwargs)
            return chat_encoding.encode_messages(messages, options, add_generation_prompt, tools)
        if tools:
            raise ValueError(
                f"tools: this checkpoint's chat format ({self.chat_format} template) has no "
                "tool-call language; tools need the DeepSeek-V4 chat format"
            )
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **(chat_template_kwargs or {}),
        }
        return render(
            self.chat_template,
            **context,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
        )

    def encode_chat(
        self,
        messages: list[dict],
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The rendered template already carries the bos token when the template writes it."""
        text = self.apply_chat_template(messages, True, chat_template_kwargs, tools)
        return self.encode(text, add_bos=False)

    @property
    def think_end_id(self) -> int | None:
        """The id of ``</think>`` when it is one token (a thinking answer's reasoning ends at
        it), else None."""
        return self._tok.token_to_id(chat_encoding.THINK_END)

    def parse_reasoning(
        self, text: str, chat_template_kwargs: dict | None = None
    ) -> tuple[str | None, str]:
        """Generated text -> (reasoning_content, content): with ``thinking`` on, the reasoning
        is the text up to ``</think>``; with it off there is none."""
        if not chat_encoding.thinking_asked(chat_template_kwargs):
            return None, text
        return chat_encoding.split_reasoning(text)


def _config_token_id(path: str, which: str) -> int | None:
    """config.json's ``<which>_token_id`` (the first of a list), None when it gives none."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            value = json.load(f).get(f"{which}_token_id")
    except (OSError, ValueError):
        return None
    value = value[0] if isinstance(value, list) and value else value
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _jinja_template(path: str, cfg: dict) -> str | None:
    """tokenizer_config.json's ``chat_template`` (a string, or named templates: "default"),
    else a ``chat_template.jinja`` file."""
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template:
        return template
    file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(file):
        with open(file) as f:
            return f.read()
    return None


def _check_template(path: str, template: str | None) -> None:
    """A template that does not parse is said when the model loads, not first by a chat request
    (completions still serve; every chat request is refused with the same message)."""
    if template is None:
        return
    try:
        compile_template(template)
    except ChatTemplateError as exc:
        logging.getLogger("dsv4ray.model").warning("%s: %s; chat requests will be refused",
                                                   path, exc)  # fmt: skip


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class StreamDecoder:
    """Turns a growing list of token ids into text deltas in time linear in the output.

    A byte-level tokenizer (DeepSeek's) streams each token's bytes through an incremental UTF-8
    decoder, which holds back an unfinished sequence. Other decoders go through the tokenizers
    library's ``DecodeStream``, which decodes only a short window of recent ids per token and
    holds back an unfinished UTF-8 sequence (a window ending in U+FFFD). Invariant,
    for decoders where a byte's text is fixed once its character is complete (byte-level BPE,
    as DeepSeek's): the deltas ``push`` returns, followed by ``flush()``, concatenate to
    ``tokenizer.decode_after(context, ids)`` (``decode(ids)`` for byte-level ones). A
    byte-fallback decoder re-decodes a whole run of byte tokens as U+FFFD when the run turns
    out invalid, which no stream can take back: there ``DecodeStream``
    may refuse a window, and the stream then decodes all ids per token from that point on
    (callers take the final text from ``decode_after``).
    """

    def __init__(self, tokenizer: Tokenizer, context: list[int] | None = None) -> None:
        """context: the tokens the answer's text is decoded after (``answer_context``)."""
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.context = list(context or [])
        self.ids: list[int] = []
        self.num_chars = 0  # length of the text handed out so far
        # byte-level: each token's bytes through an incremental UTF-8 decoder; else DecodeStream
        # seeded with the context
        self._utf8 = (
            codecs.getincrementaldecoder("utf-8")("replace") if tokenizer.byte_level else None
        )
        self._stream = (
            None
            if tokenizer.byte_level
            else DecodeStream(ids=self.context or None, skip_special_tokens=True)
        )

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        if self._utf8 is not None:
            delta = self._utf8.decode(self.tokenizer.token_bytes(token_ids))
            self.num_chars += len(delta)
            return delta
        if self._stream is not None:
            try:
                delta = self._stream.step(self.tokenizer._tok, list(token_ids)) or ""
            except Exception:  # a window that disagrees with the text handed out: decode it all
                self._stream = None
            else:
                self.num_chars += len(delta)
                return delta
        full = self.tokenizer.decode_after(self.context, self.ids)
        if full.endswith("\ufffd"):
            return ""
        return self._rest(full)

    def flush(self) -> str:
        """Whatever the stream still holds back (an unfinished UTF-8 sequence, decoded as is)."""
        return self._rest(self.tokenizer.decode_after(self.context, self.ids))

    def _rest(self, full: str) -> str:
        delta, self.num_chars = full[self.num_chars :], len(full)
        return delta
