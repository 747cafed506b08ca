"""Byte-level tokenizer files for tiny checkpoints: 0 = bos, 1 = eos, byte b = token b + 2."""

from __future__ import annotations

import json
import os

from dsv4ray.model.tokenizer import DEFAULT_CHAT_TEMPLATE

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _bytes_to_unicode() -> dict[int, str]:
    """The printable-character alphabet that byte-level pre-tokenisers map bytes onto."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {BOS: 0, EOS: 1}
    vocab.update({ch: b + 2 for b, ch in _bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
