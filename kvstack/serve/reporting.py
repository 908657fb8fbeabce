"""What the server says about itself in its log: one access line per API request, and a
stats line every few seconds while it has work (as vLLM prints), both on the `kvstack`
logger (`kvstack serve` shows INFO on stderr).

    kvstack access: 127.0.0.1 POST /v1/chat/completions 200 prompt=412 cached=384
        generated=64 1.92s
    kvstack stats: running 3, waiting 0 · prompt 210.4 tok/s, generation 31.7 tok/s ·
        cache 18.2% of 7,348 blocks · prefix hits 61.0%
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from kvstack.engine.core import EngineError

if TYPE_CHECKING:
    from kvstack.serve.metrics import ServerMetrics

log = logging.getLogger("kvstack")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class AccessLog:
    """ASGI middleware: one line per `/v1` request once its response has ended, with the
    token counts the endpoint left in `scope["state"]["usage"]`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(("/v1", "/tokenize",
                                                                    "/detokenize")):
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [0]

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            usage = scope.get("state", {}).get("usage")
            tokens = "" if usage is None else (
                f" prompt={usage['prompt_tokens']} "
                f"cached={usage['prompt_tokens_details']['cached_tokens']} "
                f"generated={usage['completion_tokens']}")
            client = scope.get("client") or ("-", 0)
            log.info("kvstack access: %s %s %s %s%s %.2fs", client[0], scope["method"],
                     scope["path"], status[0] or "-", tokens, time.perf_counter() - start)


async def log_stats(engine: Any, metrics: "ServerMetrics", interval_s: float) -> None:
    """Every `interval_s` while there is work (or was since the last line): the batch,
    token rates, cache use and the prefix-cache hit rate over the interval (`engine`:
    what `engine.call("stats")` reads)."""
    last = time.perf_counter()
    prompt, generated = metrics.totals["prompt"], metrics.totals["generation"]
    report = (await engine.call("stats"))["report"]
    hits, queried = report["prefix_cache"]["hit_tokens"], report["prefix_cache"]["queried_tokens"]
    while engine.failure is None:
        await asyncio.sleep(interval_s)
        try:
            stats = await engine.call("stats")
        except EngineError:  # the engine has stopped; /health says why
            return
        running, waiting, report = stats["running"], stats["waiting"], stats["report"]
        now = time.perf_counter()
        new_prompt = metrics.totals["prompt"] - prompt
        new_generated = metrics.totals["generation"] - generated
        if not (running or waiting or new_prompt or new_generated):
            last = now
            continue
        prefix = report["prefix_cache"]
        asked = prefix["queried_tokens"] - queried
        hit_rate = (prefix["hit_tokens"] - hits) / asked if asked else 0.0
        log.info("kvstack stats: running %d, waiting %d · prompt %.1f tok/s, generation "
                 "%.1f tok/s · cache %.1f%% of %s blocks · prefix hits %.1f%%", running,
                 waiting, new_prompt / (now - last), new_generated / (now - last),
                 100 * report["blocks_in_use"] / max(report["blocks_total"], 1),
                 f"{report['blocks_total']:,}", 100 * hit_rate)
        last, prompt, generated = now, metrics.totals["prompt"], metrics.totals["generation"]
        hits, queried = prefix["hit_tokens"], prefix["queried_tokens"]
