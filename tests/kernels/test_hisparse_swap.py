"""HiSparse swap-in: the Triton kernel equals its torch reference byte for byte (outputs and slot
state) over several steps, and both equal a plain-Python LRU written from the docstring."""

import pytest
import torch

from dsv4ray.kernels.hisparse_swap import C4_PER_PAGE, hisparse_swap_in, hisparse_swap_in_ref


def _state(num_slots: int, num_rows: int, device):
    return {
        "row_pos": torch.full((num_slots, num_rows), -1, dtype=torch.int64, device=device),
        "row_age": torch.full((num_slots, num_rows - 1), -1, dtype=torch.int64, device=device),
        "clock": torch.zeros(num_slots, dtype=torch.int64, device=device),
        "counters": torch.zeros(2, dtype=torch.int64, device=device),
    }


def _call(fn, step, page_table, state):
    return fn(step["topk"], step["slots"], step["new_pos"], page_table, step["req_rows"],
              state["row_pos"], state["row_age"], state["clock"], state["counters"])  # fmt: skip


class _PythonLRU:
    """The docstring's rules on lists: rows [pos, age] per slot, the reserved row apart."""

    def __init__(self, num_slots: int, num_rows: int):
        self.rows = [[[-1, -1] for _ in range(num_rows - 1)] for _ in range(num_slots)]
        self.reserved = [-1] * num_slots
        self.clock = [0] * num_slots
        self.num_rows = num_rows

    def token(self, slot, topk, new_pos, page_ids):
        """-> (phys list, [(host slot, phys)] misses) for one active token."""
        rows, r = self.rows[slot], self.num_rows
        if new_pos >= 0:
            self.reserved[slot] = new_pos
        now = self.clock[slot] + 1
        held = {pos: i for i, (pos, _) in enumerate(rows) if pos >= 0}
        phys, misses, used = [], [], set()
        for p in topk:
            if p >= 0 and p != self.reserved[slot] and p in held:
                used.add(held[p])
        free = sorted((i for i in range(r - 1) if i not in used), key=lambda i: (rows[i][1], i))
        for p in topk:
            if p < 0:
                phys.append(-1)
            elif p == self.reserved[slot]:
                phys.append(slot * r + r - 1)
            elif p in held:
                phys.append(slot * r + held[p])
            else:
                row = free.pop(0)
                misses.append((page_ids[p // C4_PER_PAGE] * C4_PER_PAGE + p % C4_PER_PAGE,
                               slot * r + row))  # fmt: skip
                rows[row][0] = p
                used.add(row)
                phys.append(slot * r + row)
        for i in used:
            rows[i][1] = now
        self.clock[slot] = now
        return phys, misses


def _steps(num_steps, num_tokens, num_k, slots, page_table, gen, device):
    """Random steps: per token a few distinct positions (some repeating earlier ones so that
    hits happen), ragged -1 tails, an inactive token, and entries the compressor wrote."""
    bound = page_table.shape[1] * C4_PER_PAGE
    steps = []
    for step_idx in range(num_steps):
        topk = torch.full((num_tokens, num_k), -1, dtype=torch.int64)
        for t in range(num_tokens):
            n = int(torch.randint(0, num_k + 1, (1,), generator=gen)) if t else num_k
            pool = min(bound, 3 * num_k)  # a small range: later steps hit earlier positions
            topk[t, :n] = torch.randperm(pool, generator=gen)[:n]
        active = torch.tensor(slots, dtype=torch.int64)
        if num_tokens > 2:
            active[1] = -1  # this token uses no hot rows (a prefill token in a mixed step)
        new_pos = torch.where(
            torch.rand(num_tokens, generator=gen) < 0.5,
            torch.randint(0, bound, (num_tokens,), generator=gen),
            -1,
        )
        if step_idx == 1 and num_tokens:
            new_pos[0] = topk[0, 0]  # a position written this step is read from the reserved row
        steps.append({"topk": topk.to(device), "slots": active.to(device),
                      "new_pos": new_pos.to(device),
                      "req_rows": torch.arange(num_tokens, device=device)})  # fmt: skip
    return steps


@pytest.mark.parametrize(
    "num_tokens,num_k,num_rows",
    [(0, 4, 8), (1, 1, 2), (3, 4, 8), (3, 5, 6), (2, 8, 16), (4, 3, 11)],
    ids=["empty", "k1-min-rows", "regular", "unaligned-exact", "k8", "ragged-odd-rows"],
)
def test_kernel_equals_reference_and_the_python_lru(num_tokens, num_k, num_rows, device):
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_k * 10 + num_rows)
    num_slots = num_tokens + 2
    slots = [num_slots - 1 - t for t in range(num_tokens)]  # slot 0 is a row like any other
    page_table = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(num_tokens)]
                             or [torch.zeros(2, dtype=torch.int64)]).to(device)  # fmt: skip
    kernel_state, ref_state = (
        _state(num_slots, num_rows, device),
        _state(num_slots, num_rows, device),
    )
    lru = _PythonLRU(num_slots, num_rows)
    hits = misses = 0
    for step in _steps(4, num_tokens, num_k, slots, page_table, gen, device):
        got = _call(hisparse_swap_in, step, page_table, kernel_state)
        want = _call(hisparse_swap_in_ref, step, page_table, ref_state)
        for name, a, b in zip(("phys", "miss_src", "miss_dst"), got, want, strict=True):
            assert torch.equal(a.cpu(), b.cpu()), name
        for name in kernel_state:
            assert torch.equal(kernel_state[name].cpu(), ref_state[name].cpu()), name
        phys, src, dst = (x.cpu() for x in want)
        for t in range(num_tokens):
            slot = int(step["slots"][t])
            if slot < 0:
                assert (phys[t] == -1).all() and (src.view(num_tokens, -1)[t] == -1).all()
                continue
            pages = page_table[t].tolist()
            exp_phys, exp_misses = lru.token(slot, step["topk"][t].tolist(),
                                             int(step["new_pos"][t]), pages)  # fmt: skip
            assert phys[t].tolist() == exp_phys
            pairs = [
                (s, d)
                for s, d in zip(
                    src.view(num_tokens, -1)[t].tolist(), dst.view(num_tokens, -1)[t].tolist()
                )
                if s >= 0
            ]
            assert pairs == exp_misses
            misses += len(exp_misses)
            hits += sum(p >= 0 for p in exp_phys) - len(exp_misses)
    assert ref_state["counters"].tolist() == [hits, misses]
    if num_tokens > 1:
        assert hits > 0 and misses > 0  # the grid exercises both


def test_lengths_that_differ_raise_and_too_few_rows_raise(device):
    st = _state(2, 5, device)
    topk = torch.zeros(3, 4, dtype=torch.int64, device=device)
    short = torch.zeros(2, dtype=torch.int64, device=device)
    ok = torch.zeros(3, dtype=torch.int64, device=device)
    table = torch.zeros(3, 1, dtype=torch.int64, device=device)
    for fn in (hisparse_swap_in, hisparse_swap_in_ref):
        for args, name in (((short, ok, ok), "req_slots"), ((ok, short, ok), "new_pos"),
                           ((ok, ok, short), "req_rows")):  # fmt: skip
            slots, new_pos, rows = args
            with pytest.raises(ValueError, match=name):
                fn(topk, slots, new_pos, table, rows, st["row_pos"], st["row_age"], st["clock"],
                   st["counters"])  # fmt: skip
        small = _state(2, 4, device)  # 3 LRU rows < top-k 4
        with pytest.raises(ValueError, match="LRU rows"):
            fn(topk, ok, ok, table, ok, small["row_pos"], small["row_age"], small["clock"],
               small["counters"])  # fmt: skip
