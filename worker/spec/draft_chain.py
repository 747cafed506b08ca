"""The chain steps of a draft pass: index tensors built on the device from the exact pass's.

After the exact pass, chain drafting runs k - 1 more one-token steps per request at positions
last + 1 .. last + k - 1 (last: the request's last exact position, which in a replayed graph is
known only on the device). Their index fields are functions of last and of tensors the exact
pass already has (page and window tables, state slots), so they are computed inside the pass
(and inside its CUDA graph) with no upload of their own.
"""

from __future__ import annotations

import torch

from dsv4ray.cache.draft_pools import DraftPools
from dsv4ray.worker.batch import WINDOW, BatchMeta
from dsv4ray.worker.rope_tables import RopeTables


def chain_metas(exact: BatchMeta, rows: torch.Tensor, last: torch.Tensor, pools: DraftPools,
                num_steps: int, ropes: RopeTables, rope_len: int,
                static: bool = False) -> list[BatchMeta]:  # fmt: skip
    """Index tensors of chain steps 1 .. num_steps - 1, one token per chain, computed on the
    device: chain r continues the request of exact row rows[r] from its last exact position
    last[r]. Window keys up to last[r] come from the request's window pages, later ones (the
    chain's earlier steps) and the token's own KV from the scratch page of its state slot. Token
    ids stay 0: the draft block routes by score and its embedding input never leaves the device.
    A chain on a pad row (the scratch state slot) reads nothing and writes only the scratch ring;
    no chain step completes a compressed entry."""
    if num_steps < 2:
        return []
    sizes, device = pools.sizes, last.device
    req_rows = exact.req_rows.index_select(0, rows)  # [R]
    state = exact.state_slots.index_select(0, rows)
    real = state < sizes.num_state_slots
    steps = torch.arange(1, num_steps, device=device)[:, None]  # [S, 1]
    pos = torch.where(real, last + steps, 0)  # [S, R]
    q = pos[..., None] + torch.arange(-WINDOW + 1, 1, device=device)  # [S, R, W]
    table = exact.window_table
    col = (q.clamp(min=0) // WINDOW).clamp(max=table.shape[1] - 1)
    page = table[req_rows[None, :, None], col]
    resident = torch.where((q >= 0) & (page >= 0), page * WINDOW + q % WINDOW, -1)
    base = (sizes.num_window_pages + state) * WINDOW  # [R] first slot of the scratch page
    ahead = q > last[None, :, None]
    scratch = torch.where(real[None, :, None], base[None, :, None] + q % WINDOW, -1)
    windows = torch.where(ahead, scratch, resident)
    store = torch.where(real, base + pos % WINDOW, -1)  # [S, R]: the token's own slot
    bound = torch.where(real, (pos + 1) // 4, 0)
    none = torch.full_like(pos[0], -1)
    c128 = torch.full((len(rows), 1), -1, dtype=torch.int64, device=device)
    state_slots = torch.full_like(pos[0], pools.scratch_row)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return [
        BatchMeta(
            token_ids=torch.zeros_like(pos[s]),
            positions=pos[s],
            seq_start=pos[s],
            state_slots=state_slots,
            req_rows=req_rows,
            page_table=exact.page_table,
            window_store=store[s],
            c4_out=none,
            c128_out=none,
            c4_bound=bound[s],
            sample_idx=empty,
            sample_req_ids=[],
            ropes=ropes,
            rope_len=rope_len,
            static=static,
            window_slots=windows[s],
            c128_slots=c128,
        )  # fmt: skip
        for s in range(num_steps - 1)
    ]
