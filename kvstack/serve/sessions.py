"""Named sessions over HTTP: kvstack's extension of the OpenAI API.

A request that names a session (`"session": "repo-agent"` in the body, or the
`X-Kvstack-Session` header) sends the whole conversation, as OpenAI clients do. When its
prompt extends the session's tokens (prompt and replies so far) -- as token ids, or as
text that starts with what those tokens decode to (a chat client sending back the replies
it was given) -- only the new tokens are prefilled, on the cache the session kept on the
device; otherwise (an edited history) the session starts over on this prompt (the prefix
cache still finds its full blocks). Every finished turn saves the
session to the disk tier, so it survives an eviction, an idle hour or a restart: a server
that does not hold it on the device resumes it from disk, its window rebuilt by the
configured replay. One turn at a time per session: a second request meanwhile gets 409.

Two halves: `SessionTable` holds the sessions where the engine runs (its process), and
`HttpSessions`, on the server's event loop, asks it by name (`engine.call`) and keeps
which sessions are running a turn.
"""

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstack.cache.disk import DamagedSession, SavedSession
from kvstack.engine.images import expand_images
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput
from kvstack.engine.session import Session
from kvstack.model.vision import ImageSegment
from kvstack.serve.protocol import IMAGE_MARK, APIError

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM
    from kvstack.serve.metrics import ServerMetrics


class SessionUnavailable(ValueError):
    """A saved session that cannot be resumed (corrupt, another model's, no room)."""


@dataclass(frozen=True)
class Turn:
    """How a session's turn runs: the ids to feed and the segments of their pictures, the
    kept request it continues (None: the whole conversation from the prefix cache), and
    the conversation's pictures once the turn is done."""

    ids: list[int]
    images: list[ImageSegment]
    continue_from: str | None
    conversation_images: list[ImageSegment]
    resumed: bool  # taken from the disk tier for this turn


