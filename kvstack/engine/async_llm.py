"""The asyncio front end (vLLM's AsyncLLM): the engine core steps in a thread of its own
while there is work, and each request's outputs reach the coroutine that asked for them on
its event loop. An HTTP server is many such coroutines; sync front ends (`LLM.generate`,
sessions) may share the same core from other threads meanwhile.
"""

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from kvstack.config import ModelConfig
from kvstack.engine.config import EngineConfig
from kvstack.engine.core import EngineError
from kvstack.engine.llm import LLM, Prompt
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput


class AsyncLLM:
    def __init__(self, model: "str | Path | ModelConfig | LLM" = "default",
                 engine_config: EngineConfig | None = None, **settings: Any) -> None:
        """An LLM to serve (or what builds one, as `LLM(model, engine_config, ...)`)."""
        self.llm = model if isinstance(model, LLM) else LLM(model, engine_config, **settings)
        self.core = self.llm.core
        self._work = threading.Condition()
        self._closed = False
        # request id -> how to hand it an output or an engine failure
        self._deliver: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._loop, name="kvstack-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, continue_from: str | None = None,
                       keep_cache: bool = False) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them, the final one last. Bad input
        raises ValueError before anything is queued; a caller that stops iterating early
        (a closed connection) aborts the request. continue_from / keep_cache: as
        `LLM.add_request`'s (a conversation kept in the cache between turns)."""
        if self._closed:
            raise EngineError("the engine is shut down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def deliver(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        with self.core.lock:  # no step may route an output before it is subscribed
            request_id = self.llm.add_request(prompt, sampling_params, request_id,
                                              continue_from, keep_cache, on_output=deliver)
            self._deliver[request_id] = deliver
        with self._work:
            self._work.notify()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"request {request_id}: the engine failed: "
                                      f"{type(item).__name__}: {item}") from item
                finished = item.finished
                yield item
        finally:
            self._deliver.pop(request_id, None)
            if not finished:
                self.core.abort(request_id)
                self.core.router.forget(request_id)

    def shutdown(self) -> None:
        """Stop the engine thread (requests still running are aborted)."""
        with self._work:
            self._closed = True
            self._work.notify()
        self._thread.join()
        for request_id in list(self._deliver):
            self.core.abort(request_id)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _loop(self) -> None:
        while True:
            with self._work:
                while not self._closed and not self.core.has_unfinished_requests():
                    self._work.wait()
                if self._closed:
                    return
            try:
                self.core.step()
            except Exception as error:  # the engine itself, not one request, failed
                for request_id, deliver in list(self._deliver.items()):
                    deliver(error)  # ahead of the abort's own final output
                    self.core.abort(request_id)
