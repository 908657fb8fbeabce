"""Runs the model for the sequences a step scheduled, and samples their next tokens."""

import importlib.util
import itertools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from kvstack import native
from kvstack.cache.batch import DecodeBatch
from kvstack.cache.paged import PagedSequenceStore
from kvstack.engine.config import EngineConfig
from kvstack.engine.pace import DraftPace
from kvstack.engine.sampling import Sample, distribution, sample_batch, speculative_accept
from kvstack.engine.sequence import Sequence, Status
from kvstack.model import Model
from kvstack.model.dspark import greedy
from kvstack.model.model import Compressor, Extension
from kvstack.model.packed import PackedExperts, PackedLinear
from kvstack.model.vision import ImageSegment

log = logging.getLogger("kvstack")


@dataclass
class Verified:
    """A DSpark verify's outcome for one sequence."""

    samples: list[Sample]  # the outputs: accepted drafts, then the target's next token
    target_hidden: torch.Tensor  # [fed, targets * dim]: the target states of what it fed


class ModelRunner:
    lost: str | None = None  # why this runner can make no more calls (a parallel group's)

    def __init__(self, model: Model, config: EngineConfig) -> None:
        """Reads the engine's replay, chunk_size, compile_decode, attention, max_num_seqs
        and cpu_kernels."""
        self.model, self.config = model, config
        compile_decode = config.compile_decode
        # A compiled step pads its batch to the next bucket: one static graph per bucket.
        self.buckets = decode_buckets(config.max_num_seqs) if compile_decode else []
        self.device = model.embed.weight.device
        self.replayed_tokens = 0  # tokens re-run to rebuild window state, since start
        self.compiled = compile_decode
        self.compile_seconds = 0.0  # decode steps that compiled a graph, in all
        self.compiled_graphs = 0  # graphs those steps made
        self.attention = _attention_backend(config.attention, model, self.device)
        self.speculative = _speculative(config.speculative, model)
        # The most drafts a verify feeds (EngineConfig.speculative_tokens).
        self.speculative_tokens = _speculative_tokens(config.speculative_tokens, model)
        self.pace = DraftPace(config.speculative_schedule, model.config.window_size)
        self.max_model_len = config.model_len(model.config)
        # DSpark's verifies since start (a sequence's drafted step), the drafts they
        # verified and those accepted; per verify, how many drafts it verified and kept
        # (count by length); the steps of sequences that decoded without a draft (the
        # schedule's pauses). Its steps where some sequence drafted, and the seconds their
        # draft and verify calls took.
        self.verifies = self.drafted_tokens = self.accepted_tokens = self.undrafted = 0
        self.verify_lengths: Counter[int] = Counter()
        self.accepted_lengths: Counter[int] = Counter()
        self.drafting_steps = 0
        self.draft_seconds = self.verify_seconds = 0.0
        self.cpu_kernels = _cpu_kernels(config.cpu_kernels, self.device)
        # Several rows of a sequence in one decode step (DecodeBatch's counts) where the C
        # kernels run every part of the step that keeps state: the compressors' (float32
        # or bf16 weights, float64 RoPE) and the window rings' (a format they write).
        self.rows_in_c = (
            self.cpu_kernels and not compile_decode and self.attention == "torch"
            and model.config.arch == "v41" and native.decodes(model.config.window_format)
            and all(m.c_weights() is not None for m in model.modules()
                    if isinstance(m, Compressor)))
        self.verify_in_c = self.speculative and self.rows_in_c
        if compile_decode:
            model.compile_decode()
        self.packed_weights = _packed_weights_backend(model, self.device, self.cpu_kernels)
        if self.packed_weights is not None:
            log.info("kvstack packed weights: %s", self.packed_weights)
        # On a CPU the C kernels attend in an eager step; a compiled one keeps torch's math.
        attention = ("the Triton kernel" if self.attention == "triton" else
                     "the C kernel" if self.cpu_kernels and not compile_decode else "torch")
        log.info("kvstack decode: %s, attention by %s, packed reads, index scoring, the "
                 "experts and the step's small ops (norms, RoPE, hyper-connections, "
                 "quantisation, top-k) by %s", "torch.compile (inductor, one graph "
                 f"per batch-size bucket {self.buckets}, each compiled on its "
                 "first decode step)" if compile_decode else "eager torch", attention,
                 "the C kernels (kvstack.native)" if self.cpu_kernels else "torch")

    @torch.no_grad()
    def prefill(self, seq: Sequence) -> Sample:
        """Feed the sequence's tokens its store does not hold yet (the prompt, what it
        generated before a preemption, or a follow-up turn) through CED prefill; the
        next token. A sequence DSpark drafts for also gets its `draft_context`."""
        if not self.drafts(seq):
            return sample_batch(self.prefill_logits(seq), [seq])[0]
        out = self._extend(seq.store, seq.all_ids[seq.store.num_tokens :], 1,
                           self.model.config.window_size, seq.images)
        with native.active(self.cpu_kernels):
            seq.draft_context = self.model.draft.window(
                out.target_hidden, seq.store.num_tokens - 1)[:, 0]
        seq.draft_states = None
        return sample_batch(out.logits[:, -1], [seq])[0]

    def prefill_logits(self, seq: Sequence) -> torch.Tensor:
        """The prefill's last logits [1, V]."""
        return self.prefill_store(seq.store, seq.all_ids[seq.store.num_tokens :],
                                  images=seq.images)

    def prefill_part(self, seq: Sequence, n: int) -> None:
        """Feed the next n of the tokens the sequence's store lacks, a leading part of a
        prompt prefilled over several steps (`Model.prefill_part`): no token comes of it."""
        start = seq.store.num_tokens
        self.prefill_store(seq.store, seq.all_ids[start : start + n], final=False,
                           images=seq.images)

    @torch.no_grad()
    def prefill_store(self, store: PagedSequenceStore, fresh: list[int],
                      final: bool = True, images: list[ImageSegment] | None = None
                      ) -> torch.Tensor | None:
        """Prefill `fresh` ids after what the store holds; the last logits [1, V] (a part
        that is not the prompt's last: None). A store started on cached blocks first
        rebuilds its window rings and partial groups by replay (`bounded` or `exact`), or
        copies those a replay over the same blocks left (a window checkpoint). `images`:
        the sequence's image segments (what a replay or the fresh ids hold of them is
        encoded again)."""
        with native.active(self.cpu_kernels):
            self._catch_up(store, images)
            ids = torch.tensor([fresh], dtype=torch.long, device=self.device)
            if not final:
                self.model.prefill_part(ids, store, chunk_size=self.config.chunk_size,
                                        images=images)
                return None
            return self.model.prefill(ids, store, replay=self.config.replay,
                                      chunk_size=self.config.chunk_size, images=images)

    def _catch_up(self, store: PagedSequenceStore, images: list[ImageSegment] | None) -> None:
        """Rebuild the window state a store started on cached blocks owes, by replay or
        from a window checkpoint."""
        if store.needs_replay and not store.restore_window():
            self.replayed_tokens += self.model.rebuild_spans(store.num_tokens,
                                                             self.config.replay)[0]
            self.model.rebuild_window(store, replay=self.config.replay,
                                      chunk_size=self.config.chunk_size, logits=False,
                                      images=images)
            store.needs_replay = False
            store.checkpoint_window()

    @torch.no_grad()
    def _extend(self, store: PagedSequenceStore, fresh: list[int], n_logits: int,
                target_hidden: int, images: list[ImageSegment] | None = None) -> Extension:
        """`Model.extend` of `fresh` after what the store holds (caught up first)."""
        with native.active(self.cpu_kernels):
            self._catch_up(store, images)
            ids = torch.tensor([fresh], dtype=torch.long, device=self.device)
            return self.model.extend(ids, store, self.config.replay, self.config.chunk_size,
                                     n_logits, target_hidden, images=images)

    # ---- DSpark: draft, verify, keep what the target agrees with -----------------------
    def drafts(self, seq: Sequence) -> bool:
        """Whether the sequence's next tokens come from DSpark's draft-verify step: the
        engine runs it, and nothing changes the request's logits between positions
        (penalties, biases and a grammar depend on the tokens before; log-probabilities
        are not reported for drafted tokens), so that the target's distribution at each
        position is its logits' alone."""
        p = seq.params
        return (self.speculative and not p.penalised and p.logprobs is None
                and not p.constrained)

    def drafting(self, seqs: list[Sequence]) -> list[bool] | None:
        """Which of these sequences draft this step (`DraftPace.drafting`); None where
        none does and they decode as plain ones do, keeping their target states
        (`decode`)."""
        chosen = self.pace.drafting(seqs)
        return None if self.verify_in_c and not any(chosen) else chosen

    @torch.no_grad()
    def speculate(self, seqs: list[Sequence], chosen: list[bool]) -> list[Verified]:
        """One DSpark step of each sequence (it holds its prompt in cache and its
        `draft_context`): for those `chosen` (`drafting`), draft a
        block after its last sampled token and keep the block's worthwhile prefix
        (`verify_lengths`); then verify, and choose the outputs (greedy: the drafts the
        target's argmax agrees with, then the target's own token; sampled:
        `speculative_accept`). The verify is one target call for every sequence, a
        `DecodeBatch` with a row per fed token (the last sampled one, then the drafts),
        where the C kernels run the step; else one `Model.extend` each. A sequence fed
        drafts stays in speculation (`PagedSequenceStore.speculate`): `settle` keeps the
        outputs the caller took."""
        started = time.perf_counter()
        blocks = self._draft(seqs, chosen)
        drafted = time.perf_counter()
        for seq, (drafts, _) in zip(seqs, blocks, strict=True):
            if drafts:
                seq.store.speculate(len(drafts) + 1)
        fed = [[seq.output_ids[-1], *drafts] for seq, (drafts, _) in zip(seqs, blocks,
                                                                        strict=True)]
        if self.verify_in_c:
            with native.active(self.cpu_kernels):
                out = self.model.verify([t for tokens in fed for t in tokens], DecodeBatch(
                    [seq.store for seq in seqs], counts=[len(tokens) for tokens in fed]))
            ends = list(itertools.accumulate(len(tokens) for tokens in fed))
            verified = [(out.logits[end - len(tokens) : end, 0],
                         out.target_hidden[end - len(tokens) : end, 0])
                        for tokens, end in zip(fed, ends, strict=True)]
        else:
            verified = []
            for seq, tokens in zip(seqs, fed, strict=True):
                one = self._extend(seq.store, tokens, len(tokens), len(tokens), seq.images)
                verified.append((one.logits[0], one.target_hidden[0]))
        if any(chosen):
            self.drafting_steps += 1
            self.draft_seconds += drafted - started
            self.verify_seconds += time.perf_counter() - drafted
        # The sequences that did not draft decode as a plain step would (one sampling
        # pass for all); their target states are kept for later drafts.
        plain = [i for i, drew in enumerate(chosen) if not drew]
        outcomes = []
        with native.active(self.cpu_kernels):  # the greedy rows by one C pass
            samples = iter(sample_batch(torch.cat([verified[i][0] for i in plain]),
                                        [seqs[i] for i in plain]) if plain else ())
            for seq, drew, (drafts, proposed), (logits, hidden) in zip(
                    seqs, chosen, blocks, verified, strict=True):
                if drew:
                    outcome = self._accept(seq, drafts, proposed, logits, hidden)
                else:
                    outcome = Verified([next(samples)], hidden)
                    self.undrafted += 1
                outcomes.append(outcome)
        return outcomes

    @torch.no_grad()
    def _draft(self, seqs: list[Sequence], chosen: list[bool]
               ) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Each sequence's drafts worth verifying after its last sampled token, and, for
        a sampled request, the draft's distribution at each (none where not `chosen`,
        without a draft context yet, or where the confidence or the limits leave none).
        One draft call for every chosen sequence with a context: a context shorter than
        the longest (a sequence that holds less than a window) is left-padded, its padding
        masked."""
        blocks: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in seqs]
        self.make_draft_contexts([seq for seq, drew in zip(seqs, chosen, strict=True) if drew])
        members = [i for i, (seq, drew) in enumerate(zip(seqs, chosen, strict=True))
                   if drew and seq.draft_context is not None]
        if not members:
            return blocks
        model, c = self.model, self.model.config
        group = [seqs[i] for i in members]
        contexts = [seq.draft_context for seq in group]  # [S, n, D] each
        width = max(context.shape[1] for context in contexts)
        padding = None
        if all(context.shape[1] == width for context in contexts):
            window = torch.stack(contexts, 1)  # [S, B, W, D]
        else:
            window = contexts[0].new_zeros(contexts[0].shape[0], len(group), width,
                                           contexts[0].shape[2])
            padding = torch.zeros(len(group), width, dtype=torch.bool)
            for row, context in enumerate(contexts):
                window[:, row, width - context.shape[1] :] = context
                padding[row, : width - context.shape[1]] = True
        proposed: list[list[torch.Tensor]] = [[] for _ in group]

        def draw(logits: torch.Tensor) -> torch.Tensor:
            """Each row's next draft [B] from logits [B, vocab]: greedy, or drawn from its
            request's distribution."""
            tokens = logits.argmax(-1)
            for row, seq in enumerate(group):
                if seq.params.temperature > 0:
                    proposed[row].append(distribution(logits[row], seq.params))
                    tokens[row] = int(torch.multinomial(proposed[row][-1], 1,
                                                        generator=seq.generator))
            return tokens

        starts = [seq.store.num_tokens for seq in group]  # the last sampled tokens'
        # All greedy: the draft's own greedy choice, which its C path takes.
        choose = greedy if all(seq.params.temperature == 0 for seq in group) else draw
        with native.active(self.cpu_kernels):
            block = model.draft.block(
                model, window,
                torch.tensor([seq.output_ids[-1] for seq in group], device=self.device),
                torch.tensor(starts, device=self.device) - 1, choose, padding)
        limits = [min(self.speculative_tokens, c.window_size - 1,
                      seq.params.max_tokens - len(seq.output_ids) - 1,
                      self.max_model_len - start - 2)
                  for seq, start in zip(group, starts, strict=True)]
        lengths = verify_lengths(block.confidence, limits)
        for row, (i, seq, start) in enumerate(zip(members, group, starts, strict=True)):
            n = lengths[row]
            if n and not seq.store.reserve(start + n + 1):
                n = 0
            blocks[i] = (block.tokens[row, 1 : n + 1].tolist(), proposed[row][:n])
        return blocks

    @torch.no_grad()
    def make_draft_contexts(self, seqs: list[Sequence]) -> None:
        """Each sequence's `draft_context` brought up to the tokens its store holds: the
        window entries of its `draft_states` (the target states of tokens kept since its
        last draft), made in one call for all, joined to it."""
        pending = [seq for seq in seqs if seq.draft_states]
        if not pending:
            return
        counts = [sum(map(len, seq.draft_states)) for seq in pending]
        pieces = [piece for seq in pending for piece in seq.draft_states]
        states = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [R, F]
        spans = [torch.arange(seq.store.num_tokens - n, seq.store.num_tokens,
                              device=self.device)  # each state's token position
                 for seq, n in zip(pending, counts, strict=True)]
        positions = spans[0] if len(spans) == 1 else torch.cat(spans)
        with native.active(self.cpu_kernels):
            entries = self.model.draft.window(states[:, None], positions)[:, :, 0]
        at = 0
        for seq, n in zip(pending, counts, strict=True):
            made = entries[:, at : at + n]  # [S, n, D]
            at += n
            if seq.draft_context is not None:
                made = torch.cat((seq.draft_context, made), dim=1)
            seq.draft_context = made[:, -self.model.config.window_size :]
            seq.draft_states = None

    def _accept(self, seq: Sequence, drafts: list[int], proposed: list[torch.Tensor],
                logits: torch.Tensor, hidden: torch.Tensor) -> Verified:
        """The outputs of a verify's logits [fed, vocab]."""
        params = seq.params
        if params.temperature == 0:
            samples = sample_batch(logits, [seq] * (len(drafts) + 1))
            accepted = next((i for i, (d, s) in enumerate(zip(drafts, samples, strict=False))
                             if d != s.token), len(drafts))
            samples = samples[: accepted + 1]
        else:
            if not torch.isfinite(logits).all():
                raise FloatingPointError("non-finite logits in a DSpark verify")
            target = torch.stack([distribution(row, params) for row in logits])
            draft = torch.stack(proposed) if proposed else target[:0]
            accepted, token = speculative_accept(target, draft, drafts, seq.generator)
            samples = [Sample(t, None) for t in [*drafts[:accepted], token]]
        self.drafted_tokens += len(drafts)
        self.accepted_tokens += accepted
        self.verifies += 1
        self.verify_lengths[len(drafts)] += 1
        self.accepted_lengths[accepted] += 1
        return Verified(samples, hidden)

    @torch.no_grad()
    def settle(self, settled: list[tuple[Sequence, Verified, int]]) -> None:
        """After the caller took `kept` of each verify's outputs (its sequence's store
        still its own): the store keeps the tokens that fed them (the last sampled one and
        the drafts before the last output) and takes back the rest; the kept tokens'
        target states join the `draft_states` of each sequence that goes on, whose window
        entries its next draft makes (`make_draft_contexts`): a sequence that decodes
        plainly for a while makes them once, not every step."""
        window = self.model.config.window_size
        for seq, verified, kept in settled:
            if seq.store.speculation is not None:
                seq.store.settle(kept)
            if seq.status is not Status.FINISHED:
                keep_states(seq, verified.target_hidden[:kept], window)

    @torch.no_grad()
    def decode(self, seqs: list[Sequence]) -> list[Sample]:
        """Feed each sequence's last sampled token, all in one batch whatever their
        positions; their next tokens. Sequences DSpark drafts for keep their target
        states where a draft may read them (`decode_with_prompts`)."""
        if self.verify_in_c and any(map(self.drafts, seqs)):
            recording = self._recording(seqs, [])
            if any(recording):
                return self.decode_with_prompts(seqs, [], recording)
        logits = self.decode_logits([s.store for s in seqs], [s.output_ids[-1] for s in seqs])
        with native.active(self.cpu_kernels):  # the greedy rows by one C pass
            return sample_batch(logits, seqs)

    def joins_decode(self, seq: Sequence, n: int) -> bool:
        """Whether a prompt's last part of n tokens can run as rows of the decode step
        (`decode_with_prompts`): the C kernels run several rows of a sequence, the part is
        no longer than a window (CED prefill would run every layer over it too, and row by
        row costs no more there), it holds no picture, a prompt DSpark drafts for has the
        target states of its last window in the part (what its drafts read, as a prefill
        hands over), and its store owes no replay: a
        replay (a window of tokens through every layer, a prefix hit with no checkpoint)
        would hold up every stream and prompt of the call, so it runs as its own prefill
        after the call has handed out their tokens. One process: the ranks of a sharded
        model mirror a decode step and a prefill, not this joined call."""
        c = self.model.config
        return (self.rows_in_c and n <= c.window_size and not seq.images
                and not seq.store.replay_owed
                and (not self.drafts(seq) or n >= min(c.window_size, seq.num_tokens))
                and self.config.tensor_parallel_size == 1)

    @torch.no_grad()
    def decode_with_prompts(self, decoding: list[Sequence], prompts: list[Sequence],
                            recording: list[bool] | None = None) -> list[Sample]:
        """One model call for the decode batch and the prompts' last parts: a
        `DecodeBatch` with one row per decoding sequence and one per prompt token
        not yet in cache, each row seeing its sequence's earlier rows as sequential steps
        would; the head runs on each sequence's last row. The next token of each,
        decoding sequences first. A prompt that started on cached blocks replays first.
        A sequence DSpark drafts for (decoding plainly this step, or a prompt) keeps its
        rows' target states (`draft_states`), which its next draft reads, where
        `recording` (`_recording`'s, made here if None) says so."""
        seqs = [*decoding, *prompts]
        with native.active(self.cpu_kernels):
            for seq in prompts:
                self._catch_up(seq.store, seq.images)
            fresh = [[seq.output_ids[-1]] for seq in decoding] + [
                seq.all_ids[seq.store.num_tokens :] for seq in prompts]
            counts = [len(tokens) for tokens in fresh]
            last = [end - 1 for end in itertools.accumulate(counts)]
            ids, batch = [t for tokens in fresh for t in tokens], DecodeBatch(
                [s.store for s in seqs], counts=counts)
            if recording is None:
                recording = self._recording(decoding, prompts)
            rows = last if prompts else None  # the head on each sequence's last row
            if not any(recording):
                return sample_batch(self.model.decode(ids, batch, logit_rows=rows), seqs)
            out = self.model.verify(ids, batch, logit_rows=rows)
            samples = sample_batch(out.logits[:, 0], seqs)
        window = self.model.config.window_size
        for i, (seq, records, end, n) in enumerate(zip(seqs, recording, last, counts,
                                                       strict=True)):
            if not records:
                continue
            if i >= len(decoding):  # a prompt's part holds its last window (`joins_decode`)
                seq.draft_context = seq.draft_states = None
            keep_states(seq, out.target_hidden[end + 1 - n : end + 1, 0], window)
        return samples

    def _recording(self, decoding: list[Sequence], prompts: list[Sequence]) -> list[bool]:
        """Which sequences of a plain step (decoding ones, then joining prompts) keep
        their target states: those DSpark drafts for where a draft may read the states
        (`DraftPace.keeps_states`). One that keeps none drops what it held: that no
        longer ends at its last token. Counts the decoding ones' steps without a draft."""
        recording = []
        for i, seq in enumerate([*decoding, *prompts]):
            keeps = self.drafts(seq)
            if keeps and i < len(decoding):
                self.undrafted += 1
            size = len(decoding) if i < len(decoding) else len(decoding) + len(prompts)
            if keeps and not self.pace.keeps_states(seq, size):
                seq.draft_context = seq.draft_states = None
                keeps = False
            recording.append(keeps)
        return recording

    @torch.no_grad()
    def decode_logits(self, stores: list[PagedSequenceStore], tokens: list[int]) -> torch.Tensor:
        """One decode step of `tokens` (one per store) as one `DecodeBatch`, the step's
        plan over the block pools: logits [B, V]."""
        with native.active(self.cpu_kernels):
            return self._decode_logits(stores, tokens)

    def _decode_logits(self, stores: list[PagedSequenceStore],
                       tokens: list[int]) -> torch.Tensor:
        kernels = self.attention == "triton"
        if not self.compiled:
            return self.model.decode(tokens, DecodeBatch(stores, kernels))
        rows = next(b for b in self.buckets if b >= len(stores))
        batch = DecodeBatch(stores, kernels, rows)
        batch.mark_dynamic()
        graphs, started = _graphs(), time.perf_counter()
        logits = self.model.decode(tokens + [0] * (rows - len(stores)), batch)
        if _graphs() > graphs:
            spent = time.perf_counter() - started
            self.compile_seconds += spent
            self.compiled_graphs += _graphs() - graphs
            log.info("kvstack decode: compiled %d graph(s) for a batch of %d (bucket %d) in "
                     "%.1f s", _graphs() - graphs, len(stores), rows, spent)
        return logits[: len(stores)]

    def backend(self) -> dict[str, Any]:
        """What runs a decode step, and what compiling it has cost so far."""
        cpu_kernels = "c" if self.cpu_kernels else "torch"
        report: dict[str, Any] = {"decode": "eager", "attention": self.attention,
                                  "cpu_kernels": cpu_kernels,
                                  "matrices": str(self.model.matrix_dtype).removeprefix("torch.")}
        if self.packed_weights is not None:
            report["packed_weights"] = self.packed_weights
        if not self.compiled:
            return report
        return {**report, "decode": "torch.compile", "graphs": self.compiled_graphs,
                "compile_seconds": round(self.compile_seconds, 3), "batch_buckets": self.buckets}


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes a compiled step is padded to: powers of two below max_num_seqs,
    then max_num_seqs (a batch pads to at most twice its size, and a server that runs
    up to max_num_seqs compiles at most log2 of it + 1 step graphs)."""
    return [1 << i for i in range(max(0, max_num_seqs - 1).bit_length())
            if 1 << i < max_num_seqs] + [max_num_seqs]


def _attention_backend(choice: str, model: Model, device: torch.device) -> str:
    """"triton" or "torch" for an EngineConfig.attention choice; a "triton" that cannot
    run here is refused, naming why."""
    c = model.config
    why = None
    if importlib.util.find_spec("triton") is None:
        why = "triton is not installed (pip install triton)"
    elif device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        why = f"the model is on {device.type}, and Triton kernels run on CUDA devices"
    elif c.arch != "v41":
        why = "the dense control has no window rings or compressed streams"
    else:
        from kvstack.cache.kernels import INDEX_FORMAT, KV_FORMAT, WINDOW_FORMAT

        if ((c.window_format, c.kv_format, c.index_format)
                != (WINDOW_FORMAT, KV_FORMAT, INDEX_FORMAT)):
            why = (f"the kernels read {WINDOW_FORMAT} window rings, {KV_FORMAT} kv streams "
                   f"and {INDEX_FORMAT} index streams, the model's are {c.window_format}, "
                   f"{c.kv_format} and {c.index_format}")
    if choice == "triton" and why is not None:
        raise ValueError(f"attention='triton': {why}")
    # auto is torch: on an H200 (bench/sparse_kernels.py, V4.1-Flash shapes, batch 32) the
    # one-program-per-head kernel took 5x torch's time; its split-K rewrite has not been
    # timed on a GPU yet, so the default waits for a measurement.
    return "torch" if choice == "auto" else choice


def keep_states(seq: Sequence, states: torch.Tensor, window: int) -> None:
    """Add a step's kept target states [n, len(targets) * dim] to the sequence's
    `draft_states`, a list of such pieces (copied: a piece of the step's output would hold
    all of it), at most a window of them, each of at least one token's: no copy of what
    is held, and nothing counted, per step."""
    pieces = seq.draft_states if seq.draft_states is not None else []
    pieces.append(states[-window:].clone())
    if len(pieces) > window:
        del pieces[0]
    seq.draft_states = pieces


def verify_lengths(confidence: torch.Tensor, limits: list[int]) -> list[int]:
    """How many of each block's drafts to verify, from the confidence head's logits
    [B, K]: the leading drafts whose chance that they and every draft before them survive
    (the product of their sigmoids) is at least MIN_SURVIVAL, at most the row's limit."""
    survival = torch.sigmoid(confidence.float()).cumprod(1)
    confident = (survival >= MIN_SURVIVAL).sum(1).tolist()
    return [max(0, min(limit, n)) for limit, n in zip(limits, confident, strict=True)]


