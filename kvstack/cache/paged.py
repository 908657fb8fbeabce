"""Paged storage for the engine (design.md section 5).

One pool per stream of the `CacheLayout`, each a uint8 buffer of packed rows
[n_blocks, block_tokens // ratio, bytes_per_entry]; a block is `block_tokens` tokens of
every stream at once, so one block table per sequence serves all its streams. The
`BlockManager` hands out block ids with reference counts. A `PagedSequenceStore` is one
sequence's view: its block table, its token ids, and a slot of the window rings and
partial groups (per sequence and never paged: they are not persisted). A decode step sees
the running sequences through one `kvstack.cache.batch.DecodeBatch` over the same pools.
"""

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.cache.checkpoints import WindowCheckpoint, WindowCheckpoints, WindowName
from kvstack.cache.disk import DiskTier
from kvstack.cache.host import HostTier
from kvstack.cache.layout import CacheLayout
from kvstack.cache.prefix import ImageKey, block_hashes, salted_seed
from kvstack.cache.rows import PackedRows, PartialGroups, WindowRings
from kvstack.cache.store import KVStore
from kvstack.config import ModelConfig
from kvstack.units import parse_bytes

log = logging.getLogger("kvstack")


def check_block_tokens(config: ModelConfig, block_tokens: int) -> None:
    """A block must end on a group boundary of every stream and on a candidate block."""
    ratios = {s.ratio for s in config.layers if s.ratio}
    need = math.lcm(*ratios, config.candidate_block_size) if ratios else 1
    if block_tokens <= 0 or block_tokens % need:
        raise ValueError(f"block_tokens must be a positive multiple of {need} (every "
                         f"compress ratio and candidate_block_size), got {block_tokens}")


