"""The engine core in a process of its own, as vLLM v1 runs its EngineCore: a server's
event loop (HTTP, server-sent events, tokenising prompts, detokenising replies) then runs
beside the step instead of taking turns with it for one interpreter.

`EngineProcess(build, handler)` starts a child process (spawned: no copy of the parent's
threads or locks) that calls `build()` for its `LLM` and `handler(llm)` for the object
whose methods front ends call by name (`call`), then loops: it takes what arrived from the
front end (requests, aborts, calls) between steps, steps while there is work, and sends
each output back as the step hands it over, without its text; the front end makes the
text (`RequestOutput.with_text`) from its own copy of the tokenizer. A request arriving
mid-step ends the step after its current prompt call (`EngineCore.arrivals`), as in the
threaded `AsyncLLM`. The child dies with its parent: a closed pipe ends its loop.

Front ends see what `AsyncLLM` offers (`generate`, `call`, `encode`, `failure`, `info`,
`shutdown`); a failure of the child's engine reaches every request as `EngineError`, and
a child that exits (killed, out of memory) fails every request and call in flight and
reports itself through `failure`.
"""

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from kvstack.engine.async_llm import EngineInfo, request_outputs
from kvstack.engine.core import EngineError
from kvstack.engine.llm import LLM, Prompt, encode_prompt
from kvstack.engine.output import Detokenizer
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput
from kvstack.model.vision import ImageSegment

log = logging.getLogger("kvstack")


