"""The host tier ("DRAM") of the prefix cache (design.md section 5).

When the device pool hands a cached block out again, its rows move here instead of being
dropped, keyed by the block's chain hash; a later prefix hit that runs past the device's
blocks takes them back up. Least recently stored first out once the byte budget is full:
down to the disk tier when there is one (`spill`), else dropped. On CUDA the copies live
in pinned memory, so the copies back to the device are direct.
"""

from collections import OrderedDict
from collections.abc import Callable

import torch


class HostTier:
    def __init__(self, budget_bytes: int, pin: bool = False,
                 spill: Callable[[bytes, torch.Tensor], None] | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host budget must not be negative, got {budget_bytes}")
        self.budget_bytes, self.pin, self.spill = budget_bytes, pin, spill
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # hash -> uint8 rows
        self.nbytes = 0
        self.dropped = 0  # blocks pushed out of the budget with nowhere to go

    def put(self, chain_hash: bytes, payload: torch.Tensor) -> None:
        """Keep a block's rows (uint8, flat), pushing out the oldest beyond the budget."""
        if chain_hash in self.blocks:
            return
        if payload.numel() > self.budget_bytes:
            self._push_out(chain_hash, payload)
            return
        copy = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=self.pin)
        copy.copy_(payload)
        self.blocks[chain_hash] = copy
        self.nbytes += copy.numel()
        while self.nbytes > self.budget_bytes:
            oldest_hash, oldest = self.blocks.popitem(last=False)
            self.nbytes -= oldest.numel()
            self._push_out(oldest_hash, oldest)

    def _push_out(self, chain_hash: bytes, payload: torch.Tensor) -> None:
        if self.spill is not None:
            self.spill(chain_hash, payload)
        else:
            self.dropped += 1

    def take(self, chain_hash: bytes) -> torch.Tensor | None:
        """A block's rows, removed from this tier (they go back up to the device)."""
        payload = self.blocks.pop(chain_hash, None)
        if payload is not None:
            self.nbytes -= payload.numel()
        return payload
