"""`kvstack serve`: the OpenAI API over the engine (FastAPI, SSE streaming as OpenAI does it).

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/sessions`, `GET|DELETE /v1/sessions/{name}`, `GET /health`, `GET /metrics`.
Requests run through one engine: `kvstack serve` runs its core in a process of its own
(`EngineProcess`), so that HTTP work never waits on the step's interpreter; a request
whose client goes away is aborted and its blocks freed. The waiting queue is bounded (429
with Retry-After beyond it); on shutdown (SIGTERM) the server stops admitting, lets
running requests finish within the grace period and aborts the rest; sessions are on disk
already (each turn saves its session).
"""

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstack.cache.disk import check_session_name
from kvstack.engine.async_llm import AsyncLLM
from kvstack.engine.chat_template import ChatTemplate
from kvstack.engine.core import EngineError
from kvstack.engine.llm import place_images
from kvstack.engine.process import EngineProcess
from kvstack.engine.sampling import PromptLogprob, SamplingParams
from kvstack.engine.sequence import RequestOutput
from kvstack.model.vision import ImageSegment
from kvstack.serve.engine_ops import ServeOps
from kvstack.serve.guards import RequestGate, guarded_protocol
from kvstack.serve.metrics import ServerMetrics
from kvstack.serve.protocol import (
    IMAGE_MARK,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Request,
)
from kvstack.serve.reporting import AccessLog, log_stats
from kvstack.serve.sessions import HttpSessions, marked_ids
from kvstack.serve.tool_calls import PARSERS, ToolParser, tool_parser

log = logging.getLogger("kvstack")
SESSION_HEADER = "x-kvstack-session"



@dataclass(frozen=True)
class ServeConfig:
    """The server's settings, checked once here."""
    model_name: str  # what /v1/models lists and requests must name
    api_keys: tuple[str, ...] = ()  # any of them opens /v1; with several, one tenant each
    share_prefix_cache: bool = False  # tenants' prompts hit each other's cached blocks
    max_waiting: int = 256  # requests beyond the running batch before 429
    disconnect_poll_s: float = 0.2  # how often a non-streaming request checks its client
    host: str = "127.0.0.1"
    port: int = 8000
    grace_period_s: float = 30.0  # a shutdown lets running requests finish this long
    max_body_bytes: int = 16 << 20  # a request body past this is 413, unread
    request_timeout_s: float = 30.0  # a request must arrive whole (headers, body) in this
    max_connections: int = 1024  # open connections; the oldest idle one makes room
    default_max_tokens: int = 1024  # for a request that sets none (0: the rest of the context)
    stats_interval_s: float = 10.0  # a stats line this often while there is work
    long_request_s: float = 120.0  # a request running longer is logged (once)
    tool_call_parser: str | None = None  # the syntax of tool calls; None: the template's

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if not key or not key.isascii() or not key.isprintable() or " " in key:
                raise ValueError("an API key must be printable ASCII without spaces")
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be 0 or more, got {self.max_waiting}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1..65535, got {self.port}")
        if self.default_max_tokens < 0:
            raise ValueError(f"--default-max-tokens must be 0 or more, got "
                             f"{self.default_max_tokens}")
        for name in ("grace_period_s", "request_timeout_s", "stats_interval_s",
                     "long_request_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: one of "
                             f"{', '.join(PARSERS)}")


def bind(config: ServeConfig) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use is said at once,
    and "serving on" is logged only once the address is ours."""
    try:
        family = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)[0][0]
        # TCP by name: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on the
        # connections of a socket whose protocol says TCP. With it on, a stream's small
        # writes on a kept-alive connection wait for the client's delayed ACK (about 40
        # ms): every token of a response after the first request on a connection.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except OSError as e:
        raise ValueError(f"--host {config.host!r}: {e.strerror or e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {config.host}:{config.port}: "
                         f"{e.strerror or e}") from None
    return sock


def serve_app(app: FastAPI, config: ServeConfig, sock: socket.socket) -> None:
    """Run the app under uvicorn on `sock` (from `bind`) until SIGINT or SIGTERM; after a
    graceful shutdown the process exits normally (uvicorn's own handlers re-raise the
    signal once done, so the process would end killed by it)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {s: signal.signal(s, self.handle_exit)
                        for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning",
        timeout_graceful_shutdown=config.grace_period_s,
        http=guarded_protocol(config.request_timeout_s, config.max_connections))
    ).run(sockets=[sock])


