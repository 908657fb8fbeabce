"""The engine core: the one owner of the step (vLLM v1's EngineCore, nano-vllm's engine).

It holds the scheduler, the model runner and the paged cache, admits requests, runs one
step at a time and routes every request's outputs to whoever waits for it. Front ends
(`LLM.generate`, `LLM.stream`, `Session`, the CLI) add requests and wait on their own ids;
any number of them can interleave, each seeing exactly its own outputs.

A step is atomic for its requests: when the model fails inside one (a kernel error, out
of memory, a bug), the requests it was advancing are rolled back to what they had before
it -- their caches freed, to be recomputed from their tokens as after a preemption -- and
a request that fails MAX_FAULTS times without a decode step between finishes with
`finish_reason="error"` and the message, while the others go on. A batch that failed is
not retried as a batch: its requests decode one at a time until each has stepped once, so
one bad request cannot take others down.
"""

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvstack.cache.disk import DiskTier
from kvstack.cache.paged import PagedCache
from kvstack.cache.prefix import chain_seed
from kvstack.engine.config import EngineConfig
from kvstack.engine.grammar import Grammars
from kvstack.engine.output import Detokenizer, OutputRouter
from kvstack.engine.runner import ModelRunner, Verified
from kvstack.engine.sampling import Sample, SamplingParams
from kvstack.engine.scheduler import Scheduler
from kvstack.engine.sequence import RequestOutput, Sequence, Status, detokenizes_in_step
from kvstack.engine.tokenizer import Tokenizer
from kvstack.model import Model
from kvstack.model.vision import ImageSegment

log = logging.getLogger("kvstack")
MAX_FAULTS = 2  # failed steps in a row (no decode between) before a request ends in error


class EngineError(RuntimeError):
    """The engine could not go on (not a bad request: those are ValueError)."""


F = TypeVar("F", bound=Callable[..., Any])