class SessionTable:
    """The sessions this engine holds, by stored name; what `HttpSessions` asks of them,
    run where the engine runs."""

    def __init__(self, llm: "LLM") -> None:
        self.llm = llm
        self.open: dict[str, Session] = {}

    def begin(self, key: str, cache_salt: str | None, ids: list[int], text: str | None,
              images: list[ImageSegment], marked: str | None) -> Turn:
        """The turn of session `key` on the conversation `ids` (the tokens of `text`, when
        the prompt was text): opened, or resumed from disk, first. A chat with pictures
        gives the segments of every picture of the conversation (`images`, as a chat
        resends them all) and its text with each picture marked (`marked`)."""
        session, resumed = self._session(key, cache_salt)
        kept = session.kept_request
        new = None
        if kept is not None and self.llm.has_request(kept):
            new = self._extension(session, ids, text, images, marked)
        if new is not None:
            held = len(session.token_ids)
            new_ids, new_images = new
            return Turn(new_ids, new_images, kept,
                        [*session.images, *(ImageSegment(held + s.start, s.image)
                                            for s in new_images)], resumed)
        session.close()
        return Turn(ids, images, None, images, resumed)

    def end(self, key: str, final: RequestOutput, images: list[ImageSegment]) -> None:
        """A turn that finished ("stop" or "length"): recorded and saved to disk. The
        turn's kept cache was held for this save (under load it would otherwise go to the
        next waiting request before the save read it); it is let go after."""
        session = self.open[key]
        session.record_turn(final, images)
        try:
            session.save()
        finally:
            self.llm.core.end_hold(final.request_id)

    def _session(self, key: str, cache_salt: str | None) -> tuple[Session, bool]:
        if key in self.open:
            return self.open[key], False
        if self.llm.disk.has(key):
            try:
                session = self.llm.resume(key, cache_salt)
            except ValueError as e:
                raise SessionUnavailable(str(e)) from None
            resumed = True
        else:
            session, resumed = self.llm.session(key, cache_salt), False
        self.open[key] = session
        return session, resumed

    def _extension(self, session: Session, ids: list[int], text: str | None,
                   images: list[ImageSegment], marked: str | None
                   ) -> tuple[list[int], list[ImageSegment]] | None:
        """The tokens that follow the session's in this prompt and the segments of the
        pictures among them (placed from their start), or None when the prompt does not
        extend the session. Token ids match as they are; a text prompt matches when it
        starts with the text the session's tokens decode to (the replies the client was
        given come back as text, which need not re-tokenize the same), and its rest is
        tokenized on its own. With pictures, the session's must be the prompt's first ones
        (by content), their segments in the text its marks."""
        tokens, held = session.token_ids, len(session.token_ids)
        kept = [(s.start, s.image.digest) for s in session.images]
        before = [s for s in images if s.start < held]
        if ids[:held] == tokens and all(s.stop <= held for s in before) \
                and [(s.start, s.image.digest) for s in before] == kept:
            return ids[held:], [ImageSegment(s.start - held, s.image) for s in images
                                if s.start >= held]
        if images or session.images:
            if marked is None or [s.image.digest for s in images[: len(kept)]] != \
                    [digest for _, digest in kept]:
                return None
            seen = _marked_text(self.llm, tokens, session.images)
            if not marked.startswith(seen):
                return None
            rest = marked_ids(self.llm, marked[len(seen):])
            return expand_images(rest, [s.image for s in images[len(kept):]],
                                 self.llm.config)
        if text is not None:
            seen = self.llm.tokenizer.decode(tokens)
            if text.startswith(seen):
                rest = self.llm.encode(text[len(seen):]) if len(text) > len(seen) else []
                return rest, []
        return None

    def reports(self, prefix: str | None) -> dict[str, dict[str, Any]]:
        """The sessions held here or on disk whose stored names start with `prefix` (None:
        all), by stored name, in one pass over the manifest; a damaged record is reported
        with the reason, not raised."""
        mine = (lambda key: True) if prefix is None else (lambda key: key.startswith(prefix))
        listed = {key: self._report(key, None) for key in self.open if mine(key)}
        for saved in self.llm.disk.sessions():
            if saved.name not in listed and mine(saved.name):
                listed[saved.name] = self._report(saved.name, saved)
        return listed

    def report(self, key: str) -> dict[str, Any] | None:
        """The session's report; None when there is no such session."""
        if key in self.open:
            return self._report(key, None)
        try:
            return self._report(key, self.llm.disk.show(key))
        except ValueError as e:
            if not self.llm.disk.has(key):
                return None
            return self._report(key, DamagedSession(key, str(e)))

    def _report(self, key: str, saved: SavedSession | DamagedSession | None
                ) -> dict[str, Any]:
        if saved is None:
            return self.open[key].report()
        if isinstance(saved, DamagedSession):
            return {"damaged": saved.reason}
        return {"tokens": len(saved.token_ids), "device_bytes": 0,
                "disk_bytes": saved.disk_bytes}

    def delete(self, key: str) -> bool:
        """Close the session and remove it from disk; False when there is none."""
        on_disk = self.llm.disk.has(key)
        session = self.open.pop(key, None)
        if session is None and not on_disk:
            return False
        if session is not None:
            session.close()
        if on_disk:
            self.llm.disk.remove(key)
        return True


