"""Packed rows in uint8 buffers, and the window rings built from them.

Shared by every store that keeps real bytes: the contiguous cache and the paged engine's
pools. A row is `pack_rows(quantize(entry, fmt))`: codes then scales.
"""

import torch

from kvstack import native
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

    def pack(self, values: torch.Tensor,
             check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for values [..., width], and the values a read of them will give back
        (check: as `quantize`'s)."""
        if native.fuses(values) and native.decodes(self.fmt):
            return native.quantize(values, self.fmt, check=check)
        q = quantize(values, self.fmt, check)
        return pack_rows(q), dequantize(q)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize(unpack_rows(rows, self.fmt, self.width))

    def read_at(self, index: torch.Tensor) -> torch.Tensor:
        """The values of the rows at index (int64, rows counted over the buffer's leading
        dims as one): [*index.shape, width]."""
        if not torch.compiler.is_compiling():
            if _native_reads(self.data, self.fmt):
                return native.read_rows(self.data, index, self.fmt, self.width)
        elif index.numel() >= OPAQUE_READ_ROWS:
            return _read_rows_op(self.data, index, self.fmt, self.width)
        return self.read(_rows_at(self.data, index))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _rows_at(data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of a buffer [..., bytes] at index, counted over its leading dims as one:
    [*index.shape, bytes] (one 1-D index_select, the fastest gather on a CPU)."""
    n_bytes = data.shape[-1]
    rows = data.view(-1, n_bytes).index_select(0, index.reshape(-1))
    return rows.view(*index.shape, n_bytes)


# A read of this many rows or more is one opaque op to a traced step: Inductor's own code
# for the gather and the codecs' table lookups runs element by element on a CPU, slower
# per row than torch's index_select (a batch-32 step of the decode benchmark's model at 2K,
# whose reads are 2,048 to 16,384 rows, took 58.7 ms with them opaque against 65.4 ms in
# the graph, one thread), but an opaque op costs ~0.1 ms a call to dispatch (a batch-1
# step at 4K, reads of 64 to 512 rows, took 12.9 ms with them all opaque against 8.6).
# (Eager calls it directly: a custom op's first call loads torch's compiler.)
OPAQUE_READ_ROWS = 1024


def _native_reads(data: torch.Tensor, fmt: str) -> bool:
    """Whether the C kernels read these rows: the same values, in one pass."""
    return native.enabled() and data.device.type == "cpu" and native.decodes(fmt)


@torch.library.custom_op("kvstack::read_rows", mutates_args=())
def _read_rows_op(data: torch.Tensor, index: torch.Tensor, fmt: str,
                  width: int) -> torch.Tensor:
    if _native_reads(data, fmt):
        return native.read_rows(data, index, fmt, width)
    return dequantize(unpack_rows(_rows_at(data, index), fmt, width))


@_read_rows_op.register_fake
def _(data: torch.Tensor, index: torch.Tensor, fmt: str, width: int) -> torch.Tensor:
    return data.new_empty(*index.shape, width, dtype=torch.float32)


class WindowRings:
    """The window rings of `n_slots` sequences, per layer: the last window_size window
    entries of each slot in a circular buffer of rows [n_slots, window, bytes] (row =
    position % window_size), and the position each row holds [n_slots, window] (-1:
    empty). A slot is one running sequence (or, in a contiguous cache, one batch row)."""

    def __init__(self, layout: CacheLayout, window: int, n_slots: int,
                 device: torch.device) -> None:
        self.window = window
        self.rows = {r.layer: PackedRows(r.fmt, r.width, (n_slots, window), device)
                     for r in layout.window_rings}
        self.pos = {layer: torch.full((n_slots, window), -1, dtype=torch.long, device=device)
                    for layer in self.rows}
        # A slot no sequence holds, where a padded decode batch's pad rows write (None:
        # none; set by the cache that hands the slots out).
        self.pad_slot: int | None = None
        # Set where the rings have mirrors on other ranks: the slots emptied from outside a
        # model call, for the mirrors to repeat.
        self.journal: list[slice] | None = None

    # ---- slots at one shared position (a sequence alone, or a contiguous batch) --------
    def read(self, layer: int, slots: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [S, m, D] of slots that hold the same positions, oldest first, and those
        positions [m] (empty rows left out)."""
        pos = self.pos[layer][slots.start or 0]
        rows = torch.nonzero(pos >= 0).flatten()
        rows = rows[torch.argsort(pos[rows])]
        ring = self.rows[layer]
        held = torch.arange(ring.data.shape[0], device=rows.device)[slots]  # [S]
        return ring.read_at(held[:, None] * self.window + rows), pos[rows]

    def write(self, layer: int, slots: slice, entries: torch.Tensor, start: int) -> torch.Tensor:
        """Write entries [S, n, D] at positions start..start+n-1; the stored values."""
        w = self.window
        positions = torch.arange(start, start + entries.shape[1], device=entries.device)[-w:]
        rows, stored = self.rows[layer].pack(entries)
        # A chunk longer than the ring still hands back all its entries: its own queries
        # attend to the ones the ring will not keep.
        self.rows[layer].data[slots, positions % w] = rows[:, -w:]
        self.pos[layer][slots, positions % w] = positions
        return stored

    def drop(self, slots: slice) -> None:
        for pos in self.pos.values():
            pos[slots] = -1
        if self.journal is not None:
            self.journal.append(slots)

    # ---- one token per slot at per-slot positions (a decode batch) ---------------------
    def read_at(self, layer: int, slots: torch.Tensor,
                oldest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rings of slots [B], each read from the row that position oldest [B] maps
        to: entries [B, window, D] and their positions [B, window], rows never written at
        ABSENT. Before positions p are written, oldest = p reads the rings oldest first;
        after, oldest = p + 1 does, ending with p."""
        order = (oldest[:, None] + torch.arange(self.window, device=slots.device)) % self.window
        pos = self.pos[layer][slots[:, None], order]
        rows = self.rows[layer].read_at(slots[:, None] * self.window + order)  # [B, window, D]
        return rows, torch.where(pos >= 0, pos, ABSENT)

    def write_at(self, layer: int, slots: torch.Tensor, entries: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Write entries [B, 1, D] of slots [B] at positions [B]; the stored values (not
        looked at: the decode step's logits are checked instead)."""
        ring = self.rows[layer]
        if native.fuses(entries) and native.decodes(ring.fmt):  # one C call, in place
            return native.ring_write(entries[:, 0], ring.fmt, ring.data, self.pos[layer],
                                     slots, positions)[:, None]
        rows, stored = self.rows[layer].pack(entries[:, 0], check=False)
        self.rows[layer].data[slots, positions % self.window] = rows
        self.pos[layer][slots, positions % self.window] = positions
        return stored[:, None]

    def _runs(self, first: int, n: int) -> list[tuple[int, int]]:
        """The ring rows of n consecutive positions from row `first` on, as [lo, hi) runs
        (two where they wrap): slices, where a list of rows would be an indexing op."""
        end = first + n
        if end <= self.window:
            return [(first, end)]
        return [(first, self.window), (0, end - self.window)]

    def copy_rows(self, slot: int, first: int, n: int
                  ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of n rows of one slot's rings from row `first` on (wrapping): layer ->
        (bytes [n, row bytes], positions [n])."""
        runs = self._runs(first, n)
        saved = {}
        for layer, ring in self.rows.items():
            data, pos = ring.data[slot], self.pos[layer][slot]
            if len(runs) == 1:
                (lo, hi), = runs
                saved[layer] = (data[lo:hi].clone(), pos[lo:hi].clone())
            else:
                saved[layer] = (torch.cat([data[lo:hi] for lo, hi in runs]),
                                torch.cat([pos[lo:hi] for lo, hi in runs]))
        return saved

    def load_rows(self, slot: int, first: int, n: int,
                  saved: dict[int, tuple[torch.Tensor, torch.Tensor]], keep: int) -> None:
        """Put back the rows that `copy_rows(slot, first, n)` took, but for the first
        `keep` of them."""
        runs = self._runs((first + keep) % self.window, n - keep)
        for layer, (data, pos) in saved.items():
            ring, ring_pos, at = self.rows[layer].data[slot], self.pos[layer][slot], keep
            for lo, hi in runs:
                ring[lo:hi] = data[at : at + hi - lo]
                ring_pos[lo:hi] = pos[at : at + hi - lo]
                at += hi - lo

    def copy_slot(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one slot's rings: layer -> (rows [window, bytes], positions [window])."""
        return {layer: (ring.data[slot].clone(), self.pos[layer][slot].clone())
                for layer, ring in self.rows.items()}

    def load_slot(self, slot: int, saved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make one slot's rings those `copy_slot` took."""
        for layer, (rows, pos) in saved.items():
            self.rows[layer].data[slot] = rows
            self.pos[layer][slot] = pos

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())


ABSENT = -(1 << 40)  # the position of a ring row never written: outside every window


class PartialGroups:
    """Per slot and ratio > 1 source, the projected values and gate logits of the tokens
    after its stream's last complete group: float32 [n_slots, ratio - 1, D] each (rows
    below the slot's fill are meaningful; the fill is the sequence's to track)."""

    def __init__(self, layout: CacheLayout, n_slots: int, device: torch.device) -> None:
        self.values = {g.layer: torch.zeros(n_slots, g.ratio - 1, g.width, device=device)
                       for g in layout.partial_groups}
        self.gates = {source: torch.zeros_like(v) for source, v in self.values.items()}

    def copy_slot(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one slot's groups: source -> (values, gate logits) [ratio - 1, D]."""
        return {source: (v[slot].clone(), self.gates[source][slot].clone())
                for source, v in self.values.items()}

    def load_slot(self, slot: int, saved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for source, (values, gates) in saved.items():
            self.values[source][slot] = values
            self.gates[source][slot] = gates

    @property
    def nbytes(self) -> int:
        return sum(2 * v.numel() * v.element_size() for v in self.values.values())
