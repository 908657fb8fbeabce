"""Window checkpoints: the window state a prefix hit's replay rebuilt, kept for the next hit.

A prefix-cache hit reuses stream blocks, but its window rings and partial groups are owed
a replay (design.md section 2, "CED prefill and replay spans"): the last window of tokens
re-run through the layers. Every hit on the same cached blocks re-runs the same tokens over
the same bytes and rebuilds the same state, so the engine keeps what the last few replays
left, named by the blocks they read, and the next hit on those blocks copies it into its
slot instead of replaying. A shared system prompt then costs one replay, not one a request.

A checkpoint is named by its blocks' ids together with each block's generation (how many
times the pool has handed it out): a block rewritten since, or brought back from a lower
tier into another block, names a different checkpoint, so a copy is always the state a
replay over the very bytes attached would build. Nothing here is persisted: like the rings,
checkpoints live in device memory, come out of kv_budget (one ring slot's bytes each) and
die with the engine.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

# The blocks a window state was rebuilt over: (block id, generation) per block, in order.
WindowName = tuple[tuple[int, int], ...]


@dataclass
class WindowCheckpoint:
    rings: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> ring rows, positions
    partials: dict[int, tuple[torch.Tensor, torch.Tensor]]  # source -> values, gate logits
    fills: dict[int, int]  # source -> tokens in its partial group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for pair in (*self.rings.values(), *self.partials.values()) for t in pair)


class WindowCheckpoints:
    """Up to `capacity` window states, least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"window checkpoints: capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.held: OrderedDict[WindowName, WindowCheckpoint] = OrderedDict()
        self.restored = 0  # hits that copied a checkpoint instead of replaying
        self.saved = 0  # checkpoints taken (after a replay)

    def __contains__(self, name: WindowName | None) -> bool:
        return name in self.held

    def take(self, name: WindowName | None) -> WindowCheckpoint | None:
        """The checkpoint of these blocks (it stays, now the most recently used), or None."""
        checkpoint = self.held.get(name) if name is not None else None
        if checkpoint is not None:
            self.held.move_to_end(name)
            self.restored += 1
        return checkpoint

    def put(self, name: WindowName, checkpoint: WindowCheckpoint) -> None:
        if not self.capacity:
            return
        self.held[name] = checkpoint
        self.held.move_to_end(name)
        self.saved += 1
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.held.values())

    def report(self) -> dict[str, int]:
        return {"capacity": self.capacity, "held": len(self.held), "bytes": self.nbytes,
                "restored": self.restored, "saved": self.saved}
