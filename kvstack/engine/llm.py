"""`kvstack.LLM`: the engine's front door, with vLLM's names.

LLM(model, kv_budget="1GiB") loads a model directory (kvstack's own: config.json,
model.safetensors, tokenizer.json; or DeepSeek's published V4.1 checkpoint) or, with
random_init=True, a preset name or a ModelConfig with random
weights and a byte tokenizer; sizes the paged cache from the byte budget; and serves
requests with continuous batching. It is a front end over the `EngineCore`, which alone
runs the step; its settings are one `EngineConfig` (given whole, or as keyword arguments).
"""

import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvstack import native
from kvstack.cache.disk import DiskTier, check_session_name
from kvstack.cache.paged import PagedCache
from kvstack.config import ModelConfig
from kvstack.engine.config import EngineConfig, retain_freed_memory
from kvstack.engine.core import EngineCore
from kvstack.engine.images import expand_images, image_input
from kvstack.engine.loading import bundled_model, load_model
from kvstack.engine.runner import ModelRunner
from kvstack.engine.sampling import PromptLogprob, SamplingParams
from kvstack.engine.scheduler import Scheduler
from kvstack.engine.sequence import RequestOutput
from kvstack.engine.session import Session, resume_session
from kvstack.engine.tokenizer import Tokenizer
from kvstack.model.vision import ImageInput, ImageSegment

log = logging.getLogger("kvstack")

