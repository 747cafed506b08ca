"""Structured output on the last stage (worker/sampling/grammar.py): the token mask of each draw
follows the request's grammar as the tokens it drew are consumed, rows without one are untouched,
a replayed request resumes where it was, and a bad grammar is refused by name."""

import json

import pytest
import torch

from dsv4ray.engine.plan import NewRequest
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.structured import grammar
from dsv4ray.text.tokenizer import Tokenizer
from dsv4ray.worker.sampling.grammar import Grammars
from dsv4ray.worker.sampling.sampler import GREEDY, sample_batch_async

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
    [
        ({"json": "{not json"}, "structured_output.json is not JSON"),
        ({"regex": "(unclosed"}, "structured_output.regex"),
        ({"grammar": "start: ???"}, "structured_output.grammar"),
    ],  # fmt: skip
)
def test_a_grammar_that_does_not_compile_is_refused_by_name(spec, problem):
    with pytest.raises(ValueError, match=problem):
        grammar(spec)


def _walk(tiny_ckpt, vocab, eos, spec, tokens):
    """An llguidance matcher of its own walking tokens -> the allowed tokens [V] bool at each of
    len(tokens) + 1 positions."""
    from llguidance import LLMatcher, LLTokenizer

    lltok = LLTokenizer(f"{tiny_ckpt}/tokenizer.json", n_vocab=vocab, eos_token=eos)
    matcher, out = LLMatcher(lltok, grammar(spec)), []
    for j in range(len(tokens) + 1):
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        out.append(bits[:vocab])
        if j < len(tokens):
            assert matcher.consume_token(tokens[j])
    return out


def _draw(logits: torch.Tensor):
    rows = len(logits)
    return sample_batch_async(logits, [GREEDY] * rows, [0] * rows, [None] * rows)


def test_draft_rows_are_masked_after_the_drafts_before_them(tiny_ckpt, tiny_model):
    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    eos, spec = tok.eos_token_id, {"json": SCHEMA}
    seq = tok.encode('{"ok": true, "tag": "red"}', add_bos=False)  # one token a byte
    head, drafts = seq[:6], seq[6:9]  # '{"ok":' drawn, then ' ', 't', 'r' drafted
    prompt = tok.encode("q", add_bos=False)
    grammars = Grammars(tiny_ckpt, vocab, eos)
    grammars.add(_new("a", spec, prompt + head, len(prompt)))
    grammars.add(_new("b", spec))
    # "a" verifies 3 drafts (4 rows), "b" one plain row after them in the batch order
    want = _walk(tiny_ckpt, vocab, eos, spec, head + drafts)[len(head) :]
    masked = grammars.mask(torch.zeros(5, vocab), ["a"] * 4 + ["b"], {"a": drafts})
    assert torch.equal(torch.isfinite(masked[:4]), torch.stack(want))
    assert torch.equal(torch.isfinite(masked[4]), _walk(tiny_ckpt, vocab, eos, spec, [])[0])
    # the target keeps the first draft, then draws 'f' where 't' was drafted
    other = tok.encode("f", add_bos=False)[0]
    assert want[1][other] and other != drafts[1]
    logits = torch.zeros(5, vocab)
    for row, token in enumerate([drafts[0], other, drafts[2], seq[9], seq[0]]):
        logits[row, token] = 1.0
    rows = ["a"] * 4 + ["b"]
    grammars.record(rows, _draw(grammars.mask(logits, rows, {"a": drafts})), {"a": drafts})
    after = grammars.mask(torch.zeros(2, vocab), ["a", "b"])
    kept = head + [drafts[0], other]  # the matcher took the kept draft and the target's token
    assert torch.equal(torch.isfinite(after[0]), _walk(tiny_ckpt, vocab, eos, spec, kept)[-1])
    assert torch.equal(torch.isfinite(after[1]), _walk(tiny_ckpt, vocab, eos, spec, seq[:1])[-1])


def test_a_draft_the_grammar_refuses_is_never_kept(tiny_ckpt, tiny_model):
    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    eos, spec = tok.eos_token_id, {"choice": ["yes", "no way"]}
    yes = tok.encode("yes", add_bos=False)
    bad = tok.encode("x", add_bos=False)[0]
    grammars = Grammars(tiny_ckpt, vocab, eos)
    grammars.add(_new("a", spec))
    want = _walk(tiny_ckpt, vocab, eos, spec, [])[0]
    assert not want[bad]
    masked = grammars.mask(torch.zeros(3, vocab), ["a"] * 3, {"a": [bad, yes[0]]})
    assert all(torch.equal(torch.isfinite(row), want) for row in masked)  # the draft ends the rows
    # the draw at row 0 cannot be the refused draft: the matcher consumes that draw alone
    logits = torch.zeros(3, vocab)
    logits[:, bad] = 10.0
    logits[0, yes[0]] = 1.0
    pending = _draw(grammars.mask(logits, ["a"] * 3, {"a": [bad, yes[0]]}))
    grammars.record(["a"] * 3, pending, {"a": [bad, yes[0]]})
    assert pending.result()[0].token_id == yes[0]
    after = grammars.mask(torch.zeros(1, vocab), ["a"])
    assert torch.equal(torch.isfinite(after[0]), _walk(tiny_ckpt, vocab, eos, spec, yes[:1])[-1])


def test_drafts_that_cross_the_after_token_start_the_grammar_there(tiny_ckpt, tiny_model):
    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    eos, after = tok.eos_token_id, tok.encode("!", add_bos=False)[0]
    spec = {"regex": "[a-c]{3}", "after_token": after}
    abc = tok.encode("abc", add_bos=False)
    grammars = Grammars(tiny_ckpt, vocab, eos)
    grammars.add(_new("a", spec))
    free = tok.encode("z", add_bos=False)[0]
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    masked = grammars.mask(logits, ["a"] * 4, {"a": [free, after, abc[0]]})
    assert torch.equal(masked[:2], logits[:2])  # before the after_token: free rows
    want = _walk(tiny_ckpt, vocab, eos, {"regex": "[a-c]{3}"}, abc[:1])
    assert torch.equal(torch.isfinite(masked[2:]), torch.stack(want))


def test_tool_choice_none_masks_every_token_that_would_open_a_call_block(tiny_ckpt, tiny_model):
    from dsv4ray.text.dsml import CALLS_START, no_call_grammar

    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    prompt = tok.encode("q", add_bos=False)
    done = tok.encode("Sure.\n\n" + CALLS_START[:-1], add_bos=False)  # one char short
    grammars = Grammars(tiny_ckpt, vocab, tok.eos_token_id)
    grammars.add(_new("a", {"grammar": no_call_grammar()}, prompt + done, len(prompt)))
    allowed = grammars.mask(torch.zeros(1, vocab), ["a"])[0] > float("-inf")
    opens = [t for t in range(vocab) if CALLS_START in tok.decode(done + [t])]
    assert opens and not allowed[opens].any()  # every token that completes the block's tag
    # the rest of the text (the thinking tags are added tokens, never text), and the end
    pieces = {t: tok.decode([t]) for t in range(vocab) if t not in opens}
    others = [t for t, p in pieces.items() if p.isascii() and p.isprintable()
              and p and "think>" not in p]  # fmt: skip
    assert others and allowed[others].all() and allowed[tok.eos_token_id]