class EngineProcess:
    def __init__(self, build: Callable[[], LLM], handler: Callable[[LLM], Any]) -> None:
        """build: makes the engine in the child (picklable: a module-level function or a
        functools.partial of one); handler: makes, from that engine, the object `call`
        reaches. Returns once the engine is loaded; an engine that fails to load raises
        ValueError with the child's message."""
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_run_engine, args=(child, build, handler),
                                        name="kvstack-engine", daemon=True)
        self._process.start()
        child.close()
        try:
            kind, what = self._conn.recv()
        except EOFError:
            kind, what = "failed", f"the engine process exited (code {self._exit_code()})"
        if kind == "failed":
            self._process.join()
            raise ValueError(what)
        self.info: EngineInfo = what
        self.tokenizer = self.info.tokenizer
        self._send_lock = threading.Lock()  # the event loop and worker threads send
        # request id -> how to hand it an output or a failure (called on the reader thread)
        self._deliver: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._failure: str | None = None
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="kvstack-engine-reader",
                                        daemon=True)
        self._reader.start()
        # Before multiprocessing's own exit hook, which would signal the child (ignored
        # there) and wait for it.
        atexit.register(self.shutdown)

    # ---- what a front end asks ---------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """Why the engine can serve nothing more (a lost rank, its process gone); None
        while it serves."""
        return self._failure

    def encode(self, prompt: Prompt) -> list[int]:
        """`LLM.encode`, here: token ids of text or checked ids."""
        return encode_prompt(self.tokenizer, self.info.config.vocab_size, prompt)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, continue_from: str | None = None,
                       keep_cache: bool = False, cache_salt: str | None = None,
                       hold_kept: bool = False,
                       images: list[ImageSegment] | None = None) -> AsyncIterator[RequestOutput]:
        """`AsyncLLM.generate`, the request run in the engine's process."""
        if self._closed or self._failure is not None:
            raise EngineError(self._failure or "the engine is shut down")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def deliver(item: RequestOutput | BaseException) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop has closed
                loop.call_soon_threadsafe(outputs.put_nowait, item)

        ids = [] if continue_from is not None and not prompt else self.encode(prompt)
        request_id = request_id if request_id is not None else f"async-{uuid.uuid4().hex}"
        detokenizer = Detokenizer(self.tokenizer, ())

        def text(out: RequestOutput) -> RequestOutput:
            # A request with stop strings got its text in the step.
            return out if out.text is not None else replace(
                out, detokenizer=detokenizer).with_text()

        self._deliver[request_id] = deliver
        try:
            self._send(("add", (ids, sampling_params, request_id, continue_from, keep_cache,
                                prompt if isinstance(prompt, str) else None, cache_salt,
                                hold_kept, images)))
        except (OSError, EOFError):  # the child has just gone: the reader will say why
            self._deliver.pop(request_id, None)
            raise EngineError(self._failure or "the engine process has exited") from None
        async with contextlib.aclosing(request_outputs(
                outputs, request_id, text, lambda: self._abort(request_id))) as outs:
            async for out in outs:
                yield out

    async def call(self, name: str, *args: Any) -> Any:
        """The handler's method `name` run on args in the engine's process, between steps;
        what it returns or raises."""
        if self._closed or not self._process.is_alive():
            raise EngineError(self._failure or "the engine is shut down")
        call_id = next(self._call_ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls[call_id] = future
        try:
            self._send(("call", (call_id, name, args)))
        except (OSError, EOFError):
            self._calls.pop(call_id, None)
            raise EngineError(self._failure or "the engine process has exited") from None
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        """Stop the engine (requests still running are aborted) and its process."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        with contextlib.suppress(OSError, EOFError):
            self._send(("stop", None))
        self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(timeout=10)
        self._conn.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the pipe ----------------------------------------------------------------------
    def _send(self, message: tuple[str, Any]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _abort(self, request_id: str) -> None:
        self._deliver.pop(request_id, None)
        if not self._closed:
            with contextlib.suppress(OSError, EOFError):
                self._send(("abort", request_id))

    def _exit_code(self) -> int | None:
        self._process.join(timeout=5)
        return self._process.exitcode

    def _read(self) -> None:
        """The reader thread: each message from the engine to whoever waits on it."""
        while True:
            try:
                kind, what = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "out":
                deliver = self._deliver.get(what.request_id)
                if what.finished:
                    self._deliver.pop(what.request_id, None)
                if deliver is not None:
                    deliver(what)
            elif kind == "refused":  # (request id, the error)
                deliver = self._deliver.pop(what[0], None)
                if deliver is not None:
                    deliver(what[1])
            elif kind == "result":  # (call id, raised, value or error)
                future = self._calls.pop(what[0], None)
                if future is not None:
                    (future.set_exception if what[1] else future.set_result)(what[2])
            elif kind == "failure":
                self._failure = what
        gone = EngineError(self._failure or (
            "the engine is shut down" if self._closed else
            f"the engine process exited (code {self._exit_code()})"))
        if not self._closed:
            self._failure = str(gone)
            log.error("kvstack: %s", gone)
        for deliver in list(self._deliver.values()):
            deliver(gone)
        self._deliver.clear()
        for future in list(self._calls.values()):
            future.set_exception(gone)
        self._calls.clear()


# ---- the child ---------------------------------------------------------------------------
def _run_engine(conn: Any, build: Callable[[], LLM], handler: Callable[[LLM], Any]) -> None:
    # Ctrl-C in a terminal, or a service manager's SIGTERM to the whole process group,
    # reaches this process too: the parent drains the server and then stops this process,
    # in that order. A parent gone without a word closes the pipe, which ends the loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = build()
        target = handler(llm)
    except Exception as e:
        conn.send(("failed", str(e)))
        return
    conn.send(("ready", EngineInfo.of(llm)))
    try:
        _EngineHost(llm, target, conn).run()
    finally:
        llm.close()


class _EngineHost:
    """The child's loop: the front end's messages between steps, and steps."""

    def __init__(self, llm: LLM, target: Any, conn: Any) -> None:
        self.llm, self.core, self.target, self.conn = llm, llm.core, target, conn
        self.running: set[str] = set()  # requests the front end waits on
        self.failure: str | None = None
        self.core.arrivals = conn.poll

    def run(self) -> None:
        core = self.core
        while True:
            busy = core.has_unfinished_requests()
            try:
                while self.conn.poll(0 if busy else None):
                    kind, what = self.conn.recv()
                    if kind == "stop":
                        self._stop()
                        return
                    self._take(kind, what)
                    busy = core.has_unfinished_requests()
            except (EOFError, OSError):  # the front end is gone
                self._stop()
                return
            if busy:
                try:
                    core.step()
                except Exception as error:  # the engine itself, not one request, failed
                    for request_id in list(self.running):
                        self._send("refused", (request_id, _picklable(error)))
                        core.abort(request_id)
                    self.running.clear()
                self._report_failure()

    def _take(self, kind: str, what: Any) -> None:
        if kind == "abort":
            self.running.discard(what)
            self.core.abort(what)
            self.core.router.forget(what)
        elif kind == "add":
            self._add(*what)
        elif kind == "call":
            call_id, name, args = what
            try:
                result = getattr(self.target, name)(*args)
            except Exception as e:
                self._send("result", (call_id, True, _picklable(e)))
            else:
                self._send("result", (call_id, False, result))
            self._report_failure()

    def _add(self, ids: list[int], params: SamplingParams | None, request_id: str,
             continue_from: str | None, keep_cache: bool, text: str | None,
             cache_salt: str | None, hold_kept: bool,
             images: list[ImageSegment] | None) -> None:
        def route(out: RequestOutput) -> None:
            if out.finished:
                self.running.discard(out.request_id)
            # Without its detokenizer: the front end makes the text from its own.
            self._send("out", replace(out, detokenizer=None))

        try:
            self.core.add_request(ids, params or SamplingParams(), text, request_id,
                                  continue_from, keep_cache, on_output=route,
                                  cache_salt=cache_salt, hold_kept=hold_kept, images=images)
        except (ValueError, EngineError) as error:  # refused, or the engine has stopped
            self._send("refused", (request_id, _picklable(error)))
            return
        self.running.add(request_id)

    def _report_failure(self) -> None:
        failure = self.core.failure
        if failure is not None and failure != self.failure:
            self.failure = failure
            self._send("failure", failure)

    def _stop(self) -> None:
        for request_id in list(self.running):
            self.core.abort(request_id)
        self.running.clear()
        self.core.arrivals = None

    def _send(self, kind: str, what: Any) -> None:
        with contextlib.suppress(OSError, EOFError):  # the front end is gone
            self.conn.send((kind, what))


def _picklable(error: Exception) -> Exception:
    """The error as the front end can receive it: its own type where that pickles with
    its message (ValueError, EngineError, ...), else RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
