"""The reference store: float tensors that keep the autograd graph.

Used by the reference forward (training and tests). Values pass through the configured
format's quantise -> dequantise, so the reference sees the same numbers as a cache that
stores bytes; the gradient goes straight through the rounding (straight-through
estimator), so training learns the FP4 noise.
"""

import torch

from kvstack.cache.layout import CacheLayout
from kvstack.cache.store import KVStore, id_tensor
from kvstack.config import ModelConfig
from kvstack.formats import straight_through


class ReferenceStore(KVStore):
    def __init__(
        self, config: ModelConfig, batch_size: int, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config, batch_size, device)
        self._tokens: list[torch.Tensor] = []
        self._window: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._streams: dict[int, dict[str, torch.Tensor]] = {}  # layer -> kind -> [B, N, w]
        self._formats = {(s.layer, s.kind): s.fmt for s in CacheLayout.from_config(config).streams}
        self._n_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._n_tokens

    def token_ids(self) -> torch.Tensor:
        if not self._tokens:
            return torch.zeros(self.batch_size, 0, dtype=torch.long, device=self.device)
        return torch.cat(self._tokens, dim=1)

    def append_tokens(self, ids: torch.Tensor | list[list[int]]) -> None:
        ids = id_tensor(ids, self.device)
        self._tokens.append(ids)
        self._n_tokens += ids.shape[1]

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._window:
            empty = torch.zeros(self.batch_size, 0, self.config.head_dim, device=self.device)
            return empty, torch.zeros(0, dtype=torch.long, device=self.device)
        return self._window[layer]

    def write_window(self, layer: int, entries: torch.Tensor, start: int) -> torch.Tensor:
        stored = straight_through(entries, self.config.window_format)
        positions = torch.arange(start, start + entries.shape[1], device=entries.device)
        old, old_pos = self.window(layer)
        keep = old_pos < start
        values = torch.cat((old[:, keep], stored), dim=1)
        positions = torch.cat((old_pos[keep], positions))
        w = self.config.window_size
        self._window[layer] = (values[:, -w:], positions[-w:])
        return stored

    def stream_len(self, layer: int) -> int:
        streams = self._streams.get(layer)
        return next(iter(streams.values())).shape[1] if streams else 0

    def append_stream(
        self, layer: int, entries: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        stored = {kind: straight_through(x, self._formats[layer, kind])
                  for kind, x in entries.items()}
        streams = self._streams.setdefault(layer, {})
        for kind, x in stored.items():
            streams[kind] = torch.cat((streams[kind], x), dim=1) if kind in streams else x
        return stored

    def read_stream(self, layer: int, kind: str, start: int, stop: int) -> torch.Tensor:
        return self._streams[layer][kind][:, start:stop]

    def gather_stream(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        stream = self._streams[layer][kind]  # [B, N, width]
        b, q, k = entries.shape
        flat = entries.reshape(b, q * k, 1).expand(-1, -1, stream.shape[-1])
        return torch.gather(stream, 1, flat).reshape(b, q, k, stream.shape[-1])

    def drop_window_state(self) -> None:
        self._window.clear()
        self._partial.clear()