# A draft worth verifying: in a verify step each more row costs about a tenth of a
# one-row step (bench/speculative.py at batch 1 on a CPU: 2.22 ms for one row and 3.25 ms
# for eight on tiny-v41-dspark, 1.88 and 3.84 on the bundled model's shape; the step's
# weights are read once for all its rows), so a draft is
# verified while the chance that it is kept is at least 0.1, the token it would add worth
# more than the row it costs.
MIN_SURVIVAL = 0.1


def _speculative(choice: str, model: Model) -> bool:
    """Whether DSpark drafts, for an EngineConfig.speculative choice; "dspark" on a model
    without draft layers is refused."""
    if choice == "none":
        return False
    if not model.config.has_draft or model.draft is None:
        raise ValueError("speculative='dspark': the model has no DSpark draft layers "
                         "(mtp.* in the checkpoint; n_mtp_layers and dspark_block_size "
                         "in its config)")
    return True


def _speculative_tokens(choice: int | None, model: Model) -> int:
    """The most drafts a verify feeds, for an EngineConfig.speculative_tokens choice: at
    most the draft's block, the length it was trained to propose."""
    block = model.config.dspark_block_size
    if choice is not None and choice > block:
        raise ValueError(f"speculative_tokens {choice}: the model's DSpark draft proposes "
                         f"blocks of {block} (dspark_block_size, what it was trained for); "
                         f"choose 1..{block}")
    return block if choice is None else choice


def _cpu_kernels(choice: str, device: torch.device) -> bool:
    """Whether the C kernels run a step, for an EngineConfig.cpu_kernels choice: they read
    host memory, so on another device "c" is refused and "auto" is torch."""
    if device.type != "cpu":
        if choice == "c":
            raise ValueError(f"cpu_kernels='c': the model is on {device.type}, and the C "
                             "kernels run on a CPU")
        return False
    return native.resolve(choice)


def _packed_weights_backend(model: Model, device: torch.device, cpu_kernels: bool) -> str | None:
    """What multiplies the model's packed checkpoint weights (None: it has none)."""
    if not any(isinstance(m, PackedLinear | PackedExperts) for m in model.modules()):
        return None
    if device.type == "cpu" and cpu_kernels:
        return f"C kernels ({native.weights_isa()}), decoded in registers"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "Triton kernels (FP8, FP4), decoded in registers; bf16 dequantised per call"
    return "torch, dequantised to float32 per call"


def _graphs() -> int:
    """Graphs torch.compile has made in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
