"""Tokenizer of a checkpoint folder (``tokenizer.json`` + ``tokenizer_config.json``).

Adds the bos token the way the checkpoint asks, renders chat messages with the checkpoint's
template (or the documented default below), and detokenises incrementally for streaming.
"""

from __future__ import annotations

import json
import os

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Tokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}")
        self._tok = HFTokenizer.from_file(file)
        cfg = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", self.bos_token is not None))
        self.chat_template = cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        add = self.add_bos if add_bos is None else add_bos
        if add and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The rendered template already carries the bos token when the template writes it."""
        return self.encode(self.apply_chat_template(messages), add_bos=False)


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, holding back split UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def flush(self) -> str:
        """Whatever the stream still holds back (an unfinished UTF-8 sequence, decoded as is)."""
        full = self.tokenizer.decode(self.ids)
        delta, self.text = full[len(self.text) :], full
        return delta
