"""A request as the engine tracks it, and what the caller gets back."""

import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING

import torch

from kvstack.cache.paged import PagedSequenceStore
from kvstack.cache.prefix import ImageKey
from kvstack.engine.sampling import SamplingParams, TokenLogprobs
from kvstack.model.vision import ImageSegment

if TYPE_CHECKING:
    from kvstack.engine.grammar import Matcher
    from kvstack.engine.output import Detokenizer


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DraftPause:
    """Where DSpark's measured schedule (`kvstack.engine.pace`) left a sequence."""

    steps_left: int = 0  # plain steps before it may draft again
    length: int = 1  # the pause after its next verify that does not pay
    kept: int | None = None  # what its last verify kept, if that paid (None: it tries)
    idle: int = 0  # steps since it last drafted
    run_gain: float = 0.0  # tokens over break-even since its last try


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    images: list[ImageSegment] = field(default_factory=list)  # the images its prompt holds
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token, if asked
    text: str = ""
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    store: PagedSequenceStore | None = None  # while it holds cache
    generator: torch.Generator | None = None
    keep_cache: bool = False  # keep the store after finishing, for a follow-up turn
    cache_salt: str | None = None  # the prefix-cache partition it reads and writes
    end_ids: frozenset[int] = frozenset()  # tokens that end it (eos unless ignored, stop ids)
    grammar: "Matcher | None" = None  # its structured-output matcher, if constrained
    # Its kept cache is evicted only after its owner saved it (`end_hold`) or
    # KEPT_HOLD_S after it finished: a session's save must find the blocks it just wrote.
    hold_kept: bool = False
    preemptions: int = 0
    faults: int = 0  # steps that failed while advancing it (rolled back, recomputed)
    suspect: bool = False  # its last batch failed: it decodes alone next
    prefilling: bool = False  # admitted, its prompt not yet all in cache
    detokenizer: "Detokenizer | None" = None  # its text, token by token
    # What DSpark drafts from (the engine's speculative="dspark"): every draft stage's
    # window entries [stages, n <= window, head_dim] of the last n tokens its store holds
    # (`Draft.window`, made once as each token is kept).
    draft_context: torch.Tensor | None = None
    # The target states of the last tokens its store holds whose entries are not made yet
    # (the tokens kept since its last draft, the last window of steps'): pieces
    # [n, len(targets) * dim], oldest first.
    draft_states: list[torch.Tensor] | None = None
    draft_pause: DraftPause = field(default_factory=DraftPause)
    # Prompt tokens whose cache was reused: found in the prefix cache at admission, or held
    # by the kept cache of the conversation it continues.
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def image_keys(self) -> tuple[ImageKey, ...]:
        return image_keys(self.images)


def image_keys(segments: list[ImageSegment]) -> tuple[ImageKey, ...]:
    """Image segments as the prefix cache names blocks by them."""
    return tuple((s.start, s.stop, bytes.fromhex(s.image.digest)) for s in segments)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # The output's text; None as the engine's step hands it over, until `with_text` makes
    # it (the front ends do, on their own thread: kvstack.engine.output).
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    finished: bool
    error: str | None
    metrics: dict[str, float]
    num_cached_tokens: int = 0  # prompt tokens whose cache was reused (prefix, kept turn)
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked
    # What makes the text where the step did not (a request without stop strings).
    detokenizer: "Detokenizer | None" = field(default=None, repr=False, compare=False)

    def with_text(self) -> "RequestOutput":
        """This output with its text made (itself where it has it)."""
        if self.text is not None or self.detokenizer is None:
            return self
        text = self.detokenizer.text_for(self.token_ids, self.finished,
                                         flush=self.finish_reason != "stop")
        return replace(self, text=text, detokenizer=None)

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        metrics: dict[str, float] = {"preemptions": seq.preemptions}
        if seq.first_token_time is not None:
            metrics["time_to_first_token_s"] = seq.first_token_time - seq.arrival_time
            end = seq.finish_time or time.perf_counter()
            if len(seq.output_ids) > 1 and end > seq.first_token_time:
                metrics["decode_tokens_per_s"] = (len(seq.output_ids) - 1) / (
                    end - seq.first_token_time)
        in_step = detokenizes_in_step(seq.params)
        return cls(seq.request_id, seq.prompt, list(seq.prompt_ids),
                   seq.text if in_step else None, list(seq.output_ids), seq.finish_reason,
                   seq.status is Status.FINISHED, seq.error, metrics, seq.num_cached_tokens,
                   list(seq.logprobs) if seq.params.logprobs is not None else None,
                   None if in_step else seq.detokenizer)


def detokenizes_in_step(params: SamplingParams) -> bool:
    """Whether the engine's step makes a request's text: where a stop string may end it."""
    return bool(params.stop)
