"""Research instruments on the reference forward (`Model.forward(..., instruments=)`):
what `kvstack eval` asks of attention beyond the model itself -- where each layer's
attention went, which layers' compressed attention retrieval needs, what a perfect
indexer and a sharper read would buy -- and what it records. Inference and training never
make one: a forward without one is the model as it is served and trained."""

from dataclasses import dataclass, field

import torch

from kvstack.config import LayerSpec


@dataclass
class Instruments:
    # Record where each layer's attention went (`attention_mass`, `kvstack eval attention`).
    probe: bool = False
    # Layers that attend to their window and sink only, their compressed entries left out
    # (their streams, indexers and top-k still serve later layers): what each layer's
    # compressed attention is needed for (`kvstack eval knockout`).
    window_only: frozenset[int] = frozenset()
    # What a perfect indexer would buy (`kvstack eval selection`): each picking layer
    # ranks entries by its own attention logits (logsumexp over heads) instead of its
    # indexer's scores; and layer -> a factor on its attention logits (sharper or flatter).
    trunk_picks: bool = False
    logit_scale: dict[int, float] = field(default_factory=dict)
    # probe: layer -> [B, T, 5]: window, near and far compressed, sink, near share
    attention_mass: dict[int, torch.Tensor] = field(default_factory=dict, init=False)

    def attach(self, n_layers: int, sharded: bool) -> None:
        """Check the settings against the model a forward is about to run, and drop what
        an earlier forward recorded (probe rows are appended query tile by query tile)."""
        unknown = sorted(set(self.logit_scale) - set(range(n_layers)))
        if unknown:
            raise ValueError(f"logit_scale: no layer {unknown[0]} (the model has {n_layers})")
        if sharded and (self.probe or self.trunk_picks):
            raise ValueError("probe and trunk_picks read every head's attention, and this "
                             "rank holds a shard of them")
        self.attention_mass = {}

    def logit_factor(self, layer: int) -> float:
        return self.logit_scale.get(layer, 1.0)

    def record_mass(self, spec: LayerSpec, window_size: int, probs: torch.Tensor, m: int,
                    positions: torch.Tensor, selected: torch.Tensor | None) -> None:
        """From one query tile's attention probs [B, H, q, m + k + 1] (window, compressed
        entries, sink), per query, averaged over heads: attention on the window, on
        compressed entries whose group ends inside the window ("near", the window holds
        those tokens raw) and beyond it ("far"), on the sink; and the share of the
        selected entries [B, q, k] that are near (NaN without a top-k). [B, q, 5],
        appended to attention_mass[layer]."""
        r = spec.ratio
        p = probs.mean(1)  # [B, q, m + k + 1]
        compressed = p[..., m:-1]
        top_k = selected is not None
        if not top_k:  # dense or window-only: every entry, in order
            selected = torch.arange(compressed.shape[-1], device=p.device).expand_as(compressed)
        far = (selected >= 0) & (selected * r + r - 1 <= positions[..., None] - window_size)
        far_mass = (compressed * far).sum(-1)
        chosen = (selected >= 0).sum(-1)
        near_share = torch.where((chosen > 0) & top_k, 1 - far.sum(-1) / chosen.clamp(min=1),
                                 float("nan"))
        row = torch.stack((p[..., :m].sum(-1), compressed.sum(-1) - far_mass, far_mass,
                           p[..., -1], near_share), dim=-1)
        prev = self.attention_mass.get(spec.index)
        self.attention_mass[spec.index] = row if prev is None else torch.cat((prev, row), 1)
