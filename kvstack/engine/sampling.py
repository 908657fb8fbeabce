"""Sampling parameters and the sampler, with vLLM's names."""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from kvstack import native

if TYPE_CHECKING:
    from kvstack.engine.grammar import Matcher


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties on tokens generated so far: presence subtracts once per token
    # that occurred, frequency once per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's / HF's: logits of tokens in the prompt or the output are divided by it (if
    # positive; multiplied if negative).
    repetition_penalty: float = 1.0
    # Log-probabilities to return per token: None none, 0 the sampled token's, k also
    # the k likeliest (from the model's raw distribution, before penalties and
    # temperature, as vLLM reports them).
    logprobs: int | None = None
    # vLLM's: no end of sequence, stop token or stop string before this many tokens.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: these tokens end the reply too
    # OpenAI's: added to a token's logit before sampling, -100..100 ((id, bias) pairs).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A JSON schema (as JSON text) the reply must match, enforced token by token
    # (`kvstack.engine.grammar`); '{"type": "object"}' is any JSON object.
    json_schema: str | None = None
    # Or an xgrammar structural tag (JSON text; vLLM's `structural_tag`): literal text and
    # JSON in a set order, e.g. a tool call between the markers of its model's syntax. Its
    # JSON is compact as json_schema's is (no whitespace but after `,` and `:`).
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        def number(x: object) -> bool:  # True is an int to Python, not a number here
            return isinstance(x, int | float) and not isinstance(x, bool)

        checks = (
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and 1 <= self.max_tokens <= 1 << 24,
             f"max_tokens must be an integer from 1 to {1 << 24}, got {self.max_tokens!r}"),
            (number(self.temperature) and math.isfinite(self.temperature)
             and 0 <= self.temperature <= 100,
             f"temperature must be between 0 and 100, got {self.temperature!r}"),
            (number(self.top_p) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
             and self.top_k >= 0,
             f"top_k must be a non-negative integer (0: no limit), got {self.top_k!r}"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and 0 <= self.seed < 1 << 64),
             f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}"),
            (isinstance(self.ignore_eos, bool),
             f"ignore_eos must be True or False, got {self.ignore_eos!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop must be non-empty strings, got {self.stop!r}"),
            (number(self.presence_penalty)
             and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be between -2 and 2, got {self.presence_penalty!r}"),
            (number(self.frequency_penalty)
             and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty!r}"),
            (number(self.repetition_penalty)
             and 0 < self.repetition_penalty <= 10,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int)
                                       and not isinstance(self.logprobs, bool)
                                       and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer from 0 to 20, got {self.logprobs!r}"),
            (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
             and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer from 0 to max_tokens, got {self.min_tokens!r}"),
            (all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                 for t in self.stop_token_ids),
             f"stop_token_ids must be token ids, got {self.stop_token_ids!r}"),
            (all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int)
                 and not isinstance(pair[0], bool) and pair[0] >= 0 and number(pair[1])
                 and -100 <= pair[1] <= 100 for pair in self.logit_bias),
             f"logit_bias must map token ids to biases from -100 to 100, got "
             f"{dict(self.logit_bias)!r}"),
            (self.json_schema is None or isinstance(self.json_schema, str),
             f"json_schema must be a JSON schema as text, got {type(self.json_schema)}"),
            (self.structural_tag is None or (isinstance(self.structural_tag, str)
                                             and self.json_schema is None),
             "structural_tag must be a structural tag as text, and not with json_schema"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

    @property
    def constrained(self) -> bool:
        """Whether a grammar holds the reply (json_schema or structural_tag)."""
        return self.json_schema is not None or self.structural_tag is not None

    @property
    def penalised(self) -> bool:
        """Whether its logits are changed before sampling (penalties, biases, ends held
        back): a row of its own in the sampler (a grammar's mask is applied apart, to all
        the constrained rows of a batch at once)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or bool(self.logit_bias)
                or self.min_tokens > 0)


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability and the likeliest tokens' [(id, logprob)]."""

    logprob: float
    top: tuple[tuple[int, float], ...]


class PromptLogprob(NamedTuple):
    """A prompt token's log-probability given the tokens before it, its rank among every
    token (1: the likeliest), and the likeliest tokens' [(id, logprob)]."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


class Sample(NamedTuple):
    token: int
    logprobs: TokenLogprobs | None


class Sampled(Protocol):
    """What the sampler reads of a request (`kvstack.engine.sequence.Sequence`)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    end_ids: frozenset[int]  # tokens that end it: end of sequence, stop_token_ids
    grammar: "Matcher | None"  # its structured-output matcher, if any


def penalise(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
             output_ids: Sequence[int], end_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """Next-token logits [vocab] with the repetition, presence and frequency penalties,
    the logit biases, and before min_tokens the ending tokens ruled out."""
    logits = logits.float().clone()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        logits[list(ids)] += torch.tensor(biases, device=logits.device)
    if len(output_ids) < params.min_tokens and end_ids:
        logits[sorted(end_ids)] = float("-inf")
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long,
                            device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                   picked * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device),
                                minlength=logits.shape[-1]).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """One token id from next-token logits [vocab] (penalties already applied)."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = distribution(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What `sample` draws from (temperature > 0): probabilities [vocab] on the host,
    after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        probs, order = logits.softmax(-1).sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits[order[drop]] = float("-inf")
    return logits.softmax(-1).cpu()


def speculative_accept(target: torch.Tensor, draft: torch.Tensor, drafts: list[int],
                       generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling's rule over n drafted tokens: target [n + 1, vocab] and
    draft [n, vocab], the distributions (`distribution`) the target and the draft give at
    each position, drafts [n] drawn from the draft's. Each draft in turn is kept with
    probability min(1, target/draft) of its token; the first one refused is replaced by a
    draw from the target's excess over the draft (max(0, target - draft), normalised), and
    if none is refused a last token is drawn from the target's next distribution. Each
    token then follows the target's distribution exactly. Returns (drafts kept, the token
    after them)."""
    for i, token in enumerate(drafts):
        u = float(torch.rand((), generator=generator))
        if u * float(draft[i, token]) < float(target[i, token]):
            continue
        excess = (target[i] - draft[i]).clamp(min=0)
        return i, int(torch.multinomial(excess / excess.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(target[len(drafts)], 1, generator=generator))


def sample_batch(logits: torch.Tensor, requests: Sequence[Sampled]) -> list[Sample]:
    """One token per row of logits [B, vocab]: the plain greedy rows by one argmax, read
    back with each row's finiteness in one copy to the host; the rows held to a grammar
    masked together (one bitmask, one application), their greedy ones by one more argmax;
    the others (sampled, penalised, or asking for log-probabilities) one by one.
    Non-finite logits (a fault somewhere in the step: nothing on the way was looked at)
    raise FloatingPointError rather than yield a token."""
    if native.fuses(logits) and logits.dim() == 2:  # one C pass inside an engine step
        greedy_ids = native.greedy(logits)
        finite_rows = [token >= 0 for token in greedy_ids]
    else:
        argmax, finite = logits.argmax(-1), torch.isfinite(logits).all(-1)
        greedy_ids, finite_rows = torch.stack((argmax, finite.long())).tolist()
    if not all(finite_rows):
        bad = [i for i, ok in enumerate(finite_rows) if not ok]
        raise FloatingPointError(f"non-finite logits in rows {bad} of a decode batch of "
                                 f"{len(finite_rows)}")
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    masked: dict[int, torch.Tensor] = {}
    if constrained:
        from kvstack.engine.grammar import mask_rows

        rows = mask_rows(logits, constrained, [requests[i].grammar for i in constrained])
        masked = dict(zip(constrained, rows, strict=True))
        for i, token in zip(constrained, rows.argmax(-1).tolist(), strict=True):
            greedy_ids[i] = token
    samples = []
    for i, r in enumerate(requests):
        p = r.params
        if p.temperature == 0 and not p.penalised and p.logprobs is None:
            samples.append(Sample(greedy_ids[i], None))
            continue
        row = masked.get(i, logits[i])
        if p.penalised:
            row = penalise(row, p, r.prompt_ids, r.output_ids, r.end_ids)
        token = sample(row, p, r.generator)
        entry = None
        if p.logprobs is not None:
            logprobs = logits[i].float().log_softmax(-1)
            top = torch.topk(logprobs, p.logprobs) if p.logprobs else None
            entry = TokenLogprobs(float(logprobs[token]), tuple(zip(
                top.indices.tolist(), top.values.tolist(), strict=True)) if top else ())
        samples.append(Sample(token, entry))
    return samples