Engine = AsyncLLM | EngineProcess


def build_app(engine: Engine, config: ServeConfig) -> FastAPI:
    """The server over `engine`: an engine in its own process (what `kvstack serve` runs,
    its handler `ServeOps`), or one stepping in a thread of this process."""
    if isinstance(engine, AsyncLLM) and engine.handler is None:
        engine.handler = ServeOps(engine.llm)
    info = engine.info
    metrics = ServerMetrics(config.model_name)
    sessions = HttpSessions(engine, metrics)
    template = ChatTemplate.for_model(info.model_dir)
    parser, chosen_by = tool_parser(config.tool_call_parser, template.source)
    log.info("kvstack serve: tool calls in the %s syntax (by %s)", parser.name, chosen_by)
    state = {"admitting": True, "in_flight": 0}
    limit = info.engine_config.max_num_seqs + config.max_waiting

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats = asyncio.create_task(log_stats(engine, metrics, config.stats_interval_s))
        yield
        stats.cancel()
        state["admitting"] = False
        saved = None
        with contextlib.suppress(EngineError):  # an engine that has stopped counts none
            saved = await engine.call("saved_sessions")
        await asyncio.to_thread(engine.shutdown)
        log.info("kvstack serve: stopped (%s sessions on disk)", "?" if saved is None else saved)

    app = FastAPI(title="kvstack", lifespan=lifespan)
    # The key and the body's size are checked before the body is read (guards.py).
    app.add_middleware(RequestGate, api_keys=config.api_keys,
                       max_body_bytes=config.max_body_bytes)
    app.add_middleware(AccessLog)  # outermost: refused requests are logged too

    def tenant(request: Request) -> str | None:
        return getattr(request.state, "tenant", None)
    app.state.sessions = sessions

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first.get("type") == "json_invalid":  # its location is a character offset
            at = first.get("loc", ("body", "?"))[-1]
            why = first.get("ctx", {}).get("error", first["msg"])
            return JSONResponse(APIError(400, f"the request body is not valid JSON (at "
                                              f"character {at}: {why})").body(),
                                status_code=400)
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = where[0] if where else None
        return JSONResponse(APIError(400, f"{'.'.join(where) or 'body'}: {first['msg']}",
                                     param).body(), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        # 503 while shutting down, and once the engine can serve nothing (a lost rank):
        # a load balancer then takes this server out.
        failure = engine.failure
        if state["admitting"] and failure is None:
            return Response(status_code=200)
        return JSONResponse({"status": "shutting down" if failure is None else failure},
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            metrics.engine.stats = await engine.call("stats")  # read between steps
        except EngineError:  # stopped: the server's own series still count
            metrics.engine.stats = None
        text = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    model_card = {"id": config.model_name, "object": "model", "created": 0,
                  "owned_by": "kvstack", "max_model_len": info.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != config.model_name:
            raise APIError(404, f"model {model_id!r} is not served here (this server: "
                           f"{config.model_name!r})", "model", code="model_not_found")
        return model_card

    # vLLM's tokenizer endpoints (what lm-eval's `tokenizer_backend=remote` reads).
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        text = body.prompt if body.messages is None else template.render(
            [{"role": m.role, "content": m.text(parser)} for m in body.messages])
        if text is None:
            raise APIError(400, "give a prompt or messages", "prompt")
        ids = engine.tokenizer.encode(text) if text else []
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        # As vLLM's (and HF's decode): special tokens written out, not skipped.
        try:
            ids = engine.encode(body.tokens) if body.tokens else []
            return {"prompt": engine.tokenizer.decode(ids, skip_special=False)}
        except ValueError as e:
            raise APIError(400, str(e), "tokens") from None

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        eos = engine.tokenizer.eos_id
        eos_token = None if eos is None else engine.tokenizer.decode([eos], skip_special=False)
        return {"tokenizer_class": type(engine.tokenizer).__name__, "eos_token": eos_token,
                "bos_token": None, "pad_token": None,
                "model_max_length": info.max_model_len}

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        return {"object": "list",
                "data": await sessions.list(tenant(request))}

    @app.get("/v1/sessions/{name}")
    async def show_session(name: str, request: Request) -> dict[str, Any]:
        return await sessions.show(tenant(request), name)

    @app.delete("/v1/sessions/{name}")
    async def delete_session(name: str, request: Request) -> dict[str, Any]:
        await sessions.delete(tenant(request), name)
        return {"id": name, "object": "session", "deleted": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = body.prompts()
        if len(prompts) > 1 and (body.session or request.headers.get(SESSION_HEADER)):
            raise APIError(400, "a session continues one conversation: send one prompt",
                           "prompt")
        return await serve(body, request, prompts, (), "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        urls = [url for m in body.messages for url in m.image_urls()]
        mark = IMAGE_MARK if urls else None
        # The developer role is OpenAI's newer name for system.
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text(parser, mark)} for m in body.messages]
        tools = [{k: f[k] for k in ("name", "description", "parameters") if k in f}
                 for f in body.functions().values()]
        try:
            text = template.render(messages, tools)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        if not urls:
            return await serve(body, request, [text], template.stop, "chat.completion")
        # Each picture's part becomes the image token, then its whole segment.
        ids = marked_ids(info, text)
        try:  # decoding pictures is the request's own work, off the event loop
            ids, segments = await asyncio.to_thread(place_images, ids, urls, info.config,
                                                    info.engine_config.image_bytes)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        return await serve(body, request, [ids], template.stop, "chat.completion",
                           (segments, text))

    async def serve(body: _Request, request: Request, prompts: list[str | list[int]],
                    stop: tuple[str, ...], kind: str,
                    pictures: tuple[list[ImageSegment], str] | None = None) -> Response:
        """pictures: a chat's picture segments and its text with each picture marked."""
        body.check()
        if body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} is not served here (this server: "
                           f"{config.model_name!r})", "model", code="model_not_found")
        if not state["admitting"]:
            raise APIError(503, "the server is shutting down", kind="server_error")
        if (failure := engine.failure) is not None:
            raise APIError(503, f"the engine has stopped: {failure}", kind="server_error")
        if state["in_flight"] >= limit:
            raise APIError(429, f"{state['in_flight']} requests are in flight (the limit is "
                           f"{limit}); retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": "1"})
        where = "prompt" if kind == "text_completion" else "messages"
        encoded = []
        for prompt in prompts:
            try:
                encoded.append(engine.encode(prompt))
            except ValueError as e:
                raise APIError(400, str(e), where) from None
        longest = max(len(ids) for ids in encoded)
        room = info.max_model_len - longest
        if room <= 0:
            raise APIError(400, f"the prompt is {longest} tokens; this model takes "
                           f"{info.max_model_len} in all (prompt and completion)",
                           where, code="context_length_exceeded")
        # A request that sets no max_tokens gets the server's default (or the rest of the
        # context when that is 0), within the room left.
        wanted = body.max_tokens if body.max_tokens is not None else min(
            room, config.default_max_tokens or room)
        if wanted > room:
            raise APIError(400, f"max_tokens {wanted} with a prompt of {longest} tokens "
                           f"exceeds the context of {info.max_model_len} tokens",
                           "max_tokens", code="context_length_exceeded")
        echo = getattr(body, "echo", False)
        top = getattr(body, "prompt_logprobs", None)
        if echo and body.top_logprobs_wanted() is not None:
            top = max(top or 0, body.top_logprobs_wanted())
        scores: list[list[PromptLogprob | None] | None] = [None] * len(encoded)
        if top is not None:  # the prompt's own log-probabilities (lm-eval's scoring)
            try:
                scores = [await engine.call("prompt_logprobs", ids, top)
                          for ids in encoded]
            except ValueError as e:
                raise APIError(400, str(e), "prompt_logprobs") from None
        inputs = [PromptInput(ids, p if isinstance(p, str) else None, s, *(pictures or ()))
                  for ids, p, s in zip(encoded, prompts, scores, strict=True)]
        # max_tokens 0 scores the prompt and generates nothing (no engine request).
        params = [body.sampling(max(wanted, 1), stop, parser)]
        if params[0].constrained:  # compiled (and cached) before it is queued
            try:
                await engine.call("compile_grammar", params[0])
            except ValueError as e:
                field = "tools" if body.tool_grammar(parser) else "response_format"
                raise APIError(400, str(e), field) from None
        vocab = info.config.vocab_size
        for field, ids in (("stop_token_ids", params[0].stop_token_ids),
                           ("logit_bias", [t for t, _ in params[0].logit_bias])):
            if any(t >= vocab for t in ids):
                raise APIError(400, f"{field}: token ids must be below the vocabulary size "
                                    f"{vocab}", field)
        if body.seed is not None and body.seed + body.n > 1 << 64:
            raise APIError(400, f"seed {body.seed} with n={body.n}: the samples take seeds "
                           f"seed … seed+n-1, which must stay below 2**64", "seed")
        for i in range(1, body.n):  # n samples: seeds apart, so they differ when sampled
            seed = None if body.seed is None else body.seed + i
            params.append(SamplingParams(**{**params[0].__dict__, "seed": seed}))
        name = body.session or request.headers.get(SESSION_HEADER)
        if name is not None:
            try:  # before the turn runs: a name that cannot be saved is refused up front
                check_session_name(name)
            except ValueError as e:
                raise APIError(400, str(e), "session") from None
            if sessions.stored(tenant(request), name) in sessions.busy:
                raise APIError(409, f"session {name!r} is running another request",
                               "session", code="session_busy")
        # Each tenant's prompts hit only its own cached blocks (unless the operator shares
        # them); a request's own cache_salt narrows that further, as in vLLM.
        salts = [s for s in (None if config.share_prefix_cache else tenant(request),
                             body.cache_salt) if s is not None]
        cache_salt = "|".join(salts) if salts else None
        run = Run(engine, sessions, metrics, name, inputs, params, body, kind, tenant(request),
                  cache_salt, generate=wanted > 0, request_state=request.state,
                  long_request_s=config.long_request_s, parser=parser)
        state["in_flight"] += 1

        def finished() -> None:
            state["in_flight"] -= 1

        if body.stream:
            # The engine requests start here, not when the body is first read: a client
            # gone before that still has them run out and counted off.
            run.start(finished)
            return StreamingResponse(run.events(), media_type="text/event-stream")
        try:
            return JSONResponse(await run.complete(request))
        finally:
            finished()

    return app


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a request: its ids, its text (None: given as ids), and its tokens'
    log-probabilities when the request asked for them (echo with logprobs,
    prompt_logprobs)."""

    ids: list[int]
    text: str | None
    scores: list[PromptLogprob | None] | None
    images: list[ImageSegment] | None = None  # the segments of the pictures its ids hold
    marked: str | None = None  # with pictures: its text, each picture an IMAGE_MARK


class Run:
    """One API request: n engine requests for each of its prompts (or one session turn),
    as a response body or as server-sent events. Choice i is sample i % n of prompt
    i // n, as in the OpenAI API."""

    def __init__(self, engine: Engine, sessions: HttpSessions, metrics: ServerMetrics,
                 session: str | None, prompts: list[PromptInput],
                 params: list[SamplingParams], body: _Request, kind: str,
                 tenant: str | None = None, cache_salt: str | None = None, *,
                 generate: bool, request_state: Any, long_request_s: float,
                 parser: ToolParser) -> None:
        self.engine, self.sessions, self.metrics = engine, sessions, metrics
        self.tenant, self.cache_salt, self.generate = tenant, cache_salt, generate
        self.request_state = request_state  # the endpoint's usage goes there, for the log
        self.long_request_s = long_request_s
        self.session, self.prompts, self.params, self.body, self.kind = (
            session, prompts, params, body, kind)
        self.id = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = len(prompts) * len(params)
        self.finals: list[RequestOutput | None] = [None] * self.choices
        self.counted: set[int] = set()  # choices counted as aborted or failed
        self.tokenizer = engine.tokenizer
        # Tools on: a reply's calls are found by the parser of the model's syntax; a stream
        # sends text until a call may be starting, and the calls once the reply is done.
        self.functions = body.functions() if isinstance(body, ChatRequest) else {}
        self.parser = parser

    def _prompt(self, index: int) -> PromptInput:
        return self.prompts[index // len(self.params)]

    async def _outputs(self, index: int) -> AsyncIterator[RequestOutput]:
        """Engine outputs of choice `index`, with the latency metrics recorded."""
        start = last = time.perf_counter()
        prompt, params = self._prompt(index), self.params[index % len(self.params)]
        if not self.generate:  # max_tokens 0: the prompt alone, nothing to run
            out = RequestOutput(self.id, prompt.text, prompt.ids, "", [], "length", True,
                                None, {}, 0, [] if params.logprobs is not None else None)
            self.finals[index] = out
            self.metrics.record(out, 0.0)
            yield out
            return
        if self.session is not None:
            outputs = self.sessions.turn(self.tenant, self.session, prompt.ids, params,
                                         self.cache_salt, prompt.text, prompt.images,
                                         prompt.marked)
        else:
            outputs = self.engine.generate(prompt.ids, params, cache_salt=self.cache_salt,
                                           images=prompt.images)
        warned, seen = False, 0
        totals = self.metrics.totals
        async with contextlib.aclosing(outputs) as stream:
            async for out in stream:
                now = time.perf_counter()
                if not seen and out.token_ids:
                    totals["prompt"] += len(out.prompt_token_ids) - out.num_cached_tokens
                totals["generation"] += len(out.token_ids) - seen
                seen = len(out.token_ids)
                if not warned and now - start > self.long_request_s:
                    warned = True
                    log.warning("kvstack: request %s has run %.0f s: %d tokens so far of "
                                "max_tokens %d", self.id, now - start, len(out.token_ids),
                                params.max_tokens)
                if len(out.token_ids) > 1:
                    self.metrics.itl.observe(now - last)
                last = now
                if out.finished:
                    self.finals[index] = out
                    self.metrics.record(out, now - start)
                yield out

    async def complete(self, request: Request) -> dict[str, Any]:
        async def collect(index: int) -> RequestOutput:
            final = None
            async for out in self._outputs(index):
                final = out
            return final

        task = asyncio.gather(*(collect(i) for i in range(self.choices)))
        while not task.done():  # a client that hangs up cancels its request
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                self._count_unfinished("abort")
                raise APIError(499, "the client closed the request", kind="cancelled")
        finals = task.result()
        for out in finals:
            if out.finish_reason == "error":
                raise APIError(500, f"the engine failed on this request: {out.error}",
                               kind="server_error")
        choices = [self._choice(i, out, out.text, 0, final=True)
                   for i, out in enumerate(finals)]
        self.request_state.usage = usage = self._usage(finals)
        return {"id": self.id, "object": self.kind, "created": self.created,
                "model": self.body.model, "choices": choices, "usage": usage}

    def start(self, finished: Callable[[], None]) -> None:
        """Run the engine requests of a streamed response, their outputs to `self.queue`
        ((index, output), then (index, None) or (index, the error) when one ends);
        `finished` once all have ended."""
        self.queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = (
            asyncio.Queue())

        async def pump(index: int) -> None:
            end: Exception | None = None
            try:
                async for out in self._outputs(index):
                    self.queue.put_nowait((index, out))
            except Exception as e:  # refused (a busy session), or the engine failed
                end = e
            finally:
                self.queue.put_nowait((index, end))

        self.tasks = [asyncio.create_task(pump(i)) for i in range(self.choices)]
        asyncio.gather(*self.tasks, return_exceptions=True).add_done_callback(
            lambda _: finished())

    async def events(self) -> AsyncIterator[str]:
        queue, tasks = self.queue, self.tasks
        sent = [""] * self.choices
        sent_tokens = [0] * self.choices
        open_choices = len(tasks)
        try:
            if self.kind == "chat.completion":
                for i in range(len(tasks)):
                    yield self._event([{"index": i, "delta": {"role": "assistant",
                                                              "content": ""},
                                        "finish_reason": None, "logprobs": None}])
            while open_choices:
                index, out = await queue.get()
                if isinstance(out, Exception):
                    error = out if isinstance(out, APIError) else APIError(
                        500, f"{type(out).__name__}: {out}", kind="server_error")
                    if error.status >= 500:
                        self._count_unfinished("error")
                    yield "data: " + _json(error.body()) + "\n\n"
                    break
                if out is None:
                    open_choices -= 1
                    continue
                if out.finish_reason == "error":
                    yield "data: " + _json(APIError(500, f"the engine failed on this "
                                                    f"request: {out.error}",
                                                    kind="server_error").body()) + "\n\n"
                    break
                done = len(sent[index])
                upto = (self.parser.text_end(out.text) if self.functions and not out.finished
                        else len(out.text))
                delta, sent[index] = out.text[done:upto], out.text[:max(upto, done)]
                if delta or out.finished:
                    yield self._event([self._choice(index, out, delta, sent_tokens[index],
                                                    out.finished)])
                    sent_tokens[index] = len(out.token_ids)
            else:
                self.request_state.usage = self._usage(self.finals)  # for the access log
                options = self.body.stream_options
                if options is not None and options.include_usage:
                    yield self._event([], usage=self.request_state.usage)
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:  # a client gone mid-stream: its requests are aborted
                task.cancel()
            # Counted before waiting: under the response's cancelled scope every await
            # here raises again.
            self._count_unfinished("abort")
            await asyncio.gather(*tasks, return_exceptions=True)

    def _count_unfinished(self, reason: str) -> None:
        """Count the choices that end without a final output (once each)."""
        for i, final in enumerate(self.finals):
            if final is None and i not in self.counted:
                self.counted.add(i)
                self.metrics.finished.labels(self.metrics.model_name, reason).inc()

    def _choice(self, index: int, out: RequestOutput, text: str, first_token: int,
                final: bool) -> dict[str, Any]:
        """Choice `index` carrying `text` and the log-probabilities of its tokens from
        `first_token` on (when asked for); a finished reply that calls tools carries its
        calls instead, and what text around them the stream has not sent."""
        reason = ("length" if out.finish_reason == "length" else "stop") if final else None
        prompt = self._prompt(index)
        parsed = self.parser.parse(out.text, self.functions) if (
            final and self.functions) else None
        echo = first_token == 0 and getattr(self.body, "echo", False)
        if parsed is not None:  # `text` is what the stream has not sent yet
            sent = out.text[:len(out.text) - len(text)].strip()
            rest = parsed.content or ""
            rest = rest[len(sent):] if rest.startswith(sent) else ""
            calls = [call.openai() for call in parsed.calls]
            if self.body.stream:
                content = {"delta": {"content": rest or None, "tool_calls": [
                    {"index": i, **call} for i, call in enumerate(calls)]}}
            else:
                content = {"message": {"role": "assistant", "content": rest or None,
                                       "tool_calls": calls}}
            reason = "tool_calls"
        elif self.kind != "chat.completion":
            if echo:  # the prompt first, in the choice's first text
                text = (prompt.text if prompt.text is not None
                        else self.tokenizer.decode(prompt.ids)) + text
            content = {"text": text}
        elif self.body.stream:
            content = {"delta": {"content": text}}
        else:
            content = {"message": {"role": "assistant", "content": text}}
        choice = {"index": index, **content, "finish_reason": reason,
                  "logprobs": self._logprobs(out, first_token, prompt if echo else None)}
        if first_token == 0 and getattr(self.body, "prompt_logprobs", None) is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt)
        if self.body.return_token_ids and final:
            choice["token_ids"] = list(out.token_ids)
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice

    def _logprobs(self, out: RequestOutput, first: int,
                  echoed: PromptInput | None = None) -> dict[str, Any] | None:
        """The OpenAI API's logprobs of out's tokens from `first` on: per token for chat,
        as parallel lists for completions; with an `echoed` prompt, its tokens' first (the
        first one's null: nothing comes before it)."""
        if out.logprobs is None:
            return None
        ids, entries = out.token_ids[first:], out.logprobs[first:]
        name = self.tokenizer.decode
        if self.kind == "chat.completion":
            def token(i: int, logprob: float) -> dict[str, Any]:
                text = name([i])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [token(i, e.logprob) | {"top_logprobs": [
                token(t, lp) for t, lp in e.top]} for i, e in zip(ids, entries, strict=True)]}
        logprobs: list[float | None] = [e.logprob for e in entries]
        tops: list[dict[str, float] | None] = [{name([t]): lp for t, lp in e.top}
                                               for e in entries]
        if echoed is not None and echoed.scores is not None:
            ids = echoed.ids + ids
            logprobs = [s.logprob if s else None for s in echoed.scores] + logprobs
            tops = [{name([t]): lp for t, lp in s.top[: self.body.top_logprobs_wanted()]}
                    if s else None for s in echoed.scores] + tops
        texts = [name([i]) for i in ids]
        offsets = list(itertools.accumulate((len(t) for t in texts), initial=0))[:len(texts)]
        return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _prompt_logprobs(self, prompt: PromptInput) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token (null for the first), its own entry
        and the likeliest tokens', each {"logprob", "rank", "decoded_token"} by id."""
        name, wanted = self.tokenizer.decode, self.body.prompt_logprobs
        out: list[dict[str, Any] | None] = []
        for token, score in zip(prompt.ids, prompt.scores or [], strict=True):
            if score is None:
                out.append(None)
                continue
            entry = {str(token): {"logprob": score.logprob, "rank": score.rank,
                                  "decoded_token": name([token])}}
            for rank, (other, logprob) in enumerate(score.top[:wanted], start=1):
                entry.setdefault(str(other), {"logprob": logprob, "rank": rank,
                                              "decoded_token": name([other])})
            out.append(entry)
        return out

    def _event(self, choices: list[dict[str, Any]], usage: dict | None = None) -> str:
        kind = "chat.completion.chunk" if self.kind == "chat.completion" else self.kind
        event = {"id": self.id, "object": kind, "created": self.created,
                 "model": self.body.model, "choices": choices}
        if usage is not None:
            event["usage"] = usage
        return "data: " + _json(event) + "\n\n"

    def _usage(self, finals: list[RequestOutput | None]) -> dict[str, Any]:
        done = [f for f in finals if f is not None]
        n = len(self.params)
        if self.session is not None and done:  # the whole conversation the turn ran on
            prompt = len(done[0].prompt_token_ids)
        else:
            prompt = sum(len(p.ids) for p in self.prompts)
        completion = sum(len(f.token_ids) for f in done)
        # A prompt's cached tokens once (its n samples share the prefix).
        cached = sum(f.num_cached_tokens for i, f in enumerate(finals)
                     if f is not None and i % n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
