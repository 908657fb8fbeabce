"""Named sessions over HTTP: kvstack's extension of the OpenAI API.

A request that names a session (`"session": "repo-agent"` in the body, or the
`X-Kvstack-Session` header) sends the whole conversation, as OpenAI clients do. When its
prompt extends the session's tokens (prompt and replies so far), only the new tokens are
prefilled, on the cache the session kept on the device; otherwise the session starts over
on this prompt (the prefix cache still finds its full blocks). Every finished turn saves the
session to the disk tier, so it survives an eviction, an idle hour or a restart: a server
that does not hold it on the device resumes it from disk, its window rebuilt by the
configured replay. One turn at a time per session: a second request meanwhile gets 409.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvstack.cache.disk import DamagedSession, SavedSession
from kvstack.engine.async_llm import AsyncLLM
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput
from kvstack.engine.session import Session
from kvstack.serve.protocol import APIError

if TYPE_CHECKING:
    from kvstack.serve.metrics import ServerMetrics


class HttpSessions:
    def __init__(self, engine: AsyncLLM, metrics: "ServerMetrics") -> None:
        self.engine, self.llm, self.metrics = engine, engine.llm, metrics
        self.open: dict[str, Session] = {}  # sessions this process holds
        self.busy: set[str] = set()

    async def turn(self, name: str, ids: list[int],
                   params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Run one turn of the session on the conversation `ids`; its outputs."""
        if name in self.busy:
            raise APIError(409, f"session {name!r} is running another request", "session",
                           code="session_busy")
        self.busy.add(name)
        try:
            session = await self._session(name)
            tokens, kept = session.token_ids, session.kept_request
            extends = (kept is not None and self.llm.has_request(kept)
                       and len(ids) >= len(tokens) and ids[: len(tokens)] == tokens)
            if extends:
                outputs = self.engine.generate(ids[len(tokens):], params,
                                               continue_from=kept, keep_cache=True)
            else:
                session.close()
                outputs = self.engine.generate(ids, params, keep_cache=True)
            final = None
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    if out.finished:
                        final = out
                    yield out
            if final is not None and final.finish_reason in ("stop", "length"):
                session.record_turn(final)
                await asyncio.to_thread(session.save)
                self.metrics.sessions_saved.inc()
        finally:
            self.busy.discard(name)

    async def _session(self, name: str) -> Session:
        if name in self.open:
            return self.open[name]
        if await asyncio.to_thread(self.llm.disk.has, name):
            try:
                session = await asyncio.to_thread(self.llm.resume, name)
            except ValueError as e:  # corrupt, another model's, no room
                raise APIError(409, f"session {name!r} cannot be resumed: {e}", "session",
                               code="session_unavailable") from None
            self.metrics.sessions_resumed.inc()
        else:
            session = self.llm.session(name)
        self.open[name] = session
        return session

    def list(self) -> list[dict[str, Any]]:
        """Every session this process holds or the disk has, in one pass over the
        manifest; a damaged record is listed with the reason, not raised."""
        listed = {name: self._report(name, None) for name in self.open}
        for saved in self.llm.disk.sessions():
            if saved.name not in listed:
                listed[saved.name] = self._report(saved.name, saved)
        return [listed[name] for name in sorted(listed)]

    def show(self, name: str) -> dict[str, Any]:
        if name in self.open:
            return self._report(name, None)
        try:
            return self._report(name, self.llm.disk.show(name))
        except ValueError as e:
            if not self.llm.disk.has(name):
                raise APIError(404, f"no session {name!r}", "name",
                               code="session_not_found") from None
            return self._report(name, DamagedSession(name, str(e)))

    def _report(self, name: str, saved: SavedSession | DamagedSession | None) -> dict[str, Any]:
        if saved is None:
            report = self.open[name].report()
        elif isinstance(saved, DamagedSession):
            report = {"name": name, "damaged": saved.reason}
        else:
            report = {"name": name, "tokens": len(saved.token_ids), "device_bytes": 0,
                      "disk_bytes": saved.disk_bytes}
        return {"id": name, "object": "session", "busy": name in self.busy, **report}

    async def delete(self, name: str) -> None:
        if name in self.busy:
            raise APIError(409, f"session {name!r} is running a request", "name",
                           code="session_busy")
        on_disk = await asyncio.to_thread(self.llm.disk.has, name)
        if name not in self.open and not on_disk:
            raise APIError(404, f"no session {name!r}", "name", code="session_not_found")
        session = self.open.pop(name, None)
        if session is not None:
            await asyncio.to_thread(session.close)
        if on_disk:
            await asyncio.to_thread(self.llm.disk.remove, name)
