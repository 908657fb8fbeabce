"""A contiguous cache that stores the real bytes: one preallocated buffer per stream.

Every stream of `CacheLayout` is a uint8 buffer [B, capacity, bytes_per_entry] of packed
rows (codes then scales, `kvstack.formats`); every window ring a circular uint8 buffer
[B, window_size, bytes_per_entry] in the window format. It serves the dense control too
(its per-layer "k" and "v" streams, no rings). No float copy of past tokens is
kept, except the partial groups (float32 by design: design.md section 4). The paged
engine implements the same interface over blocks.
"""

import torch

from kvstack.cache.layout import CacheLayout
from kvstack.cache.rows import PackedRows, WindowRings
from kvstack.cache.store import KVStore, TokenLog
from kvstack.config import ModelConfig


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
        self._rings = WindowRings(self.layout, config.window_size, b, dev)

    # ---- tokens ----------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._tokens.count

    def token_ids(self) -> torch.Tensor:
        return self._tokens.ids[:, : self._tokens.count]

    def append_tokens(self, ids: torch.Tensor | list[list[int]]) -> None:
        self._tokens.append(ids)

    # ---- window rings ------------------------------------------------------------------
    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rings.read(layer, slice(None))

    def write_window(self, layer: int, entries: torch.Tensor, start: int) -> torch.Tensor:
        return self._rings.write(layer, slice(None), entries, start)

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
        stored = {}
        for kind, x in entries.items():
            rows, stored[kind] = streams[kind].pack(x)
            streams[kind].data[:, start : start + n] = rows
        self._len[layer] = start + n
        return stored

    def read_stream(self, layer: int, kind: str, start: int, stop: int) -> torch.Tensor:
        rows = self._streams[layer][kind]
        return rows.read(rows.data[:, start:stop])

    def gather_stream(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        rows = self._streams[layer][kind]
        batch = torch.arange(entries.shape[0], device=self.device).view(-1, 1, 1)
        # Only the selected rows are dequantised.
        return rows.read(rows.data[batch, entries])  # [B, q, k, width]

    # ---- partial groups ----------------------------------------------------------------
    def set_partial(self, source: int, values: torch.Tensor, gate_logits: torch.Tensor) -> None:
        super().set_partial(source, values.detach().float(), gate_logits.detach().float())

    def drop_window_state(self) -> None:
        self._rings.drop(slice(None))
        self._partial.clear()

    # ---- accounting --------------------------------------------------------------------
    def stream_bytes_allocated(self) -> int:
        """Bytes of the stream buffers actually allocated."""
        return sum(r.nbytes for streams in self._streams.values() for r in streams.values())
