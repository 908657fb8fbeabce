"""Runs the model for the sequences a step scheduled, and samples their next tokens."""

import logging
import time
from typing import Any

import torch

from kvstack.cache.batch import DecodeBatch
from kvstack.engine.sampling import Sample, sample_batch
from kvstack.engine.sequence import Sequence
from kvstack.model import Model

log = logging.getLogger("kvstack")


class ModelRunner:
    def __init__(self, model: Model, replay: str, chunk_size: int,
                 compile_decode: bool = False) -> None:
        self.model, self.replay, self.chunk_size = model, replay, chunk_size
        self.device = model.embed.weight.device
        self.replayed_tokens = 0  # tokens re-run to rebuild window state, since start
        self.compiled = compile_decode
        self.compile_seconds = 0.0  # decode steps that compiled a graph, in all
        if compile_decode:
            model.compile_decode()
        log.info("kvstack decode: %s", "torch.compile (inductor, one graph per layer, "
                 "compiled on the first decode step)" if compile_decode else "eager torch")

    @torch.no_grad()
    def prefill(self, seq: Sequence) -> Sample:
        """Feed the sequence's tokens its store does not hold yet (the prompt, what it
        generated before a preemption, or a follow-up turn) through CED prefill; the
        next token."""
        return sample_batch(self.prefill_logits(seq), [seq])[0]

    @torch.no_grad()
    def prefill_logits(self, seq: Sequence) -> torch.Tensor:
        """The prefill's last logits [1, V]. A store started on cached blocks first
        rebuilds its window rings and partial groups by replay (`bounded` or `exact`)."""
        store = seq.store
        if store.needs_replay:
            self.replayed_tokens += self.model.rebuild_spans(store.num_tokens, self.replay)[0]
            self.model.rebuild_window(store, replay=self.replay, chunk_size=self.chunk_size)
            store.needs_replay = False
        fresh = seq.all_ids[store.num_tokens :]
        ids = torch.tensor([fresh], dtype=torch.long, device=self.device)
        return self.model.prefill(ids, store, replay=self.replay, chunk_size=self.chunk_size)

    @torch.no_grad()
    def decode(self, seqs: list[Sequence]) -> list[Sample]:
        """Feed each sequence's last sampled token, all in one batch whatever their
        positions (one `DecodeBatch`: the step's plan over the block pools); their next
        tokens."""
        batch = DecodeBatch([s.store for s in seqs])
        if not self.compiled:
            return sample_batch(self.model.decode([s.output_ids[-1] for s in seqs], batch), seqs)
        graphs, started = _graphs(), time.perf_counter()
        samples = sample_batch(self.model.decode([s.output_ids[-1] for s in seqs], batch), seqs)
        if _graphs() > graphs:
            spent = time.perf_counter() - started
            self.compile_seconds += spent
            log.info("kvstack decode: compiled %d graph(s) for a batch of %d in %.1f s",
                     _graphs() - graphs, len(seqs), spent)
        return samples

    def backend(self) -> dict[str, Any]:
        """What runs a decode step, and what compiling it has cost so far."""
        if not self.compiled:
            return {"decode": "eager"}
        return {"decode": "torch.compile", "graphs": _graphs(),
                "compile_seconds": round(self.compile_seconds, 3)}


def _graphs() -> int:
    """Graphs torch.compile has made in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