# A prompt: text, token ids, or (vLLM's form) a dict of either ("prompt" or
# "prompt_token_ids") with "multi_modal_data": {"image": one image or a list}.
Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | Path | ModelConfig = "default",
                 engine_config: EngineConfig | None = None, *, random_init: bool = False,
                 seed: int = 0, **settings: Any) -> None:
        """model: a model directory, "default" (the bundled model), or with
        random_init=True a preset name or a ModelConfig. engine_config, or its fields as
        keyword arguments (kv_budget="1GiB", replay="bounded", threads=..., max_model_len=...,
        ...: see EngineConfig)."""
        if engine_config is not None and settings:
            raise ValueError("give an EngineConfig or its settings as keywords, not both")
        try:
            config = engine_config or EngineConfig(**settings)
        except TypeError as e:  # an unknown keyword
            raise ValueError(f"LLM: {e}") from None
        self.engine_config = config
        config.apply_threads()
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cpu":
            retain_freed_memory()
        workers = None
        if config.tensor_parallel_size > 1:
            from kvstack.engine.workers import start_rank_zero

            self.model, self.tokenizer, model_fingerprint, workers = start_rank_zero(
                model, random_init, seed, config)
        else:
            self.model, self.tokenizer = load_model(model, random_init, seed, device,
                                                    config.numerics, config.dtype)
            model_fingerprint = self.model.fingerprint()
        # Where the weights came from (None for random weights): files stored with the
        # model, such as its chat template, are read from there.
        self.model_dir: Path | None = None if random_init else (
            bundled_model() if str(model) == "default" else Path(model))
        self.config = self.model.config
        # The weights and cache formats, and the tokenizer: another tokenizer.json reads the
        # same ids as other text, so its sessions and cached blocks are not this LLM's.
        self.fingerprint = hashlib.sha256(
            f"{model_fingerprint}/{self.tokenizer.digest}".encode()).hexdigest()
        self.replay = config.replay
        self.cache_dir = Path(config.cache_dir).expanduser()
        self._disk: DiskTier | None = None  # opened on first use
        lowest = (self.disk if config.disk_prefix_cache and config.enable_prefix_caching
                  else None)
        self.core = EngineCore(self.model, self.tokenizer, config, self.fingerprint, lowest,
                               workers)
        self._closed = False
        # Per rank, what each allocated (a sharded model).
        self.rank_bytes = self.runner.gather_report() if workers is not None else None
        report = self.memory_report()
        log.info(
            "kvstack cache: %.2f GiB holds %s tokens (%s blocks of %d) at %.1f B/token "
            "measured (plan %.1f); window rings %s B for each of %d sequences and %d window "
            "checkpoints; %s sequences of %s tokens fit", report["kv_budget"] / (1 << 30),
            f"{report['capacity_tokens']:,}", f"{report['blocks_total']:,}",
            config.block_tokens, report["bytes_per_token"], report["planned_bytes_per_token"],
            f"{report['window_bytes_per_sequence']:,}", config.max_num_seqs,
            report["window_checkpoints"]["capacity"],
            f"{report['sequences_fit']:,}", f"{report['context']:,}")
        log.info("kvstack weights: matrices in %s (dtype=%s)", report["backend"]["matrices"],
                 config.dtype)

    # The core's parts, for tests, benchmarks and tools that look inside.
    @property
    def cache(self) -> PagedCache:
        return self.core.cache

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, continue_from: str | None = None,
                    keep_cache: bool = False, watch: bool = False,
                    on_output: Callable[[RequestOutput], None] | None = None,
                    cache_salt: str | None = None, images: list[Any] | None = None) -> str:
        """Queue a request; it joins the running batch at the next step. Bad input raises
        ValueError here, before anything is queued.

        continue_from: a finished request that kept its cache (keep_cache=True); the new
        prompt follows its tokens and only the new tokens are prefilled (multi-turn chat).
        watch: its outputs wait for `wait(request_id)` (front ends that run requests to
        their end say so; step() returns every output either way). on_output: a callback
        each of its outputs is handed to, on the thread of the step that made it.
        cache_salt: the prefix-cache partition (as EngineCore.add_request's).
        images: pictures (PIL images, encoded bytes, file paths or data: URLs) for the
        prompt's image placeholders (the image token, one per picture, in order); a prompt
        without placeholders takes them before its text. A dict prompt may carry them as
        vLLM's "multi_modal_data".
        """
        prompt, images = _split_prompt(prompt, images)
        # A continuation may add nothing: the previous turn's last token is still to feed.
        ids = [] if continue_from is not None and not prompt else self.encode(prompt)
        segments = None
        if images and all(isinstance(i, ImageSegment) for i in images):
            segments = list(images)  # placed already: the ids hold their segments
        elif images:
            ids, segments = self.place_images(ids, images)
        deliver = None if on_output is None else (lambda out: on_output(out.with_text()))
        return self.core.add_request(ids, params or SamplingParams(),
                                     prompt if isinstance(prompt, str) else None, request_id,
                                     continue_from, keep_cache, watch, deliver, cache_salt,
                                     images=segments)

    def place_images(self, ids: list[int], images: list[Any]) -> tuple[list[int],
                                                                       list[ImageSegment]]:
        """`place_images` for this engine's model."""
        return place_images(ids, images, self.config, self.engine_config.image_bytes)

    def wait(self, request_id: str) -> RequestOutput:
        """The watched request's newest output, running steps until there is one; its
        text is made here, after the step (`RequestOutput.with_text`)."""
        return self.core.wait(request_id).with_text()

    def release(self, request_id: str) -> None:
        """Drop the cache a finished request kept for a follow-up turn."""
        self.core.release(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.core.requests

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (a string, or token ids checked against the vocabulary)."""
        return encode_prompt(self.tokenizer, self.config.vocab_size, prompt)

    @torch.no_grad()
    def prompt_logprobs(self, prompt: Prompt, top: int = 0) -> list[PromptLogprob | None]:
        """Each prompt token's log-probability given the tokens before it (None for the
        first, which follows nothing), its rank, and the `top` likeliest tokens: what
        lm-eval's log-likelihood tasks and vLLM's `prompt_logprobs` ask for. From the
        model's reference forward over the whole prompt (every layer over every token:
        the distribution exact replay reproduces step by step), run between engine
        steps; raw log-probabilities, before any sampling setting."""
        ids = self.encode(prompt)
        if self.engine_config.tensor_parallel_size > 1:
            raise ValueError("prompt log-probabilities are computed in one process; this "
                             "engine is split over ranks")
        if len(ids) > self.core.max_model_len:
            raise ValueError(f"the prompt is {len(ids)} tokens, over {self.core.limit_name} "
                             f"{self.core.max_model_len}")
        if not 0 <= top <= 20:
            raise ValueError(f"top must be 0..20, got {top}")
        device = self.model.embed.weight.device
        with self.core.lock, native.active(self.runner.cpu_kernels):
            logits = self.model(torch.tensor([ids], device=device)).logits[0, :-1]
        logp = logits.float().log_softmax(-1)  # [T-1, V]: position t scores token t+1
        targets = torch.tensor(ids[1:], device=device)[:, None]
        chosen = logp.gather(1, targets)  # [T-1, 1]
        ranks = (logp > chosen).sum(1) + 1
        best = logp.topk(top, dim=-1) if top else None
        out: list[PromptLogprob | None] = [None]
        for t, (lp, rank) in enumerate(zip(chosen[:, 0].tolist(), ranks.tolist(), strict=True)):
            pairs = () if best is None else tuple(zip(best.indices[t].tolist(),
                                                      best.values[t].tolist(), strict=True))
            out.append(PromptLogprob(lp, rank, pairs))
        return out

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step (EngineCore.step): the outputs of every request that moved;
        each also reaches the front end waiting for it."""
        return [out.with_text() for out in self.core.step()]

    # ---- the vLLM-style calls ----------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts. A request the
        engine failed on ends with finish_reason "error" and its message."""
        single = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompts)} "
                                 "prompts")
            params = sampling_params
        else:
            params = [sampling_params] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(self.add_request(p, sp, watch=True))
        except ValueError:
            for request_id in ids:  # all or nothing: queued ones go
                self.abort(request_id)
                self.core.router.forget(request_id)
            raise
        outputs = []
        for request_id in ids:
            out = self.wait(request_id)
            while not out.finished:
                out = self.wait(request_id)
            outputs.append(out)
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               continue_from: str | None = None,
               keep_cache: bool = False) -> Iterator[RequestOutput]:
        """Yield the request's output each time it grows, until it finishes; requests
        added meanwhile keep running alongside, other streams included. With keep_cache
        the finished request can be continued (continue_from=its request_id) without
        recomputing it."""
        request_id = self.add_request(prompt, sampling_params, continue_from=continue_from,
                                      keep_cache=keep_cache, watch=True)
        finished = False
        try:
            while not finished:
                out = self.wait(request_id)
                finished = out.finished
                yield out
        finally:
            if not finished:  # the caller stopped early
                self.abort(request_id)
                self.core.router.forget(request_id)

    # ---- memory ------------------------------------------------------------------------
    def memory_report(self, context: int | None = None) -> dict[str, Any]:
        """Bytes per token and capacity, measured from the storage actually allocated,
        with the plan (computed from the config) beside every figure; the Engram tables
        (weights, not cache) on their own line; with DSpark, the target states its
        drafts read ("draft"), apart from the cache."""
        with self.core.lock:
            report = self.cache.report(context or self.core.max_model_len)
        for w in report["warnings"]:
            log.warning("kvstack cache MISMATCH: %s", w)
        report["engram"] = [{"layer": block.spec.index, "bytes": block.engram.table_bytes,
                             "device": str(block.engram.table_codes.device)}
                            for block in self.model.layers if block.engram is not None]
        report["backend"] = self.runner.backend()
        if self.config.has_vision:
            report["positions"] = self._positions_by_kind(report["bytes_per_token"])
            # The tower's rows of recent pictures, kept by content: memory beside the cache.
            encoded = self.model.encoded_images
            report["encoded_images"] = {"held": len(encoded.entries), "bytes": encoded.nbytes,
                                        "limit_bytes": encoded.limit_bytes,
                                        "encoded": encoded.encoded}
        if self.runner.speculative:
            # DSpark's draft keeps no paged cache: each drafting sequence holds its draft
            # stages' window entries (draft_context), float32, apart from the KV cache,
            # and the target states of the tokens kept since its last draft.
            c = self.config
            with self.core.lock:
                held = sum(t.numel() * t.element_size()
                           for seq in self.core.requests.values()
                           for t in (seq.draft_context, *(seq.draft_states or ()))
                           if t is not None)
            report["draft"] = {
                "context_bytes_per_sequence":
                    len(c.draft_layers) * c.window_size * c.head_dim * 4,
                "context_bytes_held": held,
                "drafts": self.runner.drafted_tokens, "accepted": self.runner.accepted_tokens,
                "verifies": self.runner.verifies}
        if self.rank_bytes is not None:
            from kvstack.parallel.plan import ShardingPlan

            plan = ShardingPlan(self.config, len(self.rank_bytes),
                                self.engine_config.expert_parallel)
            report["parallel"] = {
                **plan.describe(),
                "ranks": [{"rank": r, **b} for r, b in enumerate(self.rank_bytes)],
                "weight_bytes_total": sum(b["weight_bytes"] for b in self.rank_bytes),
                "cache_bytes_total": sum(b["cache_bytes"] for b in self.rank_bytes)}
        return report

    def _positions_by_kind(self, bytes_per_token: float) -> dict[str, Any]:
        """The cache positions requests hold, text and image apart: an image position
        takes a token's record, the bytes per token measured from the pools."""
        with self.core.lock:
            held = [(seq.store.num_tokens, seq) for seq in self.core.requests.values()
                    if seq.store is not None]
            image = sum(max(0, min(n, s.stop) - s.start) for n, seq in held
                        for s in seq.images)
            total = sum(n for n, _ in held)
        return {kind: {"positions": n, "bytes_per_token": bytes_per_token,
                       "bytes": n * bytes_per_token}
                for kind, n in (("text", total - image), ("image", image), ("all", total))}

    def close(self) -> None:
        """Stop the worker ranks of a sharded model, which then takes no more requests
        (an engine in one process has nothing to stop)."""
        stop = getattr(self.runner, "stop", None)
        if stop is not None and not self._closed:
            stop()
            self._closed = True
            self.core.stopped = "the engine is closed (LLM.close)"

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sessions ----------------------------------------------------------------------
    @property
    def disk(self) -> DiskTier:
        """The disk tier under cache_dir (opened on first use)."""
        if self._disk is None:
            self._disk = DiskTier(self.cache_dir, self.engine_config.disk_budget_bytes)
        return self._disk

    def session(self, name: str, cache_salt: str | None = None) -> Session:
        """A new, empty session; save() stores it under `name` (replacing a saved one).
        cache_salt: the prefix-cache partition its turns use."""
        check_session_name(name)
        return Session(self, name, cache_salt=cache_salt)

    def resume(self, name: str, cache_salt: str | None = None) -> Session:
        """A saved session, from this process or another: its stream blocks go back into
        the pool and its next turn rebuilds the window rings by replay. Refused with a
        clear error if it is corrupt or was saved by another model or format version."""
        with self.core.lock:
            return resume_session(self, name, cache_salt)