class HttpSessions:
    """Sessions by name. With several API keys each key's sessions live under its tenant
    (stored as "<tenant>:<name>"): a client sees, runs, overwrites and deletes only its
    own, and asking for another's is a 404 like a name that does not exist. `engine` runs
    requests (`generate`) and reaches the engine's `SessionTable` through `ServeOps`'s
    `session_*` methods (`engine.call("session_begin", ...)`)."""

    def __init__(self, engine: Any, metrics: "ServerMetrics") -> None:
        self.engine, self.metrics = engine, metrics
        self.busy: set[str] = set()  # stored names

    @staticmethod
    def stored(tenant: str | None, name: str) -> str:
        """The name a tenant's session is kept under (tenant None: the name itself)."""
        return name if tenant is None else f"{tenant}:{name}"

    async def turn(self, tenant: str | None, name: str, ids: list[int],
                   params: SamplingParams, cache_salt: str | None = None,
                   text: str | None = None, images: list[ImageSegment] | None = None,
                   marked: str | None = None) -> AsyncIterator[RequestOutput]:
        """Run one turn of the session on the conversation `ids` (`SessionTable.begin`);
        its outputs."""
        key = self.stored(tenant, name)
        if key in self.busy:
            raise APIError(409, f"session {name!r} is running another request", "session",
                           code="session_busy")
        self.busy.add(key)
        try:
            try:
                turn = await self.engine.call("session_begin", key, cache_salt, ids, text,
                                              list(images or []), marked)
            except SessionUnavailable as e:
                raise APIError(409, f"session {name!r} cannot be resumed: {e}", "session",
                               code="session_unavailable") from None
            if turn.resumed:
                self.metrics.sessions_resumed.inc()
            if turn.continue_from is not None:
                outputs = self.engine.generate(turn.ids, params,
                                               continue_from=turn.continue_from,
                                               keep_cache=True, hold_kept=True,
                                               images=turn.images)
            else:
                outputs = self.engine.generate(turn.ids, params, keep_cache=True,
                                               cache_salt=cache_salt, hold_kept=True,
                                               images=turn.images)
            final = None
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    if out.finished:
                        final = out
                    yield out
            if final is not None and final.finish_reason in ("stop", "length"):
                await self.engine.call("session_end", key, final, turn.conversation_images)
                self.metrics.sessions_saved.inc()
        finally:
            self.busy.discard(key)

    async def list(self, tenant: str | None) -> list[dict[str, Any]]:
        """The tenant's sessions, held by the engine or on disk."""
        reports = await self.engine.call("session_reports",
                                         None if tenant is None else f"{tenant}:")
        return [self._shown(tenant, key, reports[key]) for key in sorted(reports)]

    async def show(self, tenant: str | None, name: str) -> dict[str, Any]:
        key = self.stored(tenant, name)
        report = await self.engine.call("session_report", key)
        if report is None:
            raise APIError(404, f"no session {name!r}", "name", code="session_not_found")
        return self._shown(tenant, key, report)

    def _shown(self, tenant: str | None, key: str, report: dict[str, Any]) -> dict[str, Any]:
        name = key if tenant is None else key.removeprefix(f"{tenant}:")
        return {"id": name, "object": "session", "busy": key in self.busy,
                **report, "name": name}

    async def delete(self, tenant: str | None, name: str) -> None:
        key = self.stored(tenant, name)
        if key in self.busy:
            raise APIError(409, f"session {name!r} is running a request", "name",
                           code="session_busy")
        if not await self.engine.call("session_delete", key):
            raise APIError(404, f"no session {name!r}", "name", code="session_not_found")


def marked_ids(llm: "LLM", text: str) -> list[int]:
    """The ids of a chat's text whose pictures are marked (IMAGE_MARK): each piece
    between marks tokenized on its own, each mark the image token."""
    ids: list[int] = []
    for i, piece in enumerate(text.split(IMAGE_MARK)):
        ids += ([llm.config.image_token_id] if i else []) + (
            llm.tokenizer.encode(piece) if piece else [])
    return ids


def _marked_text(llm: "LLM", tokens: list[int], images: list[ImageSegment]) -> str:
    """The text a session's tokens decode to, each picture's segment an IMAGE_MARK."""
    parts, at = [], 0
    for segment in images:
        parts += [llm.tokenizer.decode(tokens[at : segment.start]), IMAGE_MARK]
        at = segment.stop
    return "".join([*parts, llm.tokenizer.decode(tokens[at:])])
