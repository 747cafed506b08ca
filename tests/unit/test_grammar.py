"""Structured output on the last stage (worker/grammar.py): the token mask of each draw follows
the request's grammar as the tokens it drew are consumed, rows without one are untouched, a
replayed request resumes where it was, and a bad grammar is refused by name."""

import json

import pytest
import torch

from dsv4ray.engine.plan import NewRequest
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.structured import grammar
from dsv4ray.model.tokenizer import Tokenizer
from dsv4ray.worker.grammar import Grammars
from dsv4ray.worker.sampler import GREEDY, sample_batch_async

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "blue"]}},
          "required": ["ok", "tag"], "additionalProperties": False}  # fmt: skip


def _new(req_id: str, spec, history=(), prompt_len=0):
    sp = SamplingParams(max_tokens=64, structured_output=spec)
    return NewRequest(req_id, 0, [0], [0], 0, -1, sp.to_dict(), 0, prompt_len, list(history))


def _decode(grammars, tok, vocab, req_ids, steps, seed=0):
    """Greedy draws from random logits through the grammars' masks -> each row's text."""
    g = torch.Generator().manual_seed(seed)
    drawn = {r: [] for r in req_ids}
    for _ in range(steps):
        logits = grammars.mask(torch.randn(len(req_ids), vocab, generator=g), req_ids)
        pending = sample_batch_async(logits, [GREEDY] * len(req_ids), [0] * len(req_ids),
                                     [None] * len(req_ids))  # fmt: skip
        grammars.record(req_ids, pending)
        for r, out in zip(req_ids, pending.result()):
            drawn[r].append(out.token_id)
    return {r: tok.decode([t for t in ids if t != tok.eos_token_id]) for r, ids in drawn.items()}


def test_masks_make_random_logits_spell_what_each_grammar_allows(tiny_ckpt, tiny_model):
    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    grammars = Grammars(tiny_ckpt, vocab, tok.eos_token_id)
    specs = {"json": {"json": SCHEMA}, "choice": {"choice": ["yes", "no way"]},
             "regex": {"regex": "[a-c]{3}-[0-9]+"}}  # fmt: skip
    for req_id, spec in specs.items():
        grammars.add(_new(req_id, spec))
    # random logits pick the optional whitespace often: enough steps to reach the end
    texts = _decode(grammars, tok, vocab, [*specs, "free"], steps=400)
    answer = json.loads(texts["json"])
    assert set(answer) == {"ok", "tag"} and answer["tag"] in ("red", "blue")
    assert texts["choice"] in ("yes", "no way")
    assert texts["regex"][:4].count("-") == 1 and texts["regex"][:3].isalpha()
    assert "free" not in grammars.matchers  # a row without a grammar is left alone


def test_a_replayed_request_resumes_its_grammar_where_it_was(tiny_ckpt, tiny_model):
    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    prompt = tok.encode("q", add_bos=False)
    done = tok.encode('{"ok": true, ', add_bos=False)  # engine/structured.py's JSON layout
    grammars = Grammars(tiny_ckpt, vocab, tok.eos_token_id)
    grammars.add(_new("a", {"json": SCHEMA}, prompt + done, len(prompt)))
    text = _decode(grammars, tok, vocab, ["a"], steps=400, seed=3)["a"]
    assert json.loads('{"ok": true, ' + text)["ok"] is True


@pytest.mark.parametrize(
    "spec,problem",
    [({"json": "{not json"}, "structured_output.json is not JSON"),
     ({"regex": "(unclosed"}, "structured_output.regex"),
     ({"grammar": "start: ???"}, "structured_output.grammar")],  # fmt: skip
)
def test_a_grammar_that_does_not_compile_is_refused_by_name(spec, problem):
    with pytest.raises(ValueError, match=problem):
        grammar(spec)
