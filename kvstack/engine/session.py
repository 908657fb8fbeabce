"""Persistent agent sessions (DESIGN.md sections 4 and 5).

A session is one conversation on an `LLM`. Between turns its cache stays on the device as
a kept request, so a turn prefills only its own tokens. `save()` writes the token ids and
the stream blocks to the disk tier, never the window rings; `LLM.resume(name)`, in this
process or another, loads the blocks back into the pool and the next turn first rebuilds
the rings by replay (`bounded` or `exact`, as the LLM is configured).
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvstack.engine.core import EngineError
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM


class Session:
    def __init__(self, llm: "LLM", name: str, token_ids: list[int] | None = None,
                 request_id: str | None = None) -> None:
        self.llm, self.name = llm, name
        self.token_ids: list[int] = list(token_ids or [])  # every token so far
        self._pending: list[int] = []  # appended, not yet fed to the model
        self._request_id = request_id  # the finished request that keeps the cache

    def append(self, text: str | list[int]) -> None:
        """Add text (or token ids) to the conversation; the next generate() feeds it."""
        ids = self.llm.encode(text)
        self._pending += ids
        self.token_ids += ids

    def generate(self, params: SamplingParams | None = None) -> RequestOutput:
        """Continue the conversation; only the tokens the cache lacks are prefilled."""
        *_, last = self.stream(params)
        return last

    def stream(self, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """generate(), yielding the output each time it grows. A turn the engine failed
        on raises EngineError (the conversation keeps the appended text, to retry)."""
        if not self.token_ids:
            raise ValueError(f"session {self.name!r} is empty: append() text first")
        llm = self.llm
        if self._request_id is not None and llm.has_request(self._request_id):
            request_id = llm.add_request(self._pending, params, keep_cache=True,
                                         continue_from=self._request_id, watch=True)
        else:  # a new session, or its cache was dropped: the prefix cache may still help
            request_id = llm.add_request(self.token_ids, params, keep_cache=True, watch=True)
        self._request_id, self._pending = request_id, []
        finished = False
        try:
            while not finished:
                out = llm.wait(request_id)
                finished = out.finished
                if out.finish_reason == "error":
                    raise EngineError(f"session {self.name!r}: {out.error}")
                if finished:
                    self.token_ids += out.token_ids
                yield out
        finally:
            if not finished:  # the caller stopped early: the turn is dropped
                llm.abort(request_id)

    def save(self) -> None:
        """Write the session to the disk tier (atomically; a saved session of the same
        name is replaced)."""
        self.llm.save_session(self.name, self.token_ids, self._request_id)

    def close(self) -> None:
        """Free the session's device cache (a saved copy on disk stays)."""
        if self._request_id is not None:
            self.llm.release(self._request_id)
            self._request_id = None

    def report(self) -> dict[str, Any]:
        """The session's bytes on each tier, and what saving its window rings as well
        would have added."""
        return self.llm.session_report(self.name, self._request_id, len(self.token_ids))
