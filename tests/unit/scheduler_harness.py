"""A fake pipeline stage and a reference generator for scheduler tests (no tensors).

FakeStage applies plans as a stage would, with tokens standing in for KV: each token is written
to its full slot (page table) and its window slot (window map); the ring of a state slot records
the tokens it has absorbed, and snapshots copy rings. A sample is a hash of the whole context read
back through the page table, checked against the ring, with the window slots checked against the
full slots. A wrong, missing or prematurely reused id therefore changes an output or fails an
assertion, and outputs must equal a plain generation loop over the same hash (``reference``).
"""

from collections import deque

from dsv4ray.engine.handoff import STATE_TRANSFERRED
from dsv4ray.engine.plan import LOOKAHEAD_TOKEN, decode, encode
from dsv4ray.engine.scheduler import SchedulerConfig

VOCAB = 37


def next_token(context):
    value = 0
    for tok in context:
        value = (value * 31 + tok + 1) % 1_000_003
    return value % VOCAB


def reference(prompt, params, eos=None, max_model_len=10**9):
    context, out = list(prompt), []
    while True:
        tok = next_token(context)
        context.append(tok)
        out.append(tok)
        if tok in params.stop_token_ids or (tok == eos and not params.ignore_eos):
            return out, "stop"
        if len(out) >= params.max_tokens or len(context) >= max_model_len:
            return out, "length"


class FakeStage:
    def __init__(self, config):
        self.page, self.window = config.page_size, config.window_page_size
        self.full, self.win, self.rings, self.cached, self.reqs = {}, {}, {}, {}, {}
        self.host_pages, self.host_snaps = {}, {}  # the host tier: page contents, snapshots
        self.last_sampled = {}  # what the previous plan sampled: lookahead entries' tokens

    def _host_ops(self, plan):
        """Backups, then loads, as a stage runs them before the step (cache/hicache.py)."""
        if plan.host is None:
            return
        for dev, host in plan.host.backups:
            self.host_pages[host] = [self.full.get(dev * self.page + i) for i in range(self.page)]
        for window, slot, host in plan.host.snapshot_backups:
            base = window * self.window
            self.host_snaps[host] = (
                [self.win.get(base + i) for i in range(self.window)],
                self.cached[slot],
            )
        for host, dev in plan.host.loads:
            for i, tok in enumerate(self.host_pages[host]):
                self.full[dev * self.page + i] = tok
        for host, window, slot in plan.host.snapshot_loads:
            tokens, ring = self.host_snaps[host]
            for i, tok in enumerate(tokens):
                self.win[window * self.window + i] = tok
            self.cached[slot] = ring

    def run(self, plan):
        self._host_ops(plan)
        for req_id in plan.finished_ids + plan.preempted_ids:
            del self.reqs[req_id]
        for new in plan.new_requests:
            assert new.req_id not in self.reqs
            windows = {i: p for i, p in enumerate(new.window_page_ids) if p >= 0}
            self.reqs[new.req_id] = [list(new.page_ids), windows, new.num_computed_tokens, new]
            ring = self.cached[new.state_copy_from] if new.state_copy_from >= 0 else ()
            if new.state_copy_from == STATE_TRANSFERRED:  # a handoff wrote it (test_pd_scheduler)
                ring = self.rings[new.state_slot]
            assert len(ring) == new.num_computed_tokens
            self.rings[new.state_slot] = ring
        for diff in plan.diffs:
            pages, windows, *_ = self.reqs[diff.req_id]
            pages += diff.new_page_ids
            for idx in diff.freed_window_idxs:
                del windows[idx]
            for idx, page_id in diff.new_window_pages:
                assert idx not in windows
                windows[idx] = page_id
        sampled, offset = {}, 0
        for entry in plan.batch:
            tokens = plan.token_ids[offset : offset + entry.num_tokens]
            offset += entry.num_tokens
            if entry.req_id in plan.lookahead:  # the token its previous plan sampled
                assert tokens == [LOOKAHEAD_TOKEN]
                tokens = [self.last_sampled[entry.req_id]]
            context = self._run_entry(entry, tokens)
            if entry.sample:
                sampled[entry.req_id] = next_token(context)
        self.last_sampled = sampled
        for req_id, slot in plan.snapshots:
            state = self.reqs[req_id]
            assert state[2] % self.page == 0
            self.cached[slot] = self.rings[state[3].state_slot]
        return sampled

    def _run_entry(self, entry, tokens):
        state = self.reqs[entry.req_id]
        pages, windows, computed, new = state
        assert entry.start_pos == computed
        for k, tok in enumerate(tokens):
            pos = entry.start_pos + k
            self.full[pages[pos // self.page] * self.page + pos % self.page] = tok
            self.win[windows[pos // self.window] * self.window + pos % self.window] = tok
        state[2] = computed = computed + len(tokens)
        self.rings[new.state_slot] += tuple(tokens)
        context = [
            self.full[pages[p // self.page] * self.page + p % self.page] for p in range(computed)
        ]
        assert tuple(context) == self.rings[new.state_slot]
        for p in range(max(0, entry.start_pos - self.window + 1), computed):
            assert self.win[windows[p // self.window] * self.window + p % self.window] == context[p]
        return context


def check_plan(config, plan):
    assert plan.num_tokens <= config.max_num_batched_tokens
    assert len({e.req_id for e in plan.batch}) == len(plan.batch)
    if plan.preempted_ids:  # the pools are short: nobody is admitted in the same step
        assert not plan.new_requests
    for entry in plan.batch:
        if entry.num_tokens > 1:
            assert entry.start_pos % config.page_size == 0  # prefill chunks start page-aligned
        if not entry.sample:
            assert (entry.start_pos + entry.num_tokens) % config.page_size == 0
    assert decode(encode(plan)) == plan


def commit_and_check(sched, stage, plan, finished: dict, streamed: dict) -> None:
    """Commit a plan, collecting the tokens a caller would stream (each commit's accepted
    tokens): they must end each finished request's output, whatever was preempted or aborted in
    between (all of it when every commit went through here)."""
    outcome = sched.commit(plan, stage.run(plan))
    for req_id, token in outcome.tokens.items():
        streamed.setdefault(req_id, []).append(token)
    for done in outcome.finished:
        finished[done.req_id] = done
        tail = streamed.get(done.req_id, [])
        assert done.output_token_ids[len(done.output_token_ids) - len(tail) :] == tail


def drive(sched, stage=None, depth=1, max_steps=5000, streamed=None):
    """Run until every request finished; up to `depth` plans in flight."""
    stage = stage or FakeStage(sched.config)
    finished, in_flight = {}, deque()
    streamed = {} if streamed is None else streamed
    for _ in range(max_steps):
        if not sched.has_unfinished() and not in_flight:
            return finished
        while len(in_flight) < depth and (plan := sched.schedule()) is not None:
            check_plan(sched.config, plan)
            sched.check_integrity()
            in_flight.append(plan)
        assert in_flight, "the scheduler stalled with unfinished requests"
        commit_and_check(sched, stage, in_flight.popleft(), finished, streamed)
        sched.check_integrity()
    raise AssertionError("requests did not finish")


def small_config(**overrides):
    values = dict(
        num_pages=16,
        num_window_pages=12,
        num_state_slots=4,
        num_cached_state_slots=6,
        max_model_len=96,
        page_size=8,
        window_page_size=4,
        max_num_batched_tokens=16,
    )
    values.update(overrides)
    return SchedulerConfig(**values)