def encode_prompt(tokenizer: Tokenizer, vocab_size: int, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: a string's, or token ids checked against the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list | tuple) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = list(prompt)
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary "
                             f"0..{vocab_size - 1}")
    else:
        raise ValueError(f"a prompt is a string or a list of token ids, got "
                         f"{type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def place_images(ids: list[int], images: list[Any], config: ModelConfig,
                 image_bytes: int) -> tuple[list[int], list[ImageSegment]]:
    """The prompt's ids with each image's segment in place of its placeholder (before the
    text where it has none) and the segments; refused with `ImageError` naming what is
    wrong (no tower, an undecodable or too large picture (over image_bytes), a URL to
    fetch)."""
    inputs = [image if isinstance(image, ImageInput) else
              image_input(image, config, image_bytes) for image in images]
    marker = config.image_token_id
    if config.has_vision and marker not in ids:
        ids = [marker] * len(inputs) + ids
    return expand_images(ids, inputs, config)


def _split_prompt(prompt: Prompt, images: list[Any] | None) -> tuple[str | list[int],
                                                                    list[Any] | None]:
    """(text or ids, images) of a prompt in any of its forms."""
    if not isinstance(prompt, dict):
        return prompt, images
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a dict prompt holds 'prompt' (text) or 'prompt_token_ids', and "
                         f"optionally 'multi_modal_data'; got keys {sorted(prompt)}")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes 'image' only, got {data!r:.80}")
    given = data.get("image")
    if given is not None and images:
        raise ValueError("images given twice: in multi_modal_data and as images=")
    if given is not None:
        images = list(given) if isinstance(given, list | tuple) else [given]
    return prompt.get("prompt", prompt.get("prompt_token_ids")), images
