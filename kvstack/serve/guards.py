"""What stands between the network and the API: the connection rules uvicorn lacks, and
the checks a request passes before its body is read.

- A request must arrive whole (headers and body) within `request_timeout_s` of its
  connection opening or of the previous response on it ending; a client that trickles its
  headers or its body is disconnected then. uvicorn's own keep-alive timeout is reset by
  every byte, so alone it never ends such a connection.
- At most `max_connections` connections are open. A new one past the limit takes the place
  of the oldest connection still waiting for a request (one that sends nothing, or sends
  slowly); when every connection is running a request, the new one is closed. A flood of
  slow connections therefore never locks a real client out.
- The API key is checked from the headers, then the body's size (Content-Length, or the
  bytes as they arrive), before any of the body is read or parsed: an unauthenticated or
  oversized body costs the server neither memory nor parsing. With several keys, the
  request's tenant (a digest of its key, never the key) goes to the app in
  `scope["state"]["tenant"]`.
"""

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvstack.serve.protocol import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def guarded_protocol(request_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with a whole-request deadline and a connection limit."""

    class GuardedProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.opened_at = time.monotonic()
            self.deadline: asyncio.TimerHandle | None = None
            self._arm()
            if len(self.connections) > max_connections:
                waiting = sorted((c for c in self.connections
                                  if c is not self and isinstance(c, GuardedProtocol)
                                  and c.waiting_for_request()), key=lambda c: c.opened_at)
                (waiting[0] if waiting else self).transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on this connection gets its own deadline

        def waiting_for_request(self) -> bool:
            """Whether the connection holds no request that has arrived whole (nothing
            yet, part of the headers, or part of the body)."""
            return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

        def _arm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(request_timeout_s, self._expire)

        def _expire(self) -> None:
            self.deadline = None
            if self.waiting_for_request() and not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


GATED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")  # what the API key opens


def tenant_of(api_key: str) -> str:
    """The name a key's sessions and prefix-cache partition go under (a digest: the key
    itself is never stored)."""
    return hashlib.sha256(b"kvstack-tenant|" + api_key.encode()).hexdigest()[:16]


class RequestGate:
    """ASGI middleware: the API key (when keys are set) and the body limit, checked for
    every API request (`GATED`) before its body is read; the body is then read whole (at most
    `max_body_bytes`) and handed on, so what follows never sees more."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        # Bearer header -> tenant; one key is one tenant, shown as none.
        self.tenants = {f"Bearer {k}".encode(): tenant_of(k) if len(api_keys) > 1 else None
                        for k in api_keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATED):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.tenants:
            # Compared as bytes (a header with non-ASCII characters is a wrong key, not an
            # error), with every key, so the time taken says nothing of which one matched.
            given = headers.get(b"authorization", b"")
            matched = [t for bearer, t in self.tenants.items()
                       if secrets.compare_digest(given, bearer)]
            if not matched:
                await _refuse(send, APIError(401, "missing or wrong API key (Authorization: "
                                                  "Bearer ...)", kind="authentication_error",
                                             code="invalid_api_key"))
                return
            scope.setdefault("state", {})["tenant"] = matched[0]
        too_large = APIError(413, f"the request body is larger than {self.max_body_bytes:,} "
                                  "bytes (kvstack serve --max-body-size)",
                             kind="invalid_request_error", code="request_too_large")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            await _refuse(send, APIError(400, "Content-Length is not a number"))
            return
        if int(declared) > self.max_body_bytes:
            await _refuse(send, too_large)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _refuse(send, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            # The body once, whole; then the client's own channel (a disconnect).
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _refuse(send: Send, error: APIError) -> None:
    """Answer without reading the body, and close the connection: what the client still
    sends is never read."""
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
               (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