def locked(method: F) -> F:
    """Run the method holding the core's lock: front ends on several threads take turns
    at the core, one call at a time."""
    @functools.wraps(method)
    def run(self: "EngineCore", *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


class EngineCore:
    def __init__(self, model: Model, tokenizer: Tokenizer, config: EngineConfig,
                 fingerprint: str, disk_tier: DiskTier | None = None,
                 workers: list[Any] | None = None) -> None:
        """disk_tier: the disk tier of the prefix cache (named blocks are written through
        to it, and what the host tier gives up goes there); None: no disk tier. workers:
        the processes of ranks 1.. of a sharded model (`kvstack.engine.workers`), which
        every model call then runs on too."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = config.model_len(model.config)
        self.limit_name = "max_seq_len" if config.max_model_len is None else "max_model_len"
        seed = (chain_seed(fingerprint, config.block_tokens) if config.enable_prefix_caching
                else None)
        self.cache = PagedCache(model.config, config.kv_budget, config.block_tokens,
                                config.max_num_seqs, model.embed.weight.device, seed,
                                config.host_budget_bytes, disk_tier,
                                pad_slot=config.compile_decode,
                                window_checkpoints=config.kept_window_checkpoints)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs,
                                   config.max_num_batched_tokens,
                                   model.final_prefill_tokens(config.replay),
                                   lambda cached: model.rebuild_spans(cached, config.replay)[0])
        if workers is None:
            self.runner = ModelRunner(model, config)
        else:
            from kvstack.engine.workers import ParallelRunner

            self.runner = ParallelRunner(model, config, self.cache, workers)
        self.stopped: str | None = None  # why the engine cannot go on (a lost rank)
        self.router = OutputRouter()
        self.grammars = Grammars(tokenizer, model.config.vocab_size)  # constrained replies
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._idle_steps = 0
        # Held by every call that reads or changes requests or the cache (re-entrant: a
        # wait steps while holding it); a front end reading the cache takes it too.
        self.lock = threading.RLock()
        # Set by a front end whose requests reach the core between steps (AsyncLLM): true
        # while one waits to be added. A step then ends after its current prompt call,
        # the prompts it had left staying planned for the next, so that the newcomer is
        # scheduled at once (a short one joins the next decode call) instead of waiting
        # behind every prompt this step had left.
        self.arrivals: Callable[[], bool] | None = None

    # ---- requests ----------------------------------------------------------------------
    @locked
    def add_request(self, ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, continue_from: str | None = None,
                    keep_cache: bool = False, watch: bool = False,
                    on_output: Callable[[RequestOutput], None] | None = None,
                    cache_salt: str | None = None, hold_kept: bool = False,
                    images: list[ImageSegment] | None = None) -> str:
        """Queue a request of token ids; it joins the running batch at the next step. Bad
        input raises ValueError here, before anything is queued. `watch`: route its
        outputs to `wait` (front ends that wait on it say so); `on_output`: hand each of
        its outputs to this callback, on the thread of the step that made it.

        continue_from: a finished request that kept its cache (keep_cache=True); the new
        ids follow its tokens and only they are prefilled (multi-turn chat), in the
        conversation's own cache salt. cache_salt: the prefix-cache partition the request
        reads and adds to (None: the shared one); requests of other salts never hit its
        blocks (tenants of one server). hold_kept: with keep_cache, the kept cache is not
        evicted for room until `end_hold` (or a few seconds): its owner saves it.
        images: the images whose segments the ids hold, placed from the ids' first position
        (`kvstack.engine.images.expand_images` makes both)."""
        if self.failure is not None:
            raise EngineError(self.failure)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        previous = None
        if continue_from is not None:
            previous = self.requests.get(continue_from)
            if previous is None or previous.status is not Status.FINISHED:
                raise ValueError(f"request {continue_from!r} is not a finished request to "
                                 "continue")
        segments = self._image_segments(ids, images or [], previous)
        if previous is not None:
            ids = previous.all_ids + ids
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room under "
                             f"{self.limit_name} {self.max_model_len}")
        capacity = self.cache.capacity_tokens
        if len(ids) + 1 > capacity:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the cache pool of "
                             f"{capacity} tokens (kv_budget {self.cache.budget:,} bytes)")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        vocab = self.cache.config.vocab_size
        bad = [t for t in (*params.stop_token_ids, *(t for t, _ in params.logit_bias))
               if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} in stop_token_ids or logit_bias are "
                             f"outside the vocabulary 0..{vocab - 1}")
        end_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos or self.tokenizer.eos_id is None
            else frozenset({self.tokenizer.eos_id}))
        grammar = self.grammars.matcher(params) if params.constrained else None
        if previous is not None:  # a conversation stays in its own partition
            cache_salt = previous.cache_salt
        seq = Sequence(request_id, ids, params, prompt, images=segments, generator=generator,
                       keep_cache=keep_cache, cache_salt=cache_salt, hold_kept=hold_kept,
                       end_ids=end_ids, grammar=grammar,
                       detokenizer=Detokenizer(self.tokenizer, tuple(params.stop)))
        if previous is not None:
            # The kept store (if not evicted for room meanwhile) moves to the new request.
            if self.scheduler.take_kept(continue_from) is not None:
                seq.store, previous.store = previous.store, None
                seq.num_cached_tokens = seq.store.num_tokens if seq.store else 0
            self.requests.pop(continue_from)
        self.requests[request_id] = seq
        if watch:
            self.router.watch(request_id)
        if on_output is not None:
            self.router.subscribe(request_id, on_output)
        self.scheduler.add(seq)
        return request_id

    def _image_segments(self, ids: list[int], images: list[ImageSegment],
                     previous: Sequence | None) -> list[ImageSegment]:
        """The sequence's image segments (a continued conversation's, then these, placed after
        its tokens), checked: the image token marks exactly the segments' positions."""
        c = self.model.config
        if images and not c.has_vision:
            raise ValueError("this model has no vision tower (vision_n_layers is 0): it "
                             "takes text only")
        if not c.has_vision:
            return []
        covered = [False] * len(ids)
        for segment in images:
            if not 0 <= segment.start < segment.stop <= len(ids) or any(
                    covered[segment.start : segment.stop]):
                raise ValueError(f"an image segment at {segment.start}..{segment.stop - 1} lies "
                                 f"outside the prompt's {len(ids)} tokens or overlaps another")
            covered[segment.start : segment.stop] = [True] * (segment.stop - segment.start)
        for i, (t, inside) in enumerate(zip(ids, covered, strict=True)):
            if (t == c.image_token_id) != inside:
                raise ValueError(f"prompt position {i}: the image token id "
                                 f"({c.image_token_id}) must mark exactly the positions of "
                                 "the images' segments (a placeholder per image, expanded)")
        offset = 0 if previous is None else previous.num_tokens
        before = [] if previous is None else previous.images
        return before + [ImageSegment(s.start + offset, s.image) for s in images]

    @locked
    def end_hold(self, request_id: str) -> None:
        """Its owner has saved the kept cache: it may be evicted for room again."""
        if (seq := self.requests.get(request_id)) is not None:
            seq.hold_kept = False

    @locked
    def adopt(self, seq: Sequence) -> str:
        """Take in a finished sequence made outside a step (a resumed session)."""
        seq.request_id = str(next(self._ids))
        self.requests[seq.request_id] = seq
        return seq.request_id

    @locked
    def release(self, request_id: str) -> None:
        """Drop the cache a finished request kept for a follow-up turn."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.release(seq)

    @locked
    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and seq.status is not Status.FINISHED:
            self._finish(seq, "abort")
            self.requests.pop(request_id)
            self.router.put(RequestOutput.of(seq))  # a waiting front end ends too

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ----------------------------------------------------------------------
    @locked
    def step(self) -> list[RequestOutput]:
        """One scheduler step: decode the running sequences, then prefill prompts (or
        parts of long ones) in the rest of the step's token budget. A prompt whose rest
        fits a window (`ModelRunner.joins_decode`) runs as rows of the decode call, so
        that one model call serves the batch and every such prompt. Returns the output of
        every request that moved (and of every one that finished, however); each also goes
        to the front end waiting for it as soon as the model call that moved it returns
        (the decode call's, then each other prompt's, the cheapest first: `_prefill_cost`),
        not at the end of the step: a step that prefills several prompts one after another
        hands out their first tokens, and the running streams' next ones, as they come. A
        request arriving meanwhile (`arrivals`) ends the step after the current call."""
        plan = self.scheduler.schedule()
        unservable = self.scheduler.take_unservable()
        for seq in unservable:
            self._finish(seq, "length")
        outputs = self._outputs(unservable)
        if not plan:
            self._idle_steps = self._idle_steps + 1 if self.scheduler.has_work else 0
            if self._idle_steps > 1 and not self.scheduler.holding:
                raise EngineError(
                    f"the scheduler can run none of its {len(self.scheduler.waiting)} waiting "
                    f"and {len(self.scheduler.running)} running requests "
                    f"({self.cache.free_blocks} free blocks)")
            return outputs
        self._idle_steps = 0
        drafting = [seq for seq in plan.decode if self.runner.drafts(seq)]
        decoding = [seq for seq in plan.decode if not self.runner.drafts(seq)]
        chosen = self.runner.drafting(drafting) if drafting else None
        undrafted = bool(drafting) and chosen is None  # DSpark's, none drafting this step
        if undrafted:  # one decode call for all
            decoding, drafting = plan.decode, []
        # Prompts whose last part runs as rows of the decode step: one model call for all
        # (one whose batch failed prefills alone, so that it fails no other again).
        joining = [seq for seq, n in plan.prefill
                   if n == seq.num_tokens - seq.store.num_tokens and not seq.suspect
                   and self.runner.joins_decode(seq, n)]
        plan.prefill = [(seq, n) for seq, n in plan.prefill
                        if not any(seq is other for other in joining)]
        if decoding or joining:
            together = decoding + joining
            started = time.perf_counter()
            try:
                samples = (self.runner.decode_with_prompts(decoding, joining) if joining
                           else self.runner.decode(decoding))
            except EngineError as e:
                self._stop(e)
            except Exception as e:
                self._fault(together, e)
            else:
                for seq, sampled in zip(together, samples, strict=True):
                    seq.suspect, seq.faults = False, 0  # it steps again: start over
                    seq.prefilling = False
                    self._advance(seq, sampled)
                if undrafted:  # DSpark's schedule learns from its steps
                    self._paced(decoding, None, None,
                                None if joining else time.perf_counter() - started)
            outputs += self._outputs(together)
        if drafting and chosen is not None:
            started = time.perf_counter()
            verified = self._speculate(drafting, chosen)
            if verified is not None:
                self._paced(drafting, chosen, verified, time.perf_counter() - started)
            outputs += self._outputs(drafting)
        for i, (seq, n) in enumerate(sorted(plan.prefill, key=self._prefill_cost)):
            if i and self.arrivals is not None and self.arrivals():
                break  # the rest stay prefilling: the next step plans them first
            final = n == seq.num_tokens - seq.store.num_tokens
            try:
                if final:
                    sampled = self.runner.prefill(seq)
                else:
                    self.runner.prefill_part(seq, n)
            except EngineError as e:
                self._stop(e)
            except Exception as e:  # one request must not stop the others
                self._fault([seq], e)
                outputs += self._outputs([seq])
                continue
            if final:
                seq.prefilling = False
                self._advance(seq, sampled)
                outputs += self._outputs([seq])
            else:  # no token yet: nothing to report, but its full blocks are named
                self.cache.register_full_blocks(seq.store)
        return outputs

    def _prefill_cost(self, part: tuple[Sequence, int]) -> int:
        """The tokens a prompt call runs: the part's, and first the replay its store owes
        (a prefix hit's window rebuilt). A step's calls run cheapest first, since each
        prompt's first token waits for every call before it."""
        seq, n = part
        owed = seq.store.replay_owed
        return n + (self.scheduler.replay_tokens(seq.store.num_tokens) if owed else 0)

    def wait(self, request_id: str) -> RequestOutput:
        """The request's newest output, stepping the engine until there is one (the
        request must be watched: added with watch=True)."""
        while True:
            with self.lock:  # another thread may step meanwhile: its outputs reach us too
                if (out := self.router.take(request_id)) is not None:
                    return out
                if request_id not in self.requests:
                    raise ValueError(f"request {request_id!r} is not running")
                self.step()

    @property
    def failure(self) -> str | None:
        """Why the engine can serve nothing more (stopped, or its ranks lost while idle);
        None while it can."""
        return self.stopped or self.runner.lost

    def _stop(self, error: EngineError) -> None:
        """The engine cannot go on: every request not yet finished ends with the error
        (its waiting front end too), and the error goes up."""
        self.stopped = str(error)
        log.error("kvstack engine stopped: %s", error)
        for seq in list(self.requests.values()):
            if seq.status is not Status.FINISHED:
                seq.error = str(error)
                self._finish(seq, "error")
                self.router.put(RequestOutput.of(seq))
        raise error

    def _fault(self, seqs: list[Sequence], error: Exception) -> None:
        """Roll the step back for seqs: their caches go (what the failed call wrote
        with them), they are recomputed from their tokens, and a request that failed
        MAX_FAULTS times ends with the error."""
        message = f"{type(error).__name__}: {error}"
        for seq in seqs:
            seq.faults += 1
            if seq.faults >= MAX_FAULTS:
                log.error("request %s failed: %s", seq.request_id, message)
                seq.error = message
                self._finish(seq, "error")
            else:
                log.warning("request %s: step failed (%s); recomputing it", seq.request_id,
                            message)
                seq.suspect = len(seqs) > 1  # next time it decodes alone
                self.scheduler.preempt(seq)

    def _paced(self, seqs: list[Sequence], chosen: list[bool] | None,
               verified: list[Verified] | None, seconds: float | None) -> None:
        """Hand DSpark's schedule a step of seqs (those `chosen` drafting, with what their
        verifies yielded; None: a plain step, whose `seconds` are None where prompts
        joined its call): its time first, against which each verify is judged."""
        pace, drafted = self.runner.pace, 0 if chosen is None else sum(chosen)
        if seconds is not None:
            pace.timed(len(seqs), drafted, seconds)
        for i, seq in enumerate(seqs):
            if chosen is not None and verified is not None and chosen[i]:
                pace.verified(seq, len(seqs), len(verified[i].samples))
            elif self.runner.drafts(seq):
                pace.skipped(seq)

    def _speculate(self, seqs: list[Sequence], chosen: list[bool]) -> list[Verified] | None:
        """DSpark's step for seqs (those `chosen` drafting): each advances by the outputs
        its verify kept, up to where it finishes, and its store keeps exactly the tokens
        that fed those. What the verifies yielded (None: the step failed)."""
        try:
            verified = self.runner.speculate(seqs, chosen)
        except EngineError as e:
            self._stop(e)
        except Exception as e:
            self._fault(seqs, e)
            return None
        settled = []
        for seq, outcome in zip(seqs, verified, strict=True):
            seq.suspect, seq.faults = False, 0
            store, kept = seq.store, 0
            for sampled in outcome.samples:
                self._advance(seq, sampled, name_blocks=False)
                kept += 1
                if seq.status is Status.FINISHED:
                    break
            if seq.store is store:  # still running, or kept for a follow-up turn
                settled.append((seq, outcome, kept))
        self.runner.settle(settled)
        for seq, _, _ in settled:
            self.cache.register_full_blocks(seq.store)
        return verified

    def _advance(self, seq: Sequence, sampled: Sample, name_blocks: bool = True) -> None:
        """Append a sampled token; name_blocks: first name the store's full blocks in the
        prefix cache (a speculative step names them once its store is settled)."""
        if name_blocks:
            self.cache.register_full_blocks(seq.store)
        token = sampled.token
        seq.output_ids.append(token)
        if sampled.logprobs is not None:
            seq.logprobs.append(sampled.logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        early = len(seq.output_ids) < seq.params.min_tokens  # ends held back (min_tokens)
        stopped = False
        if detokenizes_in_step(seq.params):  # else the front end makes the text
            stopped = seq.detokenizer.add(token, check_stop=not early)
            seq.text = seq.detokenizer.settled()
        if seq.grammar is not None:
            seq.grammar.accept(token)
            stopped = stopped or seq.grammar.done  # the structure is complete
        if (token in seq.end_ids and not early) or stopped:
            self._finish(seq, "stop")
        elif (len(seq.output_ids) >= seq.params.max_tokens
              or seq.num_tokens >= self.max_model_len):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if detokenizes_in_step(seq.params):
            if reason != "stop":
                seq.detokenizer.flush()
            seq.text = seq.detokenizer.text  # all of it: nothing can cut it any more
        keep = seq.keep_cache and reason in ("stop", "length")
        self.scheduler.finish(seq, reason, keep_cache=keep)
        # Nothing drafts for it any more (a next turn starts anew).
        seq.draft_context = seq.draft_states = None
        seq.finish_time = time.perf_counter()

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Their outputs, routed; a finished request is forgotten once reported, unless
        it kept its cache for a follow-up turn."""
        outputs = []
        for seq in {id(s): s for s in seqs}.values():  # once each, in order
            out = RequestOutput.of(seq)
            self.router.put(out)
            outputs.append(out)
            if seq.status is Status.FINISHED and seq.store is None:
                self.requests.pop(seq.request_id, None)
        return outputs
