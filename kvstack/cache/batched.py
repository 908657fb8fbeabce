"""Several one-sequence stores seen as one batch, for a decode step of sequences at
different positions (continuous batching).

Each sequence keeps its own store (blocks, rings, partial groups); reads come back padded
to the longest one, and the model masks the padding by position: an entry j is visible to
a query at t only if j < (t+1)//r, which never reaches past a sequence's own stream, and
padded ring slots carry a position far below any window.
"""

import torch

from kvstack.cache.store import KVStore

ABSENT = -(1 << 40)  # the position of a padded ring slot: outside every window


class BatchedStore(KVStore):
    def __init__(self, parts: list[KVStore]) -> None:
        if not parts or any(p.batch_size != 1 for p in parts):
            raise ValueError("a batched store joins one-sequence stores")
        super().__init__(parts[0].config, len(parts), parts[0].device)
        self.parts = parts

    @property
    def num_tokens(self) -> int:
        return max(p.num_tokens for p in self.parts)

    def start_positions(self) -> torch.Tensor:
        return torch.tensor([p.num_tokens for p in self.parts], device=self.device)

    def sequences(self) -> list[tuple[slice, KVStore]]:
        return [(slice(b, b + 1), p) for b, p in enumerate(self.parts)]

    def token_ids(self) -> torch.Tensor:
        raise ValueError("sequences of a batched store have different lengths: read each part")

    def append_tokens(self, ids: torch.Tensor) -> None:
        for b, p in enumerate(self.parts):
            p.append_tokens(ids[b : b + 1])

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        rings = [p.window(layer) for p in self.parts]
        m = max(pos.shape[-1] for _, pos in rings)
        entries = torch.zeros(self.batch_size, m, self.config.head_dim, device=self.device)
        positions = torch.full((self.batch_size, m), ABSENT, dtype=torch.long,
                               device=self.device)
        for b, (values, pos) in enumerate(rings):
            entries[b, : pos.shape[-1]] = values[0]
            positions[b, : pos.shape[-1]] = pos
        return entries, positions

    def write_window(self, layer: int, entries: torch.Tensor,
                     start: int | torch.Tensor) -> torch.Tensor:
        starts = start.tolist() if isinstance(start, torch.Tensor) else [start] * len(self.parts)
        return torch.cat([p.write_window(layer, entries[b : b + 1], starts[b])
                          for b, p in enumerate(self.parts)])

    def stream_len(self, layer: int) -> int:
        return max(p.stream_len(layer) for p in self.parts)

    def append_stream(
        self, layer: int, entries: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        stored = [p.append_stream(layer, {k: v[b : b + 1] for k, v in entries.items()})
                  for b, p in enumerate(self.parts)]
        return {kind: torch.cat([s[kind] for s in stored]) for kind in entries}

    def read_stream(self, layer: int, kind: str, start: int, stop: int) -> torch.Tensor:
        chunks = []
        for p in self.parts:
            own = min(stop, p.stream_len(layer))
            rows = p.read_stream(layer, kind, start, own) if own > start else None
            width = rows.shape[-1] if rows is not None else self._width(layer, kind)
            padded = torch.zeros(1, stop - start, width, device=self.device)
            if rows is not None:
                padded[:, : rows.shape[1]] = rows
            chunks.append(padded)
        return torch.cat(chunks)

    def gather_stream(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        """Rows past a sequence's own stream (selected by another sequence of the batch)
        read as its last row: the model never weighs them for this sequence."""
        out = []
        for b, p in enumerate(self.parts):
            n = p.stream_len(layer)
            if n == 0:
                out.append(torch.zeros(1, *entries.shape[1:], self._width(layer, kind),
                                       device=self.device))
            else:
                out.append(p.gather_stream(layer, kind, entries[b : b + 1].clamp(max=n - 1)))
        return torch.cat(out)

    def _width(self, layer: int, kind: str) -> int:
        c = self.config
        return {"kv": c.head_dim, "index": c.index_head_dim}.get(kind, c.n_kv_heads * c.head_dim)

    def drop_window_state(self) -> None:
        for p in self.parts:
            p.drop_window_state()