def block_bytes(layout: CacheLayout, block_tokens: int) -> int:
    """Bytes one block takes across all pools."""
    return sum(block_tokens // s.ratio * s.entry_bytes for s in layout.streams)


class BlockManager:
    """Reference counts and the free list of the blocks shared by every stream pool, and
    the prefix index. A full block registered under its chain hash stays findable after
    its last sequence lets go of it: it waits in the free list (least recently freed
    first) until it is handed out again, and a hit takes it back out."""

    def __init__(self, n_blocks: int,
                 on_evict: Callable[[int, bytes], None] | None = None) -> None:
        """on_evict(block, chain_hash): called before a cached block is handed out again
        (its rows are still there), so a lower tier can keep them."""
        self.n_blocks = n_blocks
        self.on_evict = on_evict
        self.ref_counts = [0] * n_blocks
        # Times each block was handed out: with its id, names the bytes it holds now.
        self.generation = [0] * n_blocks
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))
        self.cached: dict[bytes, int] = {}  # chain hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> chain hash

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise ValueError(f"{n} blocks requested, {len(self.free_ids)} free")
        blocks = [self.free_ids.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
            self.generation[b] += 1
            if b in self.hash_of:  # its old content is about to be overwritten
                chain_hash = self.hash_of.pop(b)
                del self.cached[chain_hash]
                if self.on_evict is not None:
                    self.on_evict(b, chain_hash)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block no one references goes back to the
        free list (still findable by its chain hash until handed out again)."""
        # Last block first: a sequence's tail is the least likely to be shared, so it
        # is handed out again before its head.
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids[b] = None

    def register(self, block: int, chain_hash: bytes) -> None:
        """Name a full block by its chain hash (the first block with that content keeps
        the name)."""
        if chain_hash not in self.cached and block not in self.hash_of:
            self.cached[chain_hash] = block
            self.hash_of[block] = chain_hash

    def acquire(self, blocks: list[int]) -> None:
        """One more reference to cached blocks (taken out of the free list if idle)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_ids[b]
            self.ref_counts[b] += 1


class BlockPools:
    """The stream pools: rows of (layer, kind) live at [block, offset in block].

    Each pool has one block more than the manager hands out, `null_block` (zeros at
    start): a decode batch writes the rows a step does not keep there and reads it where a
    sequence has no entry, so a batched step needs no branch per sequence. Rows there are
    only ever read under a mask, and always finite."""

    def __init__(self, layout: CacheLayout, n_blocks: int, block_tokens: int,
                 device: torch.device) -> None:
        self.layout, self.block_tokens, self.n_blocks = layout, block_tokens, n_blocks
        self.device = device
        # A pool row is read only after it was written (attention reads entries below the
        # stream's length; tiers copy full blocks, or a session's blocks cut to its
        # tokens), so on the CPU its memory is left for the OS to commit as blocks fill.
        lazy = device.type == "cpu"
        self.null_block = n_blocks
        self.rows = {(s.layer, s.kind): PackedRows(s.fmt, s.width,
                                                   (n_blocks + 1, block_tokens // s.ratio),
                                                   device, zeroed=not lazy)
                     for s in layout.streams}
        for rows in self.rows.values():
            rows.data[self.null_block].zero_()
        self.entries_per_block = {(s.layer, s.kind): block_tokens // s.ratio
                                  for s in layout.streams}
        self.ratios = {s.layer: s.ratio for s in layout.streams}  # stream layer -> ratio
        # Set by an engine whose pools have mirrors on other ranks: the blocks written
        # from outside a model call (tiers, restored sessions), for the mirrors to repeat.
        self.journal: list[tuple[int, torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())

    @property
    def capacity_tokens(self) -> int:
        return self.n_blocks * self.block_tokens

    def read_block(self, block: int, tokens: int | None = None) -> torch.Tensor:
        """One block's packed rows of every stream, in layout order, as one flat uint8
        tensor: what the lower tiers keep of it. With `tokens`, only the rows of its first
        `tokens` tokens are kept and the rest are zeros: a sequence's last block still
        holds rows of whichever sequence used it before, which must not leave with it."""
        parts = []
        for s in self.layout.streams:
            rows = self.rows[s.layer, s.kind].data[block]
            if tokens is not None:
                rows = rows.clone()
                rows[tokens // s.ratio :] = 0
            parts.append(rows.reshape(-1))
        return torch.cat(parts)

    def write_block(self, block: int, payload: torch.Tensor | bytes) -> None:
        """Put what `read_block` gave (or its bytes) back into a block."""
        if isinstance(payload, bytes):
            payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        targets = [self.rows[s.layer, s.kind].data[block] for s in self.layout.streams]
        expected = sum(t.numel() for t in targets)
        if payload.numel() != expected:
            raise ValueError(f"a block payload of {payload.numel()} bytes; this layout's "
                             f"blocks take {expected}")
        offset = 0
        for target in targets:
            target.copy_(payload[offset : offset + target.numel()].view(target.shape))
            offset += target.numel()
        if self.journal is not None:
            self.journal.append((block, payload.cpu()))


@dataclass
class Speculation:
    """What a store keeps while tokens it was fed may still be taken back (a draft's
    verify): where they start, and what writing them overwrote or passed by."""

    start: int  # tokens held before them
    fed: int  # how many were fed: each writes the ring row of its position
    rings: dict[int, tuple[torch.Tensor, torch.Tensor]]  # those rows before (copy_rows)
    partials: dict[int, tuple[torch.Tensor, torch.Tensor]]  # the partial groups before
    # source -> position -> (values, gate logits [D]): the fed tokens' rows that the
    # compression saw (KVStore.saw_group_rows).
    group_rows: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class StoreState:
    """What a `PagedSequenceStore` holds besides the rows, in a form another process can
    take: its block table, token ids (those after the first `first_token` of them, which
    the receiver already has), stream lengths and partial-group fills."""

    slot: int
    block_table: list[int]
    first_token: int
    tokens: list[int]
    lengths: dict[int, int]
    fills: dict[int, int]
    needs_replay: bool
    window_name: WindowName | None


class PagedSequenceStore(KVStore):
    """One sequence's store over the shared pools."""

    def __init__(self, config: ModelConfig, pools: BlockPools, manager: BlockManager,
                 rings: WindowRings, partials: PartialGroups, slot: int,
                 max_tokens: int, checkpoints: WindowCheckpoints) -> None:
        super().__init__(config, 1, pools.device)
        self.pools, self.manager = pools, manager
        self.rings, self.partials, self.slot = rings, partials, slot
        self.checkpoints = checkpoints
        self._slot = slice(slot, slot + 1)
        self._fill = dict.fromkeys(partials.values, 0)  # source -> tokens in its partial group
        self.block_table: list[int] = []
        self._table = torch.zeros(0, dtype=torch.long, device=self.device)
        self._tokens: list[int] = []
        self.max_tokens = max_tokens
        self._len = {s.layer: 0 for s in pools.layout.streams}
        self.block_hashes: list[bytes] = []  # chain hashes of the full blocks registered
        self.prefix_seed: bytes | None = None  # its chain's seed (salted); None: not cached
        self.image_keys: tuple[ImageKey, ...] = ()  # its image segments, which name blocks too
        # Set when the streams hold tokens the window rings never saw (a prefix-cache
        # hit): the runner rebuilds the rings by replay before anything else.
        self.needs_replay = False
        # The cached blocks a prefix hit started it on, which name the window state a
        # replay over them rebuilds (kvstack.cache.checkpoints); None: not a prefix hit.
        self.window_name: WindowName | None = None
        self.speculation: Speculation | None = None  # set from `speculate` to `settle`
        rings.drop(self._slot)

    # ---- blocks ------------------------------------------------------------------------
    def blocks_needed(self, n_tokens: int) -> int:
        """Further blocks to hold n_tokens tokens in all."""
        return max(0, -(-n_tokens // self.pools.block_tokens) - len(self.block_table))

    def reserve(self, n_tokens: int) -> bool:
        """Make room for n_tokens tokens in all; False (and nothing taken) if the pools
        lack the blocks."""
        need = self.blocks_needed(n_tokens)
        if need > self.manager.num_free:
            return False
        if need:
            self.block_table += self.manager.allocate(need)
            self._table = torch.tensor(self.block_table, dtype=torch.long, device=self.device)
        return True

    def attach(self, blocks: list[int], token_ids: list[int], hashes: list[bytes],
               window_name: WindowName | None = None) -> None:
        """Start an empty store on cached full blocks (acquired by the caller) holding
        token_ids; its window state, if the model has one, must then be rebuilt by replay
        (the dense control keeps every token's keys and values: nothing to rebuild), or
        copied from the checkpoint `window_name` names."""
        if self._tokens or self.block_table:
            raise ValueError("cached blocks can only start an empty sequence")
        self.block_table = list(blocks)
        self._table = torch.tensor(self.block_table, dtype=torch.long, device=self.device)
        self._tokens = list(token_ids)
        self._len = {s.layer: len(token_ids) // s.ratio for s in self.pools.layout.streams}
        self.block_hashes = list(hashes)
        self.needs_replay = self.pools.layout.window_bytes_per_sequence > 0
        self.window_name = window_name if self.needs_replay else None

    def free_blocks(self) -> None:
        """Give every block back (the sequence finished or was preempted)."""
        self.manager.free(self.block_table)
        self.block_table = []
        self._table = self._table[:0]

    def _slots(self, layer: int, kind: str,
               entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_block = self.pools.entries_per_block[layer, kind]
        return self._table[entries // per_block], entries % per_block

    # ---- tokens ----------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def token_ids(self) -> torch.Tensor:
        return torch.tensor([self._tokens], dtype=torch.long, device=self.device)

    def recent_ids(self, start: int, count: int) -> torch.Tensor:
        past = self._tokens[max(0, start - count) : start]
        return torch.tensor([[0] * (count - len(past)) + past], dtype=torch.long,
                            device=self.device)

    @property
    def held_ids(self) -> list[int]:
        """The token ids the store holds, as a list (read-only)."""
        return self._tokens

    def append_tokens(self, ids: torch.Tensor | list[list[int]]) -> None:
        row = ids[0].tolist() if isinstance(ids, torch.Tensor) else list(ids[0])
        self.check_room(len(row))
        self._tokens += row

    def check_room(self, n: int) -> None:
        total = len(self._tokens) + n
        if total > self.max_tokens or self.blocks_needed(total):
            raise ValueError(f"no room reserved for {n} more tokens")

    @property
    def caught_up(self) -> bool:
        """Every stream holds each complete group of the tokens held and every partial
        group the rest, the window rings are current: what a decode step starts from."""
        n = len(self._tokens)
        return (not self.needs_replay
                and all(length == n // self.pools.ratios[layer]
                        for layer, length in self._len.items())
                and all(fill == n % self.pools.ratios[source]
                        for source, fill in self._fill.items()))

    def advance(self, token: int) -> None:
        """Record one decoded token of a caught-up store, with the stream lengths and
        partial fills the decode step's writes give it."""
        self.check_room(1)
        self._tokens.append(token)
        n = len(self._tokens)
        for layer in self._len:
            self._len[layer] = n // self.pools.ratios[layer]
        for source in self._fill:
            self._fill[source] = n % self.pools.ratios[source]

    # ---- window rings ------------------------------------------------------------------
    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rings.read(layer, self._slot)

    def write_window(self, layer: int, entries: torch.Tensor, start: int) -> torch.Tensor:
        return self.rings.write(layer, self._slot, entries, start)

    # ---- partial groups ----------------------------------------------------------------
    def partial(self, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        if source not in self._fill:  # ratio 1: every token completes its group
            return super().partial(source)
        fill = self._fill[source]
        return (self.partials.values[source][self._slot, :fill],
                self.partials.gates[source][self._slot, :fill])

    def set_partial(self, source: int, values: torch.Tensor, gate_logits: torch.Tensor) -> None:
        fill = values.shape[1]
        self.partials.values[source][self.slot, :fill] = values[0].detach()
        self.partials.gates[source][self.slot, :fill] = gate_logits[0].detach()
        self._fill[source] = fill

    # ---- streams -----------------------------------------------------------------------
    def stream_len(self, layer: int) -> int:
        return self._len[layer]

    def append_stream(
        self, layer: int, entries: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        start = self._len[layer]
        n = next(iter(entries.values())).shape[1]
        index = torch.arange(start, start + n, device=self.device)
        stored = {}
        for kind, x in entries.items():
            pool = self.pools.rows[layer, kind]
            rows, stored[kind] = pool.pack(x[0])
            pool.data[self._slots(layer, kind, index)] = rows
            stored[kind] = stored[kind].unsqueeze(0)
        self._len[layer] = start + n
        return stored

    def read_stream(self, layer: int, kind: str, start: int, stop: int) -> torch.Tensor:
        entries = torch.arange(start, stop, device=self.device)
        return self.gather_stream(layer, kind, entries).unsqueeze(0)  # [1, stop - start, width]

    def gather_stream(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        # Only the selected rows are read and dequantised, in one pass where the C kernels
        # are on (PackedRows.read_at).
        block, offset = self._slots(layer, kind, entries)
        per = self.pools.entries_per_block[layer, kind]
        return self.pools.rows[layer, kind].read_at(block * per + offset)  # [1, q, k, width]

    def drop_window_state(self) -> None:
        """Forget the rings and partial groups; they are owed a replay (`needs_replay`)
        until whoever rebuilds them says it is done."""
        self.rings.drop(self._slot)
        self._fill = dict.fromkeys(self._fill, 0)
        self.needs_replay = self.pools.layout.window_bytes_per_sequence > 0

    # ---- speculation: feeding tokens that may be taken back --------------------------
    def speculate(self, n: int) -> None:
        """The next n tokens fed (one call: a draft's verify) may be taken back, all but
        a leading part, by `settle`: keep what they overwrite in the window rings. A
        caught-up store only, and n at most a ring's length."""
        if not self.caught_up:
            raise ValueError("only a caught-up store (streams, partial groups and rings "
                             "current) can feed tokens it may take back")
        if not 0 < n <= self.rings.window:
            raise ValueError(f"a speculative call feeds 1..{self.rings.window} tokens (the "
                             f"window), got {n}")
        start = len(self._tokens)
        first = start % self.rings.window
        self.speculation = Speculation(start, n, self.rings.copy_rows(self.slot, first, n),
                                       self.partials.copy_slot(self.slot),
                                       {source: {} for source in self._fill})

    def saw_group_rows(self, source: int, values: torch.Tensor, gate_logits: torch.Tensor,
                       first: int | None = None) -> None:
        """first: the position of the first row (None: a chunk's compression, whose rows
        start at its partial group's first token)."""
        spec = self.speculation
        if spec is None:
            return
        if first is None:
            first = self._len[source] * self.pools.ratios[source]
        seen = spec.group_rows[source]
        for i in range(max(0, spec.start - first), values.shape[1]):
            seen[first + i] = (values[0, i].detach().clone(), gate_logits[0, i].detach().clone())

    def settle(self, n_kept: int) -> None:
        """Keep the first n_kept of the tokens fed since `speculate` and take back the
        rest: they leave no byte behind (stream and index-key rows zeroed, ring rows and
        positions as before, partial groups rebuilt from the kept tokens' rows, the token
        log cut), as if they had never been fed."""
        spec, self.speculation = self.speculation, None
        if spec is None:
            raise ValueError("settle: no speculative call to settle")
        fed = len(self._tokens) - spec.start
        if not 0 <= n_kept <= fed:
            raise ValueError(f"settle: {fed} tokens were fed, cannot keep {n_kept}")
        if n_kept == fed:
            return
        end = spec.start + n_kept
        del self._tokens[end:]
        for layer, length in self._len.items():
            kept = end // self.pools.ratios[layer]
            if length > kept:
                entries = torch.arange(kept, length, device=self.device)
                for s in self.pools.layout.streams:
                    if s.layer == layer:
                        block, offset = self._slots(layer, s.kind, entries)
                        self.pools.rows[layer, s.kind].data[block, offset] = 0
            self._len[layer] = kept
        self.rings.load_rows(self.slot, spec.start % self.rings.window, spec.fed, spec.rings,
                             n_kept)
        for source in self._fill:
            # The kept tokens' partial group: rows from before the speculation (its start
            # lies in the same group) as they were, then the fed tokens' as computed.
            r = self.pools.ratios[source]
            fill, before = end % r, spec.start - spec.start % r
            values, gates = spec.partials[source]
            seen = spec.group_rows[source]
            for i, position in enumerate(range(end - fill, end)):
                value, gate = (seen[position] if position >= spec.start
                               else (values[position - before], gates[position - before]))
                self.partials.values[source][self.slot, i] = value
                self.partials.gates[source][self.slot, i] = gate
            self._fill[source] = fill

    # ---- window checkpoints ----------------------------------------------------------
    @property
    def replay_owed(self) -> bool:
        """Whether it owes a replay that must run (a window of tokens through the layers),
        not a checkpoint's copy."""
        return self.needs_replay and self.window_name not in self.checkpoints

    def restore_window(self) -> bool:
        """Take the window state a replay over the same cached blocks left, if one was
        kept: then no replay is owed, and True."""
        saved = self.checkpoints.take(self.window_name)
        if saved is None:
            return False
        self.window_name = None  # the store moves on from the blocks it names
        self.rings.load_slot(self.slot, saved.rings)
        self.partials.load_slot(self.slot, saved.partials)
        self._fill = dict(saved.fills)
        self.needs_replay = False
        return True

    def checkpoint_window(self) -> None:
        """Keep the window state a replay just rebuilt, for the next hit on its blocks."""
        if self.window_name is not None:
            self.checkpoints.put(self.window_name, WindowCheckpoint(
                self.rings.copy_slot(self.slot), self.partials.copy_slot(self.slot),
                dict(self._fill)))
            self.window_name = None

    # ---- mirrors ---------------------------------------------------------------------
    def state(self, first_token: int = 0) -> StoreState:
        return StoreState(self.slot, list(self.block_table), first_token,
                          self._tokens[first_token:], dict(self._len), dict(self._fill),
                          self.needs_replay, self.window_name)

    def follow(self, state: StoreState) -> None:
        """Become the store `state` describes, over this process's own copy of the pools
        (a mirror on another rank: its rows were written by the same model calls)."""
        if state.slot != self.slot or state.first_token not in (0, len(self._tokens)):
            raise ValueError(f"a mirror of slot {self.slot} holding {len(self._tokens)} "
                             f"tokens cannot follow slot {state.slot} from token "
                             f"{state.first_token}")
        if state.block_table != self.block_table:
            self.block_table = list(state.block_table)
            self._table = torch.tensor(self.block_table, dtype=torch.long, device=self.device)
        if state.first_token == 0:
            self._tokens = list(state.tokens)
        else:  # the usual step: a few new ids after those this copy holds
            self._tokens.extend(state.tokens)
        self._len, self._fill = dict(state.lengths), dict(state.fills)
        self.needs_replay, self.window_name = state.needs_replay, state.window_name


class PagedCache:
    """Everything the engine allocates for the cache, from one byte budget: the stream
    pools (paged), and one window-ring slot per sequence that may run at once (rings are
    per sequence, not per token)."""

    def __init__(self, config: ModelConfig, kv_budget: int | str, block_tokens: int,
                 max_num_seqs: int, device: torch.device | str = "cpu",
                 prefix_seed: bytes | None = None, host_budget: int = 0,
                 disk: DiskTier | None = None, pad_slot: bool = False,
                 window_checkpoints: int = 0) -> None:
        """prefix_seed: the hash chain's seed (`chain_seed`); None turns prefix caching
        off. host_budget: bytes of host memory that keep cached blocks the device pool
        needs back; disk: the tier below it. Without either, such blocks are dropped and
        recomputed when asked for again. pad_slot: one more window-ring slot, held by no
        sequence, where the pad rows of a decode batch padded to a batch-size bucket
        write (a compiled decode step's); it comes out of kv_budget like the others.
        window_checkpoints: window states of prefix hits kept for the next hit on the same
        blocks (kvstack.cache.checkpoints), each a ring slot's bytes of kv_budget."""
        check_block_tokens(config, block_tokens)
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        self.config, self.block_tokens = config, block_tokens
        self.layout = CacheLayout.from_config(config)
        device = torch.device(device)
        budget = parse_bytes(kv_budget)
        ring_bytes = self.layout.window_bytes_per_sequence
        per_block = block_bytes(self.layout, block_tokens)
        n_slots = max_num_seqs + pad_slot
        if not ring_bytes:
            window_checkpoints = 0  # the dense control has no window state
        rings_held = n_slots + window_checkpoints
        n_blocks = (budget - rings_held * ring_bytes) // per_block if per_block else 0
        if n_blocks < 1:
            raise ValueError(
                f"kv_budget of {budget:,} bytes is too small: {n_slots} window-ring "
                f"slots and {window_checkpoints} window checkpoints take "
                f"{rings_held * ring_bytes:,} bytes and one block of {block_tokens} tokens "
                f"{per_block:,}"
            )
        self.budget = budget
        self.pools = BlockPools(self.layout, n_blocks, block_tokens, device)
        self.disk = disk
        self.host = HostTier(host_budget, pin=device.type == "cuda",
                             spill=self._spill_to_disk if disk is not None else None)
        lower = host_budget or disk is not None
        self.manager = BlockManager(n_blocks, self._evict_down if lower else None)
        # Window state of every sequence that may run at once, one slot each. Partial
        # groups are float32 (design.md section 4) and, like the rings, per sequence; they
        # sit outside kv_budget, which is the packed rows' (report(): partial_group_bytes).
        self.rings = WindowRings(self.layout, config.window_size, n_slots, device)
        self.partials = PartialGroups(self.layout, n_slots, device)
        self.checkpoints = WindowCheckpoints(window_checkpoints)
        self.rings.pad_slot = max_num_seqs if pad_slot else None
        self.max_num_seqs, self.n_slots = max_num_seqs, n_slots
        self._free_slots = list(range(max_num_seqs))
        self.open: dict[int, tuple[PagedSequenceStore, int]] = {}  # id(store) -> (store, slot)
        self.prefix_seed = prefix_seed
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which found (on the device or the host)
        self.prefix_host_hit_tokens = 0  # of which brought back from the host tier
        self.prefix_disk_hit_tokens = 0  # of which brought back from the disk tier

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    @property
    def free_blocks(self) -> int:
        return self.manager.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.pools.capacity_tokens

    def open_sequence(self, cache_salt: str | None = None,
                      image_keys: tuple[ImageKey, ...] = ()) -> PagedSequenceStore:
        """A store for a new sequence; its full blocks are named in the prefix cache under
        `cache_salt`'s chain (found only by requests of the same salt), blocks that hold
        image positions by their images' content too (`image_keys`)."""
        if not self._free_slots:
            raise ValueError("no free window-ring slot: max_num_seqs sequences are running")
        slot = self._free_slots.pop()
        store = PagedSequenceStore(self.config, self.pools, self.manager, self.rings,
                                   self.partials, slot, self.config.max_seq_len,
                                   self.checkpoints)
        if self.prefix_seed is not None:
            store.prefix_seed = salted_seed(self.prefix_seed, cache_salt)
        store.image_keys = image_keys
        self.open[id(store)] = (store, slot)
        return store

    def close_sequence(self, store: PagedSequenceStore) -> None:
        store.free_blocks()
        self._free_slots.append(self.open.pop(id(store))[1])

    def report(self, context: int) -> dict[str, Any]:
        """Bytes per token and capacity measured from what was allocated, the plan beside
        every figure, the prefix cache and the tiers below; `warnings` names every store
        that is not in its configured format. context: tokens per sequence for the
        capacity figure."""
        pools, layout = self.pools, self.layout
        capacity = pools.capacity_tokens
        streams, warnings = [], []
        for s in layout.streams:
            rows = pools.rows[s.layer, s.kind].data[: pools.n_blocks]  # without the null block
            entry = rows.shape[-1] * rows.element_size()
            measured = rows.numel() * rows.element_size() / capacity
            planned = float(s.bytes_per_token)
            streams.append({"layer": s.layer, "kind": s.kind, "format": s.fmt, "width": s.width,
                            "ratio": s.ratio, "bytes_per_entry": entry,
                            "bytes_per_token": measured, "planned_bytes_per_token": planned})
            if not math.isclose(measured, planned):
                warnings.append(f"layer {s.layer} {s.kind} stream stores {entry} B per entry, "
                                f"the plan for {s.fmt}[{s.width}] is {s.entry_bytes}: it is "
                                "not in its configured format")
        ring = self.rings.nbytes // self.n_slots
        if ring != layout.window_bytes_per_sequence:
            warnings.append(f"window rings take {ring} B per sequence, the plan "
                            f"{layout.window_bytes_per_sequence}")
        tokens = self.tokens_in_use
        blocks_used = pools.n_blocks - self.manager.num_free
        per_seq = -(-context // pools.block_tokens)
        measured_total = sum(r["bytes_per_token"] for r in streams)
        return {
            "basis": "measured from the allocated pools and rings",
            "bytes_per_token": measured_total,
            "planned_bytes_per_token": float(layout.bytes_per_token),
            "streams": streams,
            "tokens_in_use": tokens,
            "in_use_bytes_per_token": (
                blocks_used * block_bytes(layout, pools.block_tokens) / tokens if tokens
                else None),
            "blocks_total": pools.n_blocks,
            "blocks_in_use": blocks_used,
            "block_tokens": pools.block_tokens,
            "capacity_tokens": capacity,
            "window_bytes_per_sequence": ring,
            "planned_window_bytes_per_sequence": layout.window_bytes_per_sequence,
            "allocated_bytes": pools.nbytes + self.ring_bytes,
            "kv_budget": self.budget,
            "context": context,
            "partial_group_bytes": self.partials.nbytes,
            "window_checkpoints": self.checkpoints.report(),
            "sequences_fit": min(pools.n_blocks // per_seq, self.max_num_seqs),
            "prefix_cache": {
                "enabled": self.prefix_seed is not None,
                "queried_tokens": self.prefix_queried_tokens,
                "hit_tokens": self.prefix_hit_tokens,
                "hit_rate": (self.prefix_hit_tokens / self.prefix_queried_tokens
                             if self.prefix_queried_tokens else 0.0),
                "cached_blocks": len(self.manager.cached),
                "host_hit_tokens": self.prefix_host_hit_tokens,
                "disk_hit_tokens": self.prefix_disk_hit_tokens,
            },
            "host_tier": {"budget": self.host.budget_bytes, "bytes": self.host.nbytes,
                          "blocks": len(self.host.blocks),
                          "blocks_dropped": self.host.dropped},
            "disk_tier": ({"budget": self.disk.budget_bytes, "bytes": self.disk.used_bytes,
                           "prefix_bytes": self.disk.prefix_bytes}
                          if self.disk is not None else None),
            "warnings": warnings,
        }


    # ---- what a saved session holds ---------------------------------------------------
    def block_payloads(self, store: PagedSequenceStore) -> list[bytes]:
        """The packed rows of every stream for each block the store holds tokens in (a
        session's save), the last block cut to the tokens it holds."""
        held, per = store.num_tokens, self.block_tokens
        blocks = store.block_table[: -(-held // per)]
        return [self.pools.read_block(b, min(per, held - i * per)).cpu().numpy().tobytes()
                for i, b in enumerate(blocks)]

    def restore(self, payloads: list[bytes], token_ids: list[int],
                cache_salt: str | None = None,
                image_keys: tuple[ImageKey, ...] = ()) -> PagedSequenceStore:
        """A store holding saved blocks (block_payloads) of token_ids, its window state to
        be rebuilt by replay; the caller has made room (a ring slot and the blocks)."""
        store = self.open_sequence(cache_salt, image_keys)
        blocks = self.manager.allocate(len(payloads))
        for block, payload in zip(blocks, payloads, strict=True):
            self.pools.write_block(block, payload)
        store.attach(blocks, token_ids, [])
        self.register_full_blocks(store)
        return store

    def cached_copy(self, token_ids: list[int], index: int, cache_salt: str | None = None,
                    image_keys: tuple[ImageKey, ...] = ()) -> bytes | None:
        """The packed rows the prefix cache holds, on the device or in host memory, for
        full block `index` of token_ids (a saved session's own bytes, if it computed them
        alike), or None. What repairs a session's damaged block file."""
        if self.prefix_seed is None:
            return None
        seed = salted_seed(self.prefix_seed, cache_salt)
        hashes = block_hashes(seed, token_ids[: (index + 1) * self.block_tokens],
                              self.block_tokens, images=image_keys)
        if index >= len(hashes):
            return None  # a partial last block is never named
        chain_hash = hashes[index]
        if chain_hash in self.manager.cached:
            rows = self.pools.read_block(self.manager.cached[chain_hash]).cpu()
        elif chain_hash in self.host.blocks:
            rows = self.host.blocks[chain_hash]
        else:
            return None
        return rows.numpy().tobytes()

    def held_bytes(self, store: PagedSequenceStore) -> int:
        """Device bytes of the blocks a store holds."""
        return len(store.block_table) * block_bytes(self.layout, self.block_tokens)

    @property
    def tokens_in_use(self) -> int:
        return sum(store.num_tokens for store, _ in self.open.values())

    @property
    def ring_bytes(self) -> int:
        return self.rings.nbytes

    # ---- prefix cache ------------------------------------------------------------------
    def attach_prefix(self, store: PagedSequenceStore, token_ids: list[int]) -> int:
        """Start an empty store on the longest cached run of token_ids' full blocks (the
        device's first, then those the host tier kept), leaving at least the last token
        to compute (its logits are needed); the number of tokens reused."""
        if store.prefix_seed is None:
            return 0
        usable = token_ids[: len(token_ids) - 1]
        hashes = block_hashes(store.prefix_seed, usable, self.block_tokens,
                              images=store.image_keys)
        blocks: list[int] = []
        for chain_hash in hashes:
            if chain_hash in self.manager.cached:
                block = self.manager.cached[chain_hash]
                self.manager.acquire([block])
            elif not self.manager.num_free:
                break
            elif chain_hash in self.host.blocks:
                block = self._bring_back(chain_hash, self.host.take(chain_hash))
                self.prefix_host_hit_tokens += self.block_tokens
            elif self.disk is not None and (payload := self.disk.take_prefix(chain_hash.hex())):
                block = self._bring_back(chain_hash, payload)
                self.prefix_disk_hit_tokens += self.block_tokens
            else:
                break
            blocks.append(block)
        if blocks:
            n = len(blocks) * self.block_tokens
            generation = self.manager.generation
            store.attach(blocks, token_ids[:n], hashes[: len(blocks)],
                         tuple((b, generation[b]) for b in blocks))
        return len(blocks) * self.block_tokens

    def _bring_back(self, chain_hash: bytes, payload: torch.Tensor | bytes) -> int:
        block = self.manager.allocate(1)[0]
        self.pools.write_block(block, payload)
        self.manager.register(block, chain_hash)
        return block

    def _evict_down(self, block: int, chain_hash: bytes) -> None:
        rows = self.pools.read_block(block).cpu()
        if self.host.budget_bytes:
            self.host.put(chain_hash, rows)
        else:
            self._spill_to_disk(chain_hash, rows)

    def _spill_to_disk(self, chain_hash: bytes, rows: torch.Tensor) -> None:
        # A lower tier that cannot take a block (a full disk) costs a recompute later,
        # never the request that is running.
        try:
            self.disk.put_prefix(chain_hash.hex(), rows.numpy().tobytes())
        except OSError as e:
            log.warning("disk prefix cache: block not kept (%s)", e)

    def count_prefix_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queried_tokens += queried
        self.prefix_hit_tokens += hit

    def register_full_blocks(self, store: PagedSequenceStore) -> None:
        """Name the store's newly completed blocks in the prefix index."""
        if store.prefix_seed is None:
            return
        done = len(store.block_hashes)
        if store.num_tokens // self.block_tokens <= done:
            return
        store.block_hashes = block_hashes(store.prefix_seed, store.held_ids, self.block_tokens,
                                          store.block_hashes, store.image_keys)
        for i in range(done, len(store.block_hashes)):
            self.manager.register(store.block_table[i], store.block_hashes[i])
            # With a disk tier the named block is written through, so that it outlives
            # this engine (another process, a later run) and not only an eviction.
            name = store.block_hashes[i].hex()
            if self.disk is not None and not self.disk.has_prefix(name):
                self._spill_to_disk(store.block_hashes[i],
                                    self.pools.read_block(store.block_table[i]).cpu())
