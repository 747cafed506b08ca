"""Byte-level tokenizer files for tiny checkpoints, with DeepSeek-V4's special tokens.

Ids: 0 = bos ``<｜begin▁of▁sentence｜>``, 1 = eos ``<｜end▁of▁sentence｜>``, byte b = token b + 2
(2..257), then 258 ``<｜User｜>``, 259 ``<｜Assistant｜>``, 260 ``<think>``, 261 ``</think>``; the
rest of a tiny vocab (up to 511) has no token. bos, eos and the role tokens are special (decoding
skips them); the think tokens are not, so generated reasoning keeps its ``</think>``. Encoding
with special tokens puts bos first (transformers' tokenizer does so). There is no jinja
template: the tokenizer renders chats in the DeepSeek-V4 format (``chat_encoding``).
"""

from __future__ import annotations

import json
import os

from dsv4ray.text.chat_encoding import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER

ROLE_TOKEN_IDS = {USER: 258, ASSISTANT: 259, THINK_START: 260, THINK_END: 261}


def bytes_to_unicode() -> dict[int, str]:
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
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {BOS: 0, EOS: 1}
    vocab.update({ch: b + 2 for b, ch in bytes_to_unicode().items()})
    vocab.update(ROLE_TOKEN_IDS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, USER, ASSISTANT])
    think = (THINK_START, THINK_END)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in think])
    # bos first, as tokenizer_config.json's add_bos_token says: transformers' fast tokenizer
    # adds what the post-processor adds (the engine encodes without it and adds bos itself)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 0)]
    )
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
