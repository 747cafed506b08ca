"""StepResults hands a pipeline's outputs to collect by step id: results that come before their
step's collect wait for it, and results of steps no caller will collect (abandoned by an
interrupt) are dropped instead of being kept for the life of the engine."""

from collections import deque

from dsv4ray.engine.pipeline import StepResults
from dsv4ray.engine.plan import NO_RESULT, StageResult


def _reader(step_ids):
    outputs = deque(StageResult(step_id=s) for s in step_ids)
    return outputs, outputs.popleft


def test_results_in_order_and_early_ones_wait_for_their_collect():
    results = StepResults()
    outputs, read = _reader([NO_RESULT, 4, 3, 5])  # step 4 had no batch: it answered first
    assert results.collect(3, read).step_id == 3
    assert results.collect(4, read).step_id == 4  # kept while step 3 was read
    assert results.collect(5, read).step_id == 5
    assert not results.early and not outputs


def test_an_abandoned_step_is_dropped_when_a_later_step_is_collected():
    results = StepResults()
    outputs, read = _reader([7, 6, 8, 9])
    assert results.collect(6, read).step_id == 6  # step 7's result, read on the way, kept
    assert list(results.early) == [7]
    assert results.collect(8, read).step_id == 8  # step 7's caller was interrupted: dropped
    assert not results.early
    outputs.extend([StageResult(step_id=10), StageResult(step_id=11)])
    assert results.collect(11, read).step_id == 11  # steps 9 and 10, read on the way, dropped
    assert not results.early and not outputs
