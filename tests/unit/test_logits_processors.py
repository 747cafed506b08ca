"""Sampling controls on the last stage (worker/sampling/logits_processors.py) against a reference
written from their definitions, one row at a time: logit_bias, min_tokens, the repetition,
frequency and presence penalties, their counts kept on the device as tokens are drawn, and rows
rebuilt from a request's tokens after a preemption."""

import pytest
import torch

from dsv4ray.engine.plan import NewRequest
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.worker.sampling.logits_processors import LogitsProcessors

V, SLOTS = 40, 6


def _new(req_id: str, slot: int, history: list[int], prompt_len: int, stop_ids=(), **params):
    sp = SamplingParams(max_tokens=64, **params)
    history = history if sp.penalizes else []
    return NewRequest(req_id, slot, [0], [0], 0, -1, sp.to_dict(), 0, prompt_len, history,
                      list(stop_ids))  # fmt: skip


def reference(row: torch.Tensor, params: dict, tokens: list[int], prompt_len: int,
              position: int, stop_ids=()) -> torch.Tensor:  # fmt: skip
    """One row's controlled logits, element by element."""
    x = row.clone()
    for token, bias in params.get("logit_bias", {}).items():
        x[token] += bias
    if position - prompt_len < params.get("min_tokens", 0):
        for token in stop_ids:
            x[token] = float("-inf")
    rep = params.get("repetition_penalty", 1.0)
    for token in set(tokens):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    generated = tokens[prompt_len:]
    for token in set(generated):
        x[token] -= params.get("frequency_penalty", 0.0) * generated.count(token)
        x[token] -= params.get("presence_penalty", 0.0)
    return x


CASES = {  # req_id -> (slot, prompt, generated so far, params, stop ids)
    "bias": (0, [1, 2, 3], [4], {"logit_bias": {5: 3.5, 7: -100.0}}, ()),
    "min": (1, [2, 2], [], {"min_tokens": 2, "logit_bias": {9: 1.0}}, (0, 11)),
    "rep": (2, [3, 3, 8, 1], [8, 8, 20], {"repetition_penalty": 1.7}, ()),
    "freq": (3, [5], [6, 6, 6, 9], {"frequency_penalty": 0.4, "presence_penalty": -0.3}, ()),
    "all": (4, [12, 13], [13, 14, 14], {"repetition_penalty": 0.8, "frequency_penalty": 1.1,
                                        "presence_penalty": 2.0, "logit_bias": {14: 0.5}}, ()),
    "plain": (5, [1], [2], {}, ()),
}  # fmt: skip


def _processors():
    procs = LogitsProcessors(SLOTS, V, "cpu")
    for req_id, (slot, prompt, generated, params, stop_ids) in CASES.items():
        procs.add(_new(req_id, slot, prompt + generated, len(prompt), stop_ids, **params))
    return procs


def _check(procs, logits, order, tokens, positions):
    got = procs.apply(logits, order, positions)
    for i, req_id in enumerate(order):
        _, prompt, _, params, stop_ids = CASES[req_id]
        want = reference(logits[i], params, tokens[req_id], len(prompt), positions[i], stop_ids)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=0)


def test_controls_equal_the_reference_in_any_row_order():
    procs = _processors()
    order = ["plain", "all", "min", "freq", "bias", "rep"]  # rows do not follow the slots
    logits = torch.randn(len(order), V, generator=torch.Generator().manual_seed(0)) * 3
    tokens = {r: c[1] + c[2] for r, c in CASES.items()}
    positions = [len(tokens[r]) for r in order]
    _check(procs, logits, order, tokens, positions)
    assert torch.equal(procs.apply(logits[:1], ["plain"], positions[:1]), logits[:1])


def test_min_tokens_holds_the_stop_ids_back_until_enough_tokens_came():
    procs = _processors()
    logits = torch.zeros(3, V)
    prompt = len(CASES["min"][1])
    out = procs.apply(logits, ["min"] * 3, [prompt, prompt + 1, prompt + 2])
    assert torch.isinf(out[:2, [0, 11]]).all() and torch.isfinite(out[2]).all()


def test_min_tokens_never_leaves_a_row_nothing_to_draw():
    """A row whose only finite logits are its stop ids (a grammar that has closed the answer)
    keeps them; a row with anything else to draw still has them held back."""
    procs = _processors()
    prompt = len(CASES["min"][1])
    logits = torch.full((2, V), float("-inf"))
    logits[:, [0, 11]] = 1.0  # row 0: only the stop ids are allowed
    logits[1, 5] = 2.0  # row 1: one other token too
    out = procs.apply(logits, ["min", "min"], [prompt, prompt])
    assert torch.equal(out[0, [0, 11]], torch.tensor([1.0, 1.0]))
    assert torch.isinf(out[1, [0, 11]]).all() and out[1, 5] == 2.0


def test_drawn_tokens_are_counted_on_the_device_for_the_next_step():
    procs = _processors()
    tokens = {r: c[1] + c[2] for r, c in CASES.items()}
    order = ["rep", "freq", "all", "plain"]
    drawn = torch.tensor([20, -1, 30, 3])  # -1: a row whose draw failed counts nothing
    procs.record(order, drawn)
    tokens["rep"].append(20)
    tokens["all"].append(30)
    logits = torch.randn(len(order), V, generator=torch.Generator().manual_seed(1)) * 2
    _check(procs, logits, order, tokens, [len(tokens[r]) for r in order])


def test_a_preempted_request_starts_again_from_its_tokens():
    procs = _processors()
    procs.record(["all"], torch.tensor([14]))  # counted incrementally
    slot, prompt, generated, params, _ = CASES["all"]
    again = LogitsProcessors(SLOTS, V, "cpu")
    again.add(_new("all", slot, prompt + generated + [14], len(prompt), **params))
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    position = len(prompt + generated) + 1
    rebuilt = again.apply(logits, ["all"], [position])
    torch.testing.assert_close(rebuilt, procs.apply(logits, ["all"], [position]), rtol=0, atol=0)


def test_a_bias_outside_the_vocabulary_is_refused_by_name():
    with pytest.raises(ValueError, match="logit_bias token id 40"):
        LogitsProcessors(SLOTS, V, "cpu").add(_new("x", 0, [1], 1, logit_bias={40: 1.0}))
