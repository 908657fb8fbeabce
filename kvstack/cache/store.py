"""The storage interface between attention layers and their caches.

Attention layers never hold tensors of past tokens: they read and write a `KVStore`.
Per layer, a window ring (the last `window_size` window entries, never persisted); per kv
source, a KV stream and an indexer-key stream (one entry per `ratio` tokens, persistent)
and, for ratio > 1, the partial group of tokens whose group is not complete yet (never
persisted). A store returns what it will hand back later for the values written to it,
so the current chunk sees exactly what later chunks will read (the quantised values).

Most stores hold a batch of sequences of equal length (one start position); a decode batch
holds sequences at different positions, one new token each (`start_positions()` is then a
tensor [B]). Formats and widths come from `CacheLayout`. Implementations:
`kvstack.cache.reference.ReferenceStore` (float tensors with autograd, for the reference
forward and training), `kvstack.cache.contiguous.ContiguousCache` (packed bytes), the
engine's `kvstack.cache.paged.PagedSequenceStore` (one sequence over the block pools) and
`kvstack.cache.batch.DecodeBatch` (a decode step's batch over the same pools).
"""

from abc import ABC, abstractmethod

import torch

from kvstack.config import ModelConfig


class KVStore(ABC):
    # Whether its indexer's scores are `index_scores` (the store scoring its packed keys
    # itself).
    scores_index_keys = False

    def scores_entries(self, source: int) -> bool:
        """Whether the indexer's scores at chosen entries of source's stream are
        `index_scores_at` (a kernel reading the packed keys) rather than a gather, and a
        decode step's choice inside its candidate pool `select_in_pool`."""
        return False

    def attends(self) -> bool:
        """Whether a decode step's attention is `attend` (a kernel reading the packed
        rows) rather than the model's own math over what the read methods hand back."""
        return False

    def attends_dense(self) -> bool:
        """Whether a decode step's dense-layer attention (the dense control's) is
        `attend_dense`, a kernel reading the packed rows."""
        return False

    def __init__(
        self, config: ModelConfig, batch_size: int, device: torch.device | str = "cpu"
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.config = config
        self.batch_size = batch_size
        self.device = torch.device(device)
        self._partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- token ids: what replay re-runs ----------------------------------------------
    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Tokens each sequence holds (positions 0..num_tokens-1)."""

    @abstractmethod
    def token_ids(self) -> torch.Tensor:
        """[B, num_tokens] int64."""

    @abstractmethod
    def append_tokens(self, ids: torch.Tensor | list[list[int]]) -> None:
        """Record ids [B, n] as positions num_tokens..num_tokens+n-1 (host lists need no
        copy back from the device for a store that keeps ids on the host)."""

    def recent_ids(self, start: int | torch.Tensor, count: int) -> torch.Tensor:
        """[B, count]: the ids at positions start-count..start-1 of each sequence, zeros
        before position 0 (what Engram hashes ahead of a chunk)."""
        past = self.token_ids()[:, max(0, start - count) : start]
        return torch.nn.functional.pad(past, (count - past.shape[1], 0))

    def start_positions(self) -> int | torch.Tensor:
        """Position of the next token: one for the whole batch, or one per sequence [B]
        when the sequences are at different positions (a decode batch)."""
        return self.num_tokens

    # ---- window rings ------------------------------------------------------------------
    @abstractmethod
    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring of `layer`: entries [B, m, head_dim] and their positions, [m] or, for
        sequences at different positions, [B, m] (int64, m <= window_size). Positions
        never written are absent (or, per sequence, far below any window)."""

    @abstractmethod
    def write_window(self, layer: int, entries: torch.Tensor,
                     start: int | torch.Tensor) -> torch.Tensor:
        """Write entries [B, n, head_dim] at positions start..start+n-1 (start per sequence
        when it is a tensor [B]), keeping the last window_size; return the stored values."""

    def attend_window(self, layer: int, entries: torch.Tensor,
                      start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write entries [B, n, head_dim] (write_window) and return what their queries
        attend over in the ring: the rows before them and the entries as stored [B, m + n,
        head_dim], and their positions [B, m + n]. Rows too old for a query are the
        attention's to mask by position."""
        b, n = entries.shape[:2]
        past, past_positions = self.window(layer)
        stored = self.write_window(layer, entries, start)
        steps = torch.arange(n, device=entries.device)
        positions = start[:, None] + steps if isinstance(start, torch.Tensor) else start + steps
        return (torch.cat((past.type_as(entries), stored), 1),
                torch.cat((past_positions.expand(b, -1), positions.expand(b, -1)), 1))

    # ---- streams (persistent, one entry per `ratio` tokens) ---------------------------
    # A layer's streams are the kinds of CacheLayout.streams for that layer: "kv" and
    # "index" for a kv source, "k" and "v" for each layer of the dense control. They grow
    # together, one entry of each kind at a time.
    @abstractmethod
    def stream_len(self, layer: int) -> int:
        """Entries in the streams of `layer`."""

    @abstractmethod
    def append_stream(
        self, layer: int, entries: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Append entries [B, n, width] to each stream of `layer` (by kind); return the
        stored values of each."""

    @abstractmethod
    def read_stream(self, layer: int, kind: str, start: int, stop: int) -> torch.Tensor:
        """Entries start..stop-1 of one stream: [B, stop-start, width] float32."""

    @abstractmethod
    def gather_stream(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        """Entries by index: entries [B, q, k] (int64, all valid) -> [B, q, k, width]."""

    # ---- partial groups of ratio > 1 sources -------------------------------------------
    def partial(self, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected values and gate logits [B, m, head_dim] of the tokens after the
        stream's last complete group (m < ratio). A decode batch hands back every
        sequence's group buffer [B, ratio - 1, head_dim], rows below its own fill
        (position % ratio) meaningful."""
        if source not in self._partial:
            empty = torch.zeros(self.batch_size, 0, self.config.head_dim, device=self.device)
            return empty, empty
        return self._partial[source]

    def set_partial(self, source: int, values: torch.Tensor, gate_logits: torch.Tensor) -> None:
        """Replace the partial group (a decode batch: record the new token's values
        [B, 1, head_dim] at each sequence's fill)."""
        self._partial[source] = (values, gate_logits)

    def saw_group_rows(self, source: int, values: torch.Tensor,
                       gate_logits: torch.Tensor) -> None:
        """A chunk's compression of source: the values and gate logits [B, m, head_dim]
        of its partial group's tokens and the chunk's, in order. A store that may take
        tokens back (a draft's verify) keeps them to rebuild its partial group; others
        ignore them."""
        return None

    @abstractmethod
    def drop_window_state(self) -> None:
        """Forget what is never persisted: every window ring and partial group."""


def id_tensor(ids: torch.Tensor | list[list[int]], device: torch.device) -> torch.Tensor:
    """Token ids [B, n] as int64 on `device`, from a tensor or host lists."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long, device=device)


class TokenLog:
    """The token ids of a batch of sequences, in a preallocated buffer."""

    def __init__(self, batch_size: int, max_tokens: int, device: torch.device) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.ids = torch.zeros(batch_size, max_tokens, dtype=torch.long, device=device)
        self.count = 0

    def append(self, ids: torch.Tensor | list[list[int]]) -> None:
        ids = id_tensor(ids, self.ids.device)
        n = ids.shape[1]
        if self.count + n > self.ids.shape[1]:
            raise ValueError(
                f"cache full: {self.count} + {n} tokens exceed its capacity of "
                f"{self.ids.shape[1]} tokens"
            )
        self.ids[:, self.count : self.count + n] = ids
        self.count += n
