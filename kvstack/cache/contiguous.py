"""A contiguous cache that stores the real bytes: one preallocated buffer per stream.

Every stream of `CacheLayout` is a uint8 buffer [B, capacity, bytes_per_entry] of packed
rows (codes then scales, `kvstack.formats`); every window ring a circular uint8 buffer
[B, window_size, bytes_per_entry] in the window format. It serves the dense control too
(its per-layer "k" and "v" streams, no rings). No float copy of past tokens is
kept, except the partial groups (float32 by design: DESIGN.md section 4). The paged
engine implements the same interface over blocks.
"""

import torch

from kvstack.cache.layout import CacheLayout
from kvstack.cache.store import KVStore, TokenLog
from kvstack.config import ModelConfig
from kvstack.formats import bytes_per_entry, dequantize, pack_rows, quantize, unpack_rows


class PackedRows:
    """Packed rows of one format and width, quantised on write, dequantised on read."""

    def __init__(self, fmt: str, width: int, shape: tuple[int, int], device: torch.device):
        self.fmt, self.width = fmt, width
        entry = bytes_per_entry(fmt, width)
        # [B, slots, bytes_per_entry]
        self.data = torch.zeros(*shape, entry, dtype=torch.uint8, device=device)

    def write(self, slots: torch.Tensor | slice, values: torch.Tensor) -> torch.Tensor:
        q = quantize(values, self.fmt)
        self.data[:, slots] = pack_rows(q)
        return dequantize(q)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize(unpack_rows(rows, self.fmt, self.width))


class ContiguousCache(KVStore):
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int = 1,
        max_tokens: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(config, batch_size, device)
        self.max_tokens = config.max_seq_len if max_tokens is None else max_tokens
        self.layout = CacheLayout.from_config(config)
        b, dev = batch_size, self.device
        self._tokens = TokenLog(b, self.max_tokens, dev)
        self._streams: dict[int, dict[str, PackedRows]] = {}  # layer -> kind -> rows
        self._len: dict[int, int] = {}
        for s in self.layout.streams:
            rows = PackedRows(s.fmt, s.width, (b, s.entries(self.max_tokens)), dev)
            self._streams.setdefault(s.layer, {})[s.kind] = rows
            self._len[s.layer] = 0
        w = config.window_size
        self._rings = {
            r.layer: PackedRows(r.fmt, r.width, (b, w), dev) for r in self.layout.window_rings
        }
        # Position held by each ring slot (slot = position % window_size); -1 = empty.
        self._ring_pos = {
            r.layer: torch.full((w,), -1, dtype=torch.long, device=dev)
            for r in self.layout.window_rings
        }

    # ---- tokens ----------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._tokens.count

    def token_ids(self) -> torch.Tensor:
        return self._tokens.ids[:, : self._tokens.count]

    def append_tokens(self, ids: torch.Tensor) -> None:
        self._tokens.append(ids)

    # ---- window rings ------------------------------------------------------------------
    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self._ring_pos[layer]
        slots = torch.nonzero(pos >= 0).flatten()
        slots = slots[torch.argsort(pos[slots])]
        ring = self._rings[layer]
        return ring.read(ring.data[:, slots]), pos[slots]

    def write_window(self, layer: int, entries: torch.Tensor, start: int) -> torch.Tensor:
        w = self.config.window_size
        positions = torch.arange(start, start + entries.shape[1], device=self.device)[-w:]
        q = quantize(entries, self.config.window_format)
        # A chunk longer than the ring still hands back all its entries: its own queries
        # attend to the ones the ring will not keep.
        self._rings[layer].data[:, positions % w] = pack_rows(q)[:, -w:]
        self._ring_pos[layer][positions % w] = positions
        return dequantize(q)

    # ---- streams -----------------------------------------------------------------------
    def stream_len(self, layer: int) -> int:
        return self._len[layer]

    def append_stream(
        self, layer: int, entries: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        start = self._len[layer]
        n = next(iter(entries.values())).shape[1]
        streams = self._streams[layer]
        capacity = next(iter(streams.values())).data.shape[1]
        if start + n > capacity:
            raise ValueError(f"cache full: the streams of layer {layer} hold {capacity} entries")
        stored = {kind: streams[kind].write(slice(start, start + n), x)
                  for kind, x in entries.items()}
        self._len[layer] = start + n
        return stored

    def read_stream(self, layer: int, kind: str, stop: int) -> torch.Tensor:
        rows = self._streams[layer][kind]
        return rows.read(rows.data[:, :stop])

    def gather_stream(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        rows = self._streams[layer][kind]
        batch = torch.arange(entries.shape[0], device=self.device).view(-1, 1, 1)
        # Only the selected rows are dequantised.
        return rows.read(rows.data[batch, entries])  # [B, q, k, width]

    # ---- partial groups ----------------------------------------------------------------
    def set_partial(self, source: int, values: torch.Tensor, gate_logits: torch.Tensor) -> None:
        super().set_partial(source, values.detach().float(), gate_logits.detach().float())

    def drop_window_state(self) -> None:
        for pos in self._ring_pos.values():
            pos.fill_(-1)
        self._partial.clear()

    # ---- accounting --------------------------------------------------------------------
    def stream_bytes_allocated(self) -> int:
        """Bytes of the stream buffers actually allocated."""
        return sum(r.data.numel() for streams in self._streams.values() for r in streams.values())
