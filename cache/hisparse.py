"""HiSparse store of one stage: every request's C4 history in host memory, a few hot rows on the
device (the tensors and their index spaces; the per-step copies live in worker/host/hisparse_io.py).

Index spaces, per C4 layer of the stage (buffer i = compress_layer_id):

    logical full slot   position f of a request; page table page_ids[f // 256]
      -> logical C4 slot  c = page_ids[f // 256] * 64 + (f % 256) // 4   (C4 position f // 4)
                          = the slot in history[i] [num_pages, c4 page bytes], host memory
                          (page-locked with CUDA); page id p names the same page as in the
                          device pools, and slot 0 is an ordinary slot
      -> physical hot row  h = state_slot * hot_rows + r  in hot[i] [hot pages, c4 page bytes],
                          device; rows 0 .. hot_rows - 2 of a request are LRU, row hot_rows - 1
                          is reserved for the entry its compressor wrote last

Window pages, C128 pages and the indexer keys stay in the device pools (the indexer scores every
entry). Per hot row (device, int64): row_pos[i] [S, hot_rows] the C4 position it holds (-1:
empty), row_age[i] [S, hot_rows - 1] the slot's clock at its last use (-1: never), clock[i] [S];
counters [layers, 2] hits and misses (kernels/hisparse_swap.py keeps them).
"""

from __future__ import annotations

import torch

from dsv4ray.cache.formats import ENTRIES_PER_PAGE
from dsv4ray.cache.page_layout import layout_for

C4_PER_PAGE = ENTRIES_PER_PAGE["c4"]


class HiSparseStore:
    """C4 history (host) and hot rows (device) of one stage's C4 layers."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        hot_rows: int,
        num_pages: int,
        dtype: str,
        device: torch.device | str = "cpu",
    ) -> None:
        if hot_rows < 2:
            raise ValueError(f"hisparse_hot_rows must be >= 2 (LRU rows + a reserved row), got "
                             f"{hot_rows}")  # fmt: skip
        self.device = torch.device(device)
        self.layout = layout_for("c4", dtype)
        self.num_slots, self.hot_rows, self.num_pages = num_slots, hot_rows, num_pages
        pin = self.device.type == "cuda"  # pin_memory raises without CUDA
        page_bytes = self.layout.page_bytes
        self.history = [
            torch.zeros(num_pages, page_bytes, dtype=torch.uint8, pin_memory=pin)
            for _ in range(num_layers)
        ]
        hot_pages = -(-num_slots * hot_rows // C4_PER_PAGE)
        self.hot = [
            torch.zeros(hot_pages, page_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(num_layers)
        ]
        self.row_pos = [self._ints((num_slots, hot_rows), -1) for _ in range(num_layers)]
        self.row_age = [self._ints((num_slots, hot_rows - 1), -1) for _ in range(num_layers)]
        self.clock = [self._ints((num_slots,), 0) for _ in range(num_layers)]
        self.counters = self._ints((num_layers, 2), 0)

    def _ints(self, shape, value: int) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.int64, device=self.device)

    @property
    def num_layers(self) -> int:
        return len(self.hot)

    # ------------------------------------------------------------------ index spaces
    def hot_slot(self, state_slot: int, row: int) -> int:
        """Physical hot row of (request slot, row) -> its slot in hot[i]."""
        if not 0 <= state_slot < self.num_slots or not 0 <= row < self.hot_rows:
            raise ValueError(f"hot row ({state_slot}, {row}) outside [{self.num_slots}] x "
                             f"[{self.hot_rows}]")  # fmt: skip
        return state_slot * self.hot_rows + row

    def reserved_slot(self, state_slot: int) -> int:
        """The hot row a request's compressor writes its newest entry to."""
        return self.hot_slot(state_slot, self.hot_rows - 1)

    def reserved_rows(self, state_slots):
        """reserved_slot of each request slot (ints or an int64 tensor; unchecked)."""
        return state_slots * self.hot_rows + self.hot_rows - 1

    @staticmethod
    def host_slot(page_ids: list[int], c4_pos: int) -> int:
        """Logical C4 position of a request -> its slot in the host history (the logical C4
        slot: host and device pools share page ids, so no translation is involved)."""
        return page_ids[c4_pos // C4_PER_PAGE] * C4_PER_PAGE + c4_pos % C4_PER_PAGE

    # ------------------------------------------------------------------ lifecycle
    def reset_slots(self, slots: list[int]) -> None:
        """A request starts in these slots: its hot rows hold nothing (its history, under its
        page ids, is untouched: a cached prefix's entries stay readable)."""
        if not slots:
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for row_pos, row_age, clock in zip(self.row_pos, self.row_age, self.clock, strict=True):
            row_pos[idx] = -1
            row_age[idx] = -1
            clock[idx] = 0

    # ------------------------------------------------------------------ accounting
    def device_bytes(self) -> int:
        tensors = self.hot + self.row_pos + self.row_age + self.clock + [self.counters]
        return sum(t.numel() * t.element_size() for t in tensors)

    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.history)

    def c4_bytes_per_request(self) -> float:
        """Device C4 bytes one running request holds: its hot rows in every C4 layer."""
        return self.hot_rows * self.layout.bytes_per_entry * self.num_layers

    def stats(self) -> dict:
        hits, misses = (int(x) for x in self.counters.sum(0).tolist())
        return {
            "hisparse_hits": hits,
            "hisparse_misses": misses,
            "hisparse_host_bytes": self.host_bytes(),
            "hisparse_device_bytes": self.device_bytes(),
            "hisparse_device_c4_bytes_per_request": self.c4_bytes_per_request(),
            # what the same layers keep per token of context with every C4 entry on the device
            "hisparse_all_on_device_c4_bytes_per_token": self.layout.bytes_per_entry
            * self.num_layers
            / 4,
        }

    def check_integrity(self) -> None:
        """RuntimeError unless every request's LRU rows hold distinct positions, a row holds a
        position exactly when it was used (age >= 0), and no age runs ahead of its clock."""
        for i in range(self.num_layers):
            pos = self.row_pos[i][:, :-1].cpu()
            age, clock = self.row_age[i].cpu(), self.clock[i].cpu()
            if not torch.equal(pos >= 0, age >= 0):
                raise RuntimeError(f"hisparse layer {i}: a hot row's position and age disagree")
            if (age > clock[:, None]).any():
                raise RuntimeError(f"hisparse layer {i}: a hot row was used after its clock")
            for slot in range(self.num_slots):
                held = pos[slot][pos[slot] >= 0]
                if held.unique().numel() != held.numel():
                    raise RuntimeError(
                        f"hisparse layer {i}: slot {slot} holds a C4 position in two rows"
                    )
