"""Persistent agent sessions (design.md sections 4 and 5).

A session is one conversation on an `LLM`. Between turns its cache stays on the device as
a kept request, so a turn prefills only its own tokens. `save()` writes the token ids and
the stream blocks to the disk tier, never the window rings; `LLM.resume(name)`, in this
process or another, loads the blocks back into the pool and the next turn first rebuilds
the rings by replay (`bounded` or `exact`, as the LLM is configured).

A conversation with pictures keeps them (their patches, bf16) beside its tokens, in memory
and in the saved record: a replay over part of an image segment encodes the picture again,
and the prefix cache names the image's blocks by its content.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from kvstack.engine.core import EngineError
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput, Sequence, Status, image_keys
from kvstack.model.vision import ImageInput, ImageSegment

if TYPE_CHECKING:
    from kvstack.cache.paged import PagedSequenceStore
    from kvstack.engine.llm import LLM


class Session:
    def __init__(self, llm: "LLM", name: str, token_ids: list[int] | None = None,
                 request_id: str | None = None, cache_salt: str | None = None,
                 images: list[ImageSegment] | None = None) -> None:
        self.llm, self.name, self.cache_salt = llm, name, cache_salt
        self.token_ids: list[int] = list(token_ids or [])  # every token so far
        self.images: list[ImageSegment] = list(images or [])  # its pictures' segments
        self._pending: list[int] = []  # appended, not yet fed to the model
        self._pending_images: list[ImageSegment] = []  # theirs, placed from _pending's start
        self._request_id = request_id  # the finished request that keeps the cache

    def append(self, text: str | list[int], images: list[Any] | None = None) -> None:
        """Add text (or token ids) to the conversation, and pictures (as
        `LLM.add_request` takes them: at the text's image placeholders, else before it);
        the next generate() feeds them."""
        ids = self.llm.encode(text) if text or not images else []
        segments: list[ImageSegment] = []
        if images:
            ids, segments = self.llm.place_images(ids, images)
        self._pending_images += [ImageSegment(len(self._pending) + s.start, s.image)
                                 for s in segments]
        self.images += [ImageSegment(len(self.token_ids) + s.start, s.image) for s in segments]
        self._pending += ids
        self.token_ids += ids

    def generate(self, params: SamplingParams | None = None) -> RequestOutput:
        """Continue the conversation; only the tokens the cache lacks are prefilled."""
        *_, last = self.stream(params)
        return last

    def stream(self, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """generate(), yielding the output each time it grows. A turn the engine failed
        on raises EngineError (the conversation keeps the appended text, to retry). A turn
        the caller stops early (closing the iterator, Ctrl-C in `kvstack chat`) keeps the
        reply as far as it was yielded: the conversation holds what its reader saw, and
        the next turn prefills it again (the prefix cache finds its full blocks)."""
        if not self.token_ids:
            raise ValueError(f"session {self.name!r} is empty: append() text first")
        llm = self.llm
        try:
            if self._request_id is not None and llm.has_request(self._request_id):
                request_id = llm.add_request(self._pending, params, keep_cache=True,
                                             continue_from=self._request_id, watch=True,
                                             images=self._pending_images)
            else:  # a new session, or its cache was dropped: the prefix cache may help
                request_id = llm.add_request(self.token_ids, params, keep_cache=True,
                                             watch=True, cache_salt=self.cache_salt,
                                             images=self.images)
        except ValueError:  # refused (too long, say): the conversation is as it was
            self.token_ids = self.token_ids[: len(self.token_ids) - len(self._pending)]
            self.images = self.images[: len(self.images) - len(self._pending_images)]
            self._pending, self._pending_images = [], []
            raise
        self._request_id, self._pending, self._pending_images = request_id, [], []
        finished, shown = False, []  # shown: the reply's tokens yielded so far
        try:
            while not finished:
                out = llm.wait(request_id)
                finished = out.finished
                if out.finish_reason == "error":
                    raise EngineError(f"session {self.name!r}: {out.error}")
                if finished:
                    self.token_ids += out.token_ids
                shown = out.token_ids
                yield out
        finally:
            if not finished:  # the caller stopped early: keep what it saw, drop the rest
                llm.abort(request_id)
                self.token_ids += shown
                self._request_id = None

    @property
    def kept_request(self) -> str | None:
        """The finished request whose cache holds the conversation (None: not on the
        device)."""
        return self._request_id

    def record_turn(self, out: RequestOutput,
                    images: list[ImageSegment] | None = None) -> None:
        """Take on a finished turn another front end ran on this conversation (the
        server's): its tokens, its pictures' segments and its kept cache become the
        session's."""
        self.token_ids = list(out.prompt_token_ids) + list(out.token_ids)
        self.images = list(images or [])
        self._request_id, self._pending, self._pending_images = out.request_id, [], []

    def keep_last(self, n_tokens: int) -> None:
        """Keep only the conversation's last n_tokens (its start is forgotten and its
        cache dropped: the next turn prefills what is kept)."""
        if n_tokens <= 0:
            raise ValueError(f"keep_last needs a positive number of tokens, got {n_tokens}")
        if len(self.token_ids) > n_tokens:
            self.close()
            cut = len(self.token_ids) - n_tokens
            for segment in self.images:  # a picture cut in two goes whole
                if segment.start < cut < segment.stop:
                    cut = segment.stop
            self.token_ids = self.token_ids[cut:]
            self.images = [ImageSegment(s.start - cut, s.image) for s in self.images
                           if s.start >= cut]
            # with no cache, the next turn feeds every kept token
            self._pending, self._pending_images = [], []

    def save(self) -> None:
        """Write the session to the disk tier (atomically; a saved session of the same
        name is replaced): its token ids and the stream blocks its kept request holds
        (none if its cache was evicted: then resuming prefills it all)."""
        if not self.token_ids:
            raise ValueError(f"session {self.name!r} is empty: nothing to save")
        llm = self.llm
        with llm.core.lock:  # no step of another thread changes the blocks meanwhile
            store = self._store()
            payloads = llm.cache.block_payloads(store) if store is not None else []
            held = store.num_tokens if store is not None else 0
        llm.disk.save(self.name, llm.fingerprint, llm.cache.block_tokens, held, self.token_ids,
                      payloads, llm.cache.layout.window_bytes_per_sequence,
                      [_saved_image(segment) for segment in self.images])

    def _store(self) -> "PagedSequenceStore | None":
        """The cache its kept request holds, if it still does."""
        seq = self.llm.core.requests.get(self._request_id) if self._request_id else None
        return seq.store if seq is not None else None

    def close(self) -> None:
        """Free the session's device cache (a saved copy on disk stays)."""
        if self._request_id is not None:
            self.llm.release(self._request_id)
            self._request_id = None

    def report(self) -> dict[str, Any]:
        """The session's bytes on each tier, and what saving its window rings as well
        would have added."""
        llm, store = self.llm, self._store()
        disk = llm.disk.show(self.name).disk_bytes if llm.disk.has(self.name) else 0
        rings = llm.cache.layout.window_bytes_per_sequence
        return {
            "name": self.name,
            "tokens": len(self.token_ids),
            "device_bytes": llm.cache.held_bytes(store) if store is not None else 0,
            "disk_bytes": disk,
            "window_ring_bytes": rings,
            "disk_bytes_with_window_rings": disk + rings if disk else 0,
        }


def _saved_image(segment: ImageSegment) -> tuple[dict[str, Any], bytes]:
    """A picture as the disk tier keeps it: its place and grid, its patches' bytes."""
    image = segment.image
    if image.patches.dtype != torch.bfloat16:
        raise ValueError("a session keeps pictures as the image processor makes them (bf16 "
                         f"patches), got {image.patches.dtype}")
    data = image.patches.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return {"start": segment.start, "n_vit_h": image.n_vit_h, "n_vit_w": image.n_vit_w,
            "ratio": image.ratio}, data


def _resumed_images(llm: "LLM", name: str) -> list[ImageSegment]:
    saved = llm.disk.show(name)
    p = llm.config.vision_patch_size
    segments = []
    for meta, data in zip(saved.images, llm.disk.load_images(saved), strict=True):
        if not llm.config.has_vision:
            raise ValueError(f"session {name!r} holds pictures and this model has no vision "
                             "tower")
        patches = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
        n = meta["n_vit_h"] * meta["n_vit_w"]
        if patches.numel() != n * 3 * p * p:
            raise ValueError(f"session {name!r}: a picture's file holds {patches.numel()} "
                             f"values, its {meta['n_vit_h']} x {meta['n_vit_w']} grid of "
                             f"{p}-pixel patches needs {n * 3 * p * p}")
        segments.append(ImageSegment(meta["start"], ImageInput(
            patches.view(n, 3, p, p), meta["n_vit_h"], meta["n_vit_w"], meta["ratio"])))
    return segments


def resume_session(llm: "LLM", name: str, cache_salt: str | None = None) -> Session:
    """`LLM.resume`: the saved blocks back into the pool as a kept request."""
    images = _resumed_images(llm, name)
    keys = image_keys(images)
    saved, payloads = llm.disk.load(name, llm.fingerprint, spare=lambda saved, index: (
        llm.cache.cached_copy(saved.token_ids[: saved.held_tokens], index, cache_salt, keys)
        if saved.block_tokens == llm.cache.block_tokens else None))
    core = llm.core
    if payloads and saved.block_tokens != llm.cache.block_tokens:
        raise ValueError(f"session {name!r} was saved with blocks of {saved.block_tokens} "
                         f"tokens; this LLM uses {llm.cache.block_tokens}")
    if len(saved.token_ids) >= core.max_model_len:
        raise ValueError(f"session {name!r} holds {len(saved.token_ids)} tokens, at or "
                         f"over {core.limit_name} {core.max_model_len}")
    seq = Sequence("", saved.token_ids, SamplingParams(max_tokens=1), status=Status.FINISHED,
                   finish_reason="resumed", cache_salt=cache_salt, images=images)
    if payloads:
        if not core.scheduler.reclaim(len(payloads)):
            raise ValueError(f"session {name!r} needs {len(payloads)} blocks and a window "
                             f"slot; the device pool has {llm.cache.free_blocks} free "
                             "blocks with the running requests")
        seq.store = llm.cache.restore(payloads, saved.token_ids[: saved.held_tokens],
                                      cache_salt, seq.image_keys)
    request_id = core.adopt(seq)
    if payloads:
        core.scheduler.keep(seq)
    return Session(llm, name, saved.token_ids, request_id, cache_salt, images)
