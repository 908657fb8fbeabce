"""Continuous batching: who runs in the next step.

A step either prefills waiting sequences (FIFO, up to max_num_seqs running and a token
budget per step) or decodes every running one. When the pool runs out of blocks, the
newest running sequence is preempted: its blocks are freed and it goes back to the front
of the queue, to be recomputed later. The caller never sees an exception for it.
"""

from collections import deque

from kvstack.cache.paged import PagedCache
from kvstack.engine.sequence import Sequence, Status


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
            if batch and tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            store = self.cache.open_sequence()
            if not store.reserve(seq.num_tokens):
                self.cache.close_sequence(store)
                break
            seq.store, seq.status = store, Status.RUNNING
            self.waiting.popleft()
            batch.append(seq)
            tokens += seq.num_tokens
        if batch:
            self.running += batch
            return batch, True

        decoding = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below by an older sequence
            while not seq.store.reserve(seq.num_tokens):
                victim = self.running[-1]  # the newest yields first
                if victim is seq and len(self.running) == 1:
                    self.finish(seq, "length")  # alone and still no room: the pool's limit
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                decoding.append(seq)
        return decoding, False

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _release(self, seq: Sequence) -> None:
        if seq.store is not None:
            self.cache.close_sequence(seq.store)
            seq.store = None
        if seq in self.running:
            self.running.remove(seq)
