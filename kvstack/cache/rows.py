"""Packed rows in uint8 buffers, and the window rings built from them.

Shared by every store that keeps real bytes: the contiguous cache and the paged engine's
pools. A row is `pack_rows(quantize(entry, fmt))`: codes then scales.
"""

import torch

from kvstack.cache.layout import CacheLayout
from kvstack.formats import bytes_per_entry, dequantize, pack_rows, quantize, unpack_rows


class PackedRows:
    """A uint8 buffer [*shape, bytes_per_entry] of rows of one format and width."""

    def __init__(self, fmt: str, width: int, shape: tuple[int, ...], device: torch.device,
                 zeroed: bool = True) -> None:
        """zeroed=False leaves the buffer as allocated: for a pool whose rows are read only
        once written, on a CPU that hands large buffers out as untouched pages, so that
        memory is committed as blocks fill up, not all at start."""
        self.fmt, self.width = fmt, width
        make = torch.zeros if zeroed else torch.empty
        self.data = make(*shape, bytes_per_entry(fmt, width), dtype=torch.uint8, device=device)

    def pack(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for values [..., width], and the values a read of them will give back."""
        q = quantize(values, self.fmt)
        return pack_rows(q), dequantize(q)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize(unpack_rows(rows, self.fmt, self.width))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class WindowRings:
    """Per sequence and layer, the last window_size window entries: a circular buffer of
    rows (slot = position % window_size) and the position each slot holds (-1: empty)."""

    def __init__(self, layout: CacheLayout, window: int, batch_size: int,
                 device: torch.device) -> None:
        self.window = window
        self.rows = {r.layer: PackedRows(r.fmt, r.width, (batch_size, window), device)
                     for r in layout.window_rings}
        self.pos = {layer: torch.full((window,), -1, dtype=torch.long, device=device)
                    for layer in self.rows}

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.pos[layer]
        slots = torch.nonzero(pos >= 0).flatten()
        slots = slots[torch.argsort(pos[slots])]
        ring = self.rows[layer]
        return ring.read(ring.data[:, slots]), pos[slots]

    def write(self, layer: int, entries: torch.Tensor, start: int) -> torch.Tensor:
        w = self.window
        positions = torch.arange(start, start + entries.shape[1], device=entries.device)[-w:]
        rows, stored = self.rows[layer].pack(entries)
        # A chunk longer than the ring still hands back all its entries: its own queries
        # attend to the ones the ring will not keep.
        self.rows[layer].data[:, positions % w] = rows[:, -w:]
        self.pos[layer][positions % w] = positions
        return stored

    def drop(self) -> None:
        for pos in self.pos.values():
            pos.fill_(-1)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())
