"""Continuous batching: who runs in the next step.

A step either prefills waiting sequences (FIFO, up to max_num_seqs holding cache and a
token budget per step) or decodes every running one. A sequence admitted from scratch
starts on the cached blocks of its longest cached prefix (the prefix cache). When blocks or
window-ring slots run out, the caches kept for a follow-up turn go first (oldest first),
then the newest running sequence is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed later. The caller never sees an exception for it.
"""

import time
from collections import OrderedDict, deque

from kvstack.cache.paged import PagedCache
from kvstack.engine.sequence import Sequence, Status

KEPT_HOLD_S = 10.0  # the longest a held kept cache waits for its owner's save


class Scheduler:
    def __init__(self, cache: PagedCache, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got "
                             f"{max_num_batched_tokens}")
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Finished sequences whose cache is kept for a follow-up turn, oldest first.
        self.kept: OrderedDict[str, Sequence] = OrderedDict()
        # Running sequences the whole pool cannot hold one more token of: the engine
        # finishes them ("length") and reports them.
        self.unservable: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step, and whether it is a prefill step."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            new = seq.num_tokens - (seq.store.num_tokens if seq.store else 0)
            if batch and tokens + new > self.max_num_batched_tokens:
                break
            if not self._admit(seq):
                break
            seq.status = Status.RUNNING
            self.waiting.popleft()
            batch.append(seq)
            tokens += new
        if batch:
            self.running += batch
            return batch, True

        decoding = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below by an older sequence
            while not self._reserve(seq):
                victim = self.running[-1]  # the newest yields first
                if victim is seq and len(self.running) == 1:
                    self.unservable.append(seq)  # alone and still no room: the pool's limit
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                decoding.append(seq)
        # A sequence whose batch failed decodes alone until it has stepped once, so that
        # one failing request cannot fail the others again.
        suspects = [s for s in decoding if s.suspect]
        return (suspects[:1] if suspects else decoding), False

    def take_unservable(self) -> list[Sequence]:
        taken, self.unservable = self.unservable, []
        return taken

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence a store with room for all its tokens, started on the
        cached blocks of its prefix when the prefix cache has them."""
        fresh = seq.store is None
        if fresh:
            while not self.cache.has_free_slot and self._evict_kept():
                pass
            if not self.cache.has_free_slot:
                return False
            seq.store = self.cache.open_sequence(seq.cache_salt)
            seq.num_cached_tokens = self.cache.attach_prefix(seq.store, seq.all_ids)
        if self._reserve(seq):
            if fresh:
                self.cache.count_prefix_lookup(seq.num_tokens - 1, seq.num_cached_tokens)
            return True
        if fresh:  # nothing of its own cached yet: give the slot and the blocks back meanwhile
            self.cache.close_sequence(seq.store)
            seq.store = None
        return False

    def _reserve(self, seq: Sequence) -> bool:
        while not seq.store.reserve(seq.num_tokens):
            if not self._evict_kept():
                return False
        return True

    def reclaim(self, n_blocks: int) -> bool:
        """Evict kept caches (oldest first) until a window-ring slot and n_blocks blocks
        are free; False if even then they are not."""
        while ((not self.cache.has_free_slot or self.cache.free_blocks < n_blocks)
               and self._evict_kept()):
            pass
        return self.cache.has_free_slot and self.cache.free_blocks >= n_blocks

    def _evict_kept(self) -> bool:
        """Drop the oldest kept cache that is not held for its owner's save; False if
        there is none."""
        victim = next((seq for seq in self.kept.values() if not self._held(seq)), None)
        if victim is None:
            return False
        del self.kept[victim.request_id]
        self._free(victim)
        return True

    @staticmethod
    def _held(seq: Sequence) -> bool:
        return seq.hold_kept and seq.finish_time is not None and (
            time.perf_counter() - seq.finish_time < KEPT_HOLD_S)

    @property
    def holding(self) -> bool:
        """Whether a kept cache is held for a save: what waits on it will run soon."""
        return any(self._held(seq) for seq in self.kept.values())

    def keep(self, seq: Sequence) -> None:
        self.kept[seq.request_id] = seq

    def take_kept(self, request_id: str) -> Sequence | None:
        return self.kept.pop(request_id, None)

    def preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, keep_cache: bool = False) -> None:
        """End a sequence; with keep_cache its store stays for a follow-up turn (until
        evicted for room)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if keep_cache and seq.store is not None:
            self.keep(seq)
        else:
            self._free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def release(self, seq: Sequence) -> None:
        self.kept.pop(seq.request_id, None)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        if seq.store is not None:
            self.cache.close_sequence(seq.store)
            seq.store = None
        if seq in self.running:
            self.running.remove(seq)
