"""The asyncio front end (vLLM's AsyncLLM): the engine core steps in a thread of its own
while there is work, and each request's outputs reach the coroutine that asked for them on
its event loop. An HTTP server is many such coroutines; sync front ends (`LLM.generate`,
sessions) may share the same core from other threads meanwhile. `EngineProcess`
(kvstack.engine.process) offers the same to a front end with the engine in a process of
its own.
"""

import asyncio
import contextlib
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.config import ModelConfig
from kvstack.engine.config import EngineConfig
from kvstack.engine.core import EngineError
from kvstack.engine.llm import LLM, Prompt
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput
from kvstack.engine.tokenizer import Tokenizer
from kvstack.model.vision import ImageSegment


@dataclass(frozen=True)
class EngineInfo:
    """What a front end reads of its engine once, wherever the engine runs."""

    model_dir: Path | None
    config: ModelConfig
    engine_config: EngineConfig
    tokenizer: Tokenizer
    max_model_len: int

    @classmethod
    def of(cls, llm: LLM) -> "EngineInfo":
        return cls(llm.model_dir, llm.config, llm.engine_config, llm.tokenizer,
                   llm.core.max_model_len)


class AsyncLLM:
    def __init__(self, model: "str | Path | ModelConfig | LLM" = "default",
                 engine_config: EngineConfig | None = None, **settings: Any) -> None:
        """An LLM to serve (or what builds one, as `LLM(model, engine_config, ...)`)."""
        self.llm = model if isinstance(model, LLM) else LLM(model, engine_config, **settings)
        self.core = self.llm.core
        self.info = EngineInfo.of(self.llm)
        self.tokenizer = self.llm.tokenizer
        # What `call` reaches: the methods a server asks of the engine by name (set by the
        # server that uses this engine).
        self.handler: Any = None
        # What coroutines ask of the core, taken by the engine thread between steps: an
        # event loop never waits on the core's lock (which a stepping thread takes again
        # as soon as it lets go), so outputs keep flowing while requests arrive.
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._closed = False
        # request id -> how to hand it an output or a failure (the engine thread's)
        self._deliver: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self.core.arrivals = lambda: not self._inbox.empty()
        self._thread = threading.Thread(target=self._loop, name="kvstack-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, continue_from: str | None = None,
                       keep_cache: bool = False,
                       cache_salt: str | None = None,
                       hold_kept: bool = False,
                       images: list[ImageSegment] | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them, the final one last. A bad prompt
        raises ValueError before anything is queued, a request the engine refuses (too
        long, an unknown conversation) ValueError at the first step; a caller that stops
        iterating early (a closed connection) aborts the request. continue_from /
        keep_cache / cache_salt / hold_kept: as `EngineCore.add_request`'s (a conversation
        kept in the cache; the prefix-cache partition; kept until saved); images: the
        segments of the pictures the ids hold (`LLM.place_images` makes both)."""
        if self._closed:
            raise EngineError("the engine is shut down")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def deliver(item: RequestOutput | BaseException) -> None:
            # A caller whose event loop has closed (it stopped reading; its abort is on
            # the way) takes nothing more: that must not stop the engine thread.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outputs.put_nowait, item)

        # A continuation may add nothing: the previous turn's last token is still to feed.
        ids = [] if continue_from is not None and not prompt else self.llm.encode(prompt)
        request_id = request_id if request_id is not None else f"async-{uuid.uuid4().hex}"
        self._inbox.put(("add", (ids, sampling_params, request_id, continue_from,
                                 keep_cache, prompt if isinstance(prompt, str) else None,
                                 cache_salt, hold_kept, images, deliver)))
        # The text is made here, on the event loop, off the engine's step. A caller that
        # stops early closes this generator, and with it (at once) the one that aborts.
        async with contextlib.aclosing(request_outputs(
                outputs, request_id, RequestOutput.with_text,
                lambda: self._inbox.put(("abort", request_id)))) as outs:
            async for out in outs:
                yield out

    @property
    def failure(self) -> str | None:
        """Why the engine can serve nothing more (a lost rank); None while it serves."""
        return self.core.failure

    def encode(self, prompt: Prompt) -> list[int]:
        return self.llm.encode(prompt)

    async def call(self, name: str, *args: Any) -> Any:
        """The handler's method `name` on args, run by the engine thread between steps
        (what it returns or raises): as `EngineProcess.call`, with the engine in this
        process. Through the inbox, not the core's lock: a stepping thread takes the lock
        again as soon as it lets go, so a caller waiting on it could wait out a whole
        generation."""
        if self.handler is None:
            raise EngineError("this engine has no handler to call")
        if self._closed:
            raise EngineError("the engine is shut down")
        method = getattr(self.handler, name)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def reply(result: Any, error: BaseException | None) -> None:
            def put() -> None:
                if done.done():  # the caller was cancelled
                    return
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result(result)
            with contextlib.suppress(RuntimeError):  # the caller's loop has closed
                loop.call_soon_threadsafe(put)

        self._inbox.put(("call", (method, args, reply)))
        return await done

    def shutdown(self) -> None:
        """Stop the engine thread (requests still running are aborted)."""
        self._closed = True
        self._inbox.put(("stop", None))
        self._thread.join()
        self.core.arrivals = None
        for request_id in list(self._deliver):
            self.core.abort(request_id)
        self.llm.close()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the engine thread -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            # Wait for work when there is none; otherwise take what arrived and step.
            idle = not self.core.has_unfinished_requests()
            with contextlib.suppress(queue.Empty):
                while True:
                    kind, what = self._inbox.get(block=idle)
                    idle = False
                    if kind == "stop":
                        return
                    self._take(kind, what)
            if self.core.has_unfinished_requests():
                try:
                    self.core.step()
                except Exception as error:  # the engine itself, not one request, failed
                    for request_id, deliver in list(self._deliver.items()):
                        deliver(error)  # ahead of the abort's own final output
                        self.core.abort(request_id)
                        self._deliver.pop(request_id, None)

    def _take(self, kind: str, what: Any) -> None:
        if kind == "call":
            method, args, reply = what
            try:
                result = method(*args)
            except Exception as error:  # the caller's to handle, not the engine's
                reply(None, error)
            else:
                reply(result, None)
            return
        if kind == "abort":
            self._deliver.pop(what, None)
            self.core.abort(what)
            self.core.router.forget(what)
            return
        (ids, params, request_id, continue_from, keep_cache, text, cache_salt, hold_kept,
         images, deliver) = what

        def route(out: RequestOutput) -> None:
            if out.finished:
                self._deliver.pop(out.request_id, None)
            deliver(out)

        try:
            self.core.add_request(ids, params or SamplingParams(), text, request_id,
                                  continue_from, keep_cache, on_output=route,
                                  cache_salt=cache_salt, hold_kept=hold_kept, images=images)
        except (ValueError, EngineError) as error:  # refused, or the engine has stopped
            deliver(error)
            return
        self._deliver[request_id] = deliver


async def request_outputs(outputs: "asyncio.Queue[RequestOutput | BaseException]",
                          request_id: str, text: Callable[[RequestOutput], RequestOutput],
                          abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs as a front end's deliveries put them on `outputs`, each with
    its text made (`text`), the final one last: a refusal (ValueError) raised as it is,
    an engine's failure as EngineError; `abort` when the caller stops before the end."""
    finished = False
    try:
        while not finished:
            item = await outputs.get()
            if isinstance(item, ValueError):
                raise item
            if isinstance(item, BaseException):
                raise EngineError(f"request {request_id}: the engine failed: "
                                  f"{type(item).__name__}: {item}") from item
            finished = item.finished
            yield text(item)
    finally:
        if not finished:
            abort()
