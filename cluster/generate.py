"""``dsv4ray generate``: stream completions of prompts to the terminal."""

from __future__ import annotations

import sys

import torch

from dsv4ray.model import load_reference
from dsv4ray.model.tokenizer import StreamDecoder, Tokenizer


def generate(
    model_path: str,
    prompts: list[str],
    max_tokens: int = 32,
    temperature: float = 0.0,
    pp_size: int = 1,
    seed: int | None = None,
    out=None,
) -> int:
    if max_tokens < 1:
        raise SystemExit(f"dsv4ray: --max-tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise SystemExit(f"dsv4ray: --temperature must be >= 0, got {temperature}")
    if pp_size != 1:
        raise SystemExit("dsv4ray: --pp > 1 needs the Ray pipeline, which this build lacks")
    out = out or sys.stdout
    tok = Tokenizer(model_path)
    model = load_reference(model_path, torch.float32)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for prompt in prompts:
        out.write(f"{prompt}")
        out.flush()
        for delta in _stream(model, tok, tok.encode(prompt), max_tokens, temperature, gen):
            out.write(delta)
            out.flush()
        out.write("\n")
    return 0


def _stream(model, tok: Tokenizer, ids: list[int], max_tokens: int, temperature: float, gen):
    """Greedy (or sampled) loop over the reference's incremental path, yielding text deltas."""
    state = model.new_state(1)
    logits = model.step(torch.tensor([ids]), state)[0, -1]
    decoder = StreamDecoder(tok)
    for _ in range(max_tokens):
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
        if nxt == tok.eos_token_id:
            break
        yield decoder.push([nxt])
        logits = model.step(torch.tensor([[nxt]]), state)[0, -1]
    yield decoder.flush()
