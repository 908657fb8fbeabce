"""Continuous batching: who runs in the next step.

A step decodes every running sequence that has its prompt in cache, and prefills prompts
in the rest of the step's token budget (max_num_batched_tokens: one token per decode, each
prompt token, and the tokens a prefix-cache hit replays before its first part):
waiting sequences are admitted FIFO while max_num_seqs allows, and a prompt longer than
what the budget leaves is prefilled in parts over several steps, so that it stalls no
running stream for long and no prompt waits for a long one ahead of it. A prompt's last
part holds at least the decoder span (CED runs the decoder there only), and a part is cut
so that the last one can; a prompt too short to cut runs whole. A sequence admitted from
scratch starts on the cached blocks of its longest cached prefix (the prefix cache). When
blocks or window-ring slots run out, the caches kept for a follow-up turn go first (oldest
first), then the newest running sequence is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed later. The caller never sees an
exception for it.
"""

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstack.cache.paged import PagedCache
from kvstack.engine.sequence import Sequence, Status

KEPT_HOLD_S = 10.0  # the longest a held kept cache waits for its owner's save


@dataclass
class StepPlan:
    """What one step runs: a decode batch, then prompt parts (a sequence and how many of
    the tokens its store lacks it feeds; the last part of a prompt samples a token)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, cache: PagedCache, max_num_seqs: int, max_num_batched_tokens: int,
                 final_prefill_tokens: int = 1,
                 replay_tokens: Callable[[int], int] = lambda cached: 0) -> None:
        """final_prefill_tokens: the fewest tokens the last part of a prompt prefilled in
        parts may hold (`Model.final_prefill_tokens`); replay_tokens: the tokens a store
        started on `cached` tokens of cached blocks re-runs to rebuild its window state
        (`Model.rebuild_spans`), which its first part's step spends of the budget."""
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got "
                             f"{max_num_batched_tokens}")
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.final_prefill_tokens = final_prefill_tokens
        self.replay_tokens = replay_tokens
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

    def schedule(self) -> StepPlan:
        """The next step: the decode batch first, then prompt parts in what remains of
        the token budget."""
        plan = StepPlan(decode=self._decoding())
        # A sequence whose batch failed decodes alone until it has stepped once, so that
        # one failing request cannot fail the others again.
        suspects = [s for s in plan.decode if s.suspect]
        if suspects:
            return StepPlan(decode=suspects[:1])
        budget = self.max_num_batched_tokens - len(plan.decode)
        for seq in self.running:
            if seq.prefilling and budget > 0:
                budget -= self._plan_part(plan, seq, budget)
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self._admit(self.waiting[0])):
            seq = self.waiting.popleft()
            seq.status, seq.prefilling = Status.RUNNING, True
            self.running.append(seq)
            planned = self._plan_part(plan, seq, budget)
            if not planned:
                break  # it prefills first next step; no one is admitted to wait behind it
            budget -= planned
        return plan

    def _plan_part(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        """Plan the sequence's next prompt part within `budget` tokens, after the replay its
        store owes (a prefix-cache hit's, re-run before its first part): all that is left
        when it fits, else as much as leaves the last part its decoder span, else (the
        step has no other part) all that is left, over the budget. The tokens planned and
        replayed."""
        left = seq.num_tokens - seq.store.num_tokens
        replay = self.replay_tokens(seq.store.num_tokens) if seq.store.replay_owed else 0
        room = budget - replay
        if room <= 0 and not plan.prefill:
            room = budget  # alone in the step: its part is sized as if it owed no replay
        part = left if left <= room else min(room, left - self.final_prefill_tokens)
        if part <= 0:
            if plan.prefill:
                return 0
            part = left
        plan.prefill.append((seq, part))
        return part + replay

    def _decoding(self) -> list[Sequence]:
        """The running sequences with their prompt in cache, each with room for its next
        token: the newest running sequences are preempted to make it."""
        decoding = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.prefilling:
                continue  # preempted below by an older sequence, or still prefilling
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
        return decoding

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
            seq.store = self.cache.open_sequence(seq.cache_salt, seq.image_keys)
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
