"""Sampling parameters and the sampler, with vLLM's names."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        checks = (
            (isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= 1 << 24,
             f"max_tokens must be an integer from 1 to {1 << 24}, got {self.max_tokens!r}"),
            (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
             and 0 <= self.temperature <= 100,
             f"temperature must be between 0 and 100, got {self.temperature!r}"),
            (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be a non-negative integer (0: no limit), got {self.top_k!r}"),
            (self.seed is None or isinstance(self.seed, int),
             f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop must be non-empty strings, got {self.stop!r}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """One token id from next-token logits [vocab]."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        probs, order = logits.softmax(-1).sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits[order[drop]] = float("-inf")
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def sample_batch(logits: torch.Tensor,
                 requests: list[tuple[SamplingParams, torch.Generator | None]]) -> list[int]:
    """One token id per row of logits [B, vocab]: the greedy rows by one argmax, read back
    with each row's finiteness in one copy to the host, the others one by one. Non-finite
    logits (a fault somewhere in the step: nothing on the way was looked at) raise
    FloatingPointError rather than yield a token."""
    argmax, finite = logits.argmax(-1), torch.isfinite(logits).all(-1)
    greedy_ids, finite_rows = torch.stack((argmax, finite.long())).tolist()
    if not all(finite_rows):
        bad = [i for i, ok in enumerate(finite_rows) if not ok]
        raise FloatingPointError(f"non-finite logits in rows {bad} of a decode batch of "
                                 f"{len(finite_rows)}")
    tokens = [greedy_ids[i] if params.temperature == 0 else 0
              for i, (params, _) in enumerate(requests)]
    for i, (params, generator) in enumerate(requests):
        if params.temperature != 0:
            tokens[i] = sample(logits[i], params, generator)
    return tokens
