"""Runs the model for the sequences a step scheduled, and samples their next tokens."""

import torch

from kvstack.cache.batch import DecodeBatch
from kvstack.engine.sampling import Sample, sample_batch
from kvstack.engine.sequence import Sequence
from kvstack.model import Model


class ModelRunner:
    def __init__(self, model: Model, replay: str, chunk_size: int) -> None:
        self.model, self.replay, self.chunk_size = model, replay, chunk_size
        self.device = model.embed.weight.device
        self.replayed_tokens = 0  # tokens re-run to rebuild window state, since start

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
        logits = self.model.decode([s.output_ids[-1] for s in seqs], batch)
        return sample_batch(logits, seqs)
