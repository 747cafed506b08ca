"""A device link hands a stage's rows to the next through a ring of slots: what arrives is
exactly what was sent, in order; a slot is never written again before its rows were read; rows
that do not fit, and failed steps, stay on the channel."""

import pytest
import torch

from dsv4ray.engine.plan import StageResult
from dsv4ray.worker.graphs.device_link import DeviceLink

HC_HIDDEN, K = 12, 5


def _link(depth=2, rows=8, topk=True) -> tuple[DeviceLink, DeviceLink]:
    """(sender's mapping, receiver's ring) of one ring."""
    ring = DeviceLink.allocate(depth, rows, HC_HIDDEN, torch.bfloat16, K if topk else None, "cpu")
    sender = DeviceLink.open(ring.export())
    ring.peer_fences(sender.fences.export())
    return sender, ring


def _result(step: int, num: int, seed: int, topk=True, tokens=True) -> StageResult:
    g = torch.Generator().manual_seed(seed)
    out = StageResult(step, residual=torch.randn(num, HC_HIDDEN, generator=g).bfloat16())
    out.topk = torch.randint(-1, 1000, (num, K), generator=g) if topk else None
    out.token_ids = torch.randint(0, 300, (num,), generator=g) if tokens else None
    return out


def _copy(result: StageResult) -> tuple:
    return tuple(None if t is None else t.clone() for t in (result.residual, result.topk,
                                                            result.token_ids))  # fmt: skip


def _same(a: tuple, b: tuple) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))  # fmt: skip


def test_rows_arrive_exactly_as_sent_while_the_ring_wraps():
    sender, ring = _link(depth=2)
    for step in range(7):  # three and a half turns of a two-slot ring
        sent = _result(step, num=1 + step % 8, seed=step, tokens=step % 2 == 0)
        want = _copy(sent)
        sender.send(sent)
        assert sent.link is not None and sent.residual is None  # only the ticket travels
        ticket = ring.receive(sent)
        assert _same(_copy(sent), want)
        ring.release(ticket)


def test_a_slot_is_not_written_again_before_its_rows_were_read():
    sender, ring = _link(depth=2)
    first, second, third = (_result(i, 3, seed=i) for i in range(3))
    want = _copy(first)
    sender.send(first)
    sender.send(second)
    with pytest.raises(RuntimeError, match="waits for step"):  # the device would wait here
        sender.send(third)
    ticket = ring.receive(first)
    assert _same(_copy(first), want)  # the refused send left slot 1 alone
    ring.release(ticket)
    sender.send(third)  # slot free again
    assert third.link is not None


def test_the_receiver_waits_for_rows_not_written_yet():
    sender, ring = _link()
    sent = _result(0, 4, seed=1)
    sender.send(sent)
    late = StageResult(1)
    late.link = type(sent.link)(sent.link.seq + 1, 4, True, True)
    with pytest.raises(RuntimeError, match="waits for step"):
        ring.receive(late)


def test_oversized_failed_and_rowless_results_stay_on_the_channel():
    sender, ring = _link(rows=8, topk=False)
    too_big = _result(0, 9, seed=0, topk=False)
    failed = _result(1, 2, seed=1, topk=False)
    failed.failed = "boom"
    with_topk = _result(2, 2, seed=2)  # the ring has no top-k slots for it
    rowless = StageResult(3)
    for result in (too_big, failed, with_topk, rowless):
        before = _copy(result)
        sender.send(result)
        assert result.link is None and _same(_copy(result), before)
        assert ring.receive(result) is None
    assert sender.sent == 0
