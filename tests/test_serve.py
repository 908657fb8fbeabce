"""`kvstack serve` against the official openai client: real server processes on 127.0.0.1."""

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from kvstack import LLM, SamplingParams

MODEL = "kvstack-default"
SETTINGS = ["--kv-budget", "64MiB", "--replay", "exact", "--threads", "1"]
LONG = ("import os\nimport sys\n\n\ndef main(argv):\n    parser = make_parser()\n"
        "    args = parser.parse_args(argv)\n    return run(args)\n") * 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cache_dir, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvstack.cli", "serve", "--port", str(self.port),
             "--cache-dir", str(cache_dir), *SETTINGS, *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.process.stdout.read()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError("server did not come up")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.aclient = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none",
                                          max_retries=0)

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.url + "/metrics").read().decode()
        for line in text.splitlines():
            if line.startswith(f"kvstack:{name} ") or line.startswith(f"kvstack:{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=60)
        finally:
            self.process.stdout.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "16")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def local():
    return LLM("default", kv_budget="64MiB", replay="exact", threads=1,
               cache_dir="/nonexistent-unused")


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_completions_equal_the_library_and_stream_the_same_text(server, local):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    expected = local.generate("def main(", SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))[0]
    out = server.client.completions.create(model=MODEL, prompt="def main(", **GREEDY)
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(
        expected.prompt_token_ids)
    chunks = list(server.client.completions.create(model=MODEL, prompt="def main(",
                                                   stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_server_over_two_ranks_serves_what_the_library_does(tmp_path, local):
    expected = local.generate("def main(", SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))[0]
    two = Server(tmp_path, "--tensor-parallel-size", "2")
    try:
        out = two.client.completions.create(model=MODEL, prompt="def main(", **GREEDY)
        assert out.choices[0].text == expected.text
    finally:
        assert two.stop() == 0  # the worker rank stops with the server


def test_chat_completions_plain_and_streamed(server):
    messages = [{"role": "system", "content": "code only"},
                {"role": "user", "content": "a parser"}]
    out = server.client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    text = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens <= 12
    stream = server.client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True},
        **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_a_repeated_prefix_reports_cached_tokens(server):
    first = server.client.completions.create(model=MODEL, prompt=LONG + "x = 1", **GREEDY)
    again = server.client.completions.create(model=MODEL, prompt=LONG + "y = 2", **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # a whole block at least


def test_bad_requests_are_refused_by_name(server):
    cases = (
        (dict(temperature=-1), 400, "temperature"),
        (dict(logprobs=30), 400, "logprobs"),
        (dict(extra_body={"logit_bias": {"five": 1}}), 400, "logit_bias"),
        (dict(presence_penalty=5), 400, "presence_penalty"),
        (dict(extra_body={"beam_width": 4}), 400, "beam_width"),
        (dict(max_tokens=10**6), 400, "max_tokens"),
    )
    for kwargs, status, param in cases:
        with pytest.raises(openai.APIStatusError) as e:
            server.client.completions.create(model=MODEL, prompt="x", **kwargs)
        assert e.value.status_code == status and e.value.body["param"] == param, kwargs
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        server.client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="prompt is 40000 tokens; this model "
                                                     "takes 32768"):
        server.client.completions.create(model=MODEL, prompt=[5] * 40000, max_tokens=1)


def test_logprobs_and_penalties(server):
    out = server.client.completions.create(model=MODEL, prompt="def main(", logprobs=2,
                                           frequency_penalty=1.0, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 12
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    messages = [{"role": "user", "content": "a parser"}]
    chat = server.client.chat.completions.create(model=MODEL, messages=messages,
                                                 logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy: the top
    streamed = server.client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, stream=True, **GREEDY)
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == [c.logprob for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        server.client.chat.completions.create(model=MODEL, messages=messages,
                                              top_logprobs=2, max_tokens=1)


def test_a_cancelled_stream_frees_its_blocks(server):
    before = server.metric("device_blocks_used")
    stream = server.client.completions.create(model=MODEL, prompt=LONG, stream=True,
                                              temperature=0, max_tokens=2000,
                                              extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 30
    while server.metric("num_requests_running") and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("num_requests_running") == 0
    assert server.metric("device_blocks_used") == before


def test_a_plain_request_whose_client_hangs_up_is_aborted(server):
    before = server.metric("device_blocks_used")
    impatient = server.client.with_options(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt=LONG, temperature=0,
                                     max_tokens=20000, extra_body={"ignore_eos": True})
    deadline = time.time() + 20  # far less than the 20,000 tokens would take
    while server.metric("num_requests_running") and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("num_requests_running") == 0
    assert server.metric("device_blocks_used") == before


def test_sixty_four_concurrent_streams_all_complete(server):
    async def one(i: int) -> int:
        stream = await server.aclient.completions.create(
            model=MODEL, prompt=f"def f{i}(", stream=True, temperature=0.7, seed=i,
            max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True})
        last = None
        async for chunk in stream:
            last = chunk
        return len(last.choices[0].token_ids)

    async def load() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(64)))

    before = server.metric("device_blocks_used")
    assert asyncio.run(load()) == [6] * 64
    assert server.metric("device_blocks_used") == before
    assert server.metric("num_requests_waiting") == 0


def test_a_session_across_requests_and_a_restart_equals_one_session(tmp_path, local):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    turns = [local.encode("def parse(text):\n"), local.encode("    # then\n"),
             local.encode("    return")]
    reference = local.session("ref")
    expected = []
    for ids in turns:
        reference.append(ids)
        expected.append(reference.generate(params).token_ids)

    def ask(s: Server, history: list[int]) -> list[int]:
        out = s.client.completions.create(
            model=MODEL, prompt=history, temperature=0, max_tokens=8,
            extra_body={"ignore_eos": True, "session": "agent", "return_token_ids": True})
        return out.choices[0].token_ids

    first = Server(tmp_path, "--max-num-seqs", "2", "--max-waiting", "0")
    history = turns[0]
    got = [ask(first, history)]
    history = history + got[0] + turns[1]
    got.append(ask(first, history))
    listed = first.client.get("/sessions", cast_to=object)
    assert [s["id"] for s in listed["data"]] == ["agent"]
    # A full queue answers 429: two long streams fill the two slots with no waiting room.
    streams = [first.client.completions.create(model=MODEL, prompt="x", stream=True,
                                               max_tokens=3000, temperature=0,
                                               extra_body={"ignore_eos": True})
               for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as e:
        first.client.completions.create(model=MODEL, prompt="y", max_tokens=1)
    assert e.value.response.headers["retry-after"] == "1"
    for stream in streams:
        stream.close()
    assert first.stop(signal.SIGTERM) == 0

    second = Server(tmp_path)
    history = history + got[1] + turns[2]
    got.append(ask(second, history))
    assert got == expected
    assert second.metric("sessions_resumed_total") == 1
    # Killed in the middle of the session's next turn (and of other requests).
    busy = second.client.completions.create(
        model=MODEL, prompt=history + got[2] + turns[0], stream=True, temperature=0,
        max_tokens=3000, extra_body={"ignore_eos": True, "session": "agent"})
    other = second.client.completions.create(model=MODEL, prompt=LONG, stream=True,
                                             max_tokens=3000, temperature=0)
    for _, _ in zip(range(3), busy, strict=False):
        next(iter(other))
    assert second.stop(signal.SIGKILL) != 0
    third = Server(tmp_path)  # the killed turn is lost, the saved session is not
    shown = third.client.get("/sessions/agent", cast_to=object)
    assert shown["tokens"] == len(history) + 8  # as the last finished turn left it
    third.client.delete("/sessions/agent", cast_to=object)
    with pytest.raises(openai.NotFoundError):
        third.client.get("/sessions/agent", cast_to=object)
    assert third.stop() == 0


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    """The app in this process (no socket): the parts that need no real server."""
    from fastapi.testclient import TestClient

    from kvstack import AsyncLLM
    from kvstack.serve.app import ServeConfig, build_app

    engine = AsyncLLM(LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16,
                          cache_dir=tmp_path_factory.mktemp("app")))
    with TestClient(build_app(engine, ServeConfig("tiny", api_keys=("sesame",)))) as client:
        yield client


def test_an_api_key_is_required_when_set(app_client):
    client = app_client
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    refused = client.post("/v1/completions", json=body)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401
    ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    assert client.get("/health").status_code == 200  # health and metrics need no key


def test_n_samples_and_a_busy_session(app_client):
    client = app_client
    auth = {"Authorization": "Bearer sesame"}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 3, "seed": 1,
            "temperature": 1.0, "ignore_eos": True}
    out = client.post("/v1/completions", json=body, headers=auth).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 12
    with_session = body | {"n": 2, "session": "s"}
    refused = client.post("/v1/completions", json=with_session, headers=auth)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    turn = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    session = auth | {"X-Kvstack-Session": "t"}
    first = client.post("/v1/completions", json=turn, headers=session)
    assert first.status_code == 200
    shown = client.get("/v1/sessions/t", headers=auth).json()
    assert shown["tokens"] == first.json()["usage"]["total_tokens"] and not shown["busy"]
    client.app.state.sessions.busy.add("t")  # a turn of it in flight
    busy = client.post("/v1/completions", json=turn, headers=session)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
    assert client.delete("/v1/sessions/t", headers=auth).status_code == 409
    client.app.state.sessions.busy.discard("t")
    assert client.delete("/v1/sessions/t", headers=auth).json()["deleted"]


def test_bad_names_keys_and_seeds_are_400s_or_401s_not_500s(app_client):
    client = app_client
    auth = {"Authorization": "Bearer sesame"}
    turn = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for name in ("../etc", ".hidden", "a\0b", "x" * 300):
        bad = client.post("/v1/completions", json=turn | {"session": name}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session"
    assert all(s["id"] in ("t",) for s in client.get("/v1/sessions", headers=auth).json()["data"])
    wrong = client.post("/v1/completions", json=turn,
                        headers={"Authorization": "Bearer sésame".encode()})
    assert wrong.status_code == 401
    seeded = turn | {"n": 2, "seed": (1 << 64) - 1}
    refused = client.post("/v1/completions", json=seeded, headers=auth)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "seed"


def test_a_damaged_session_record_is_listed_as_damaged(app_client):
    client = app_client
    auth = {"Authorization": "Bearer sesame"}
    turn = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for name in ("kept", "hurt"):
        assert client.post("/v1/completions", json=turn | {"session": name},
                           headers=auth).status_code == 200
    table = client.app.state.sessions.engine.handler.sessions  # where the engine runs
    for name in ("kept", "hurt"):
        table.open.pop(name).close()  # as a restarted server: on disk only
    table.llm.disk._db.execute("UPDATE sessions SET held_tokens = -1 WHERE name = 'hurt'")
    listed = client.get("/v1/sessions", headers=auth)
    assert listed.status_code == 200
    by_name = {s["id"]: s for s in listed.json()["data"]}
    assert "corrupt" in by_name["hurt"]["damaged"] and by_name["kept"]["tokens"] > 0
    shown = client.get("/v1/sessions/hurt", headers=auth)
    assert shown.status_code == 200 and "damaged" in shown.json()
    assert client.delete("/v1/sessions/hurt", headers=auth).json()["deleted"]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_slow_and_oversized_clients_are_cut_off_before_they_cost_anything(tmp_path):
    s = Server(tmp_path, "--model", "tiny", "--random-init", "--api-key", "k",
               "--max-connections", "64", "--request-timeout", "2", "--max-body-size", "1MiB")
    try:
        slow = []
        for _ in range(200):  # far past the connection limit, each sending half a request
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append(c)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=5)
        out = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens == 2  # a real client still gets in
        time.sleep(3)  # past the request deadline
        for c in slow:
            c.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert c.recv(100) == b""  # closed by the server
            c.close()

        def post(body: bytes, key: str | None, chunked: bool = False) -> bytes:
            c = socket.create_connection(("127.0.0.1", s.port))
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            head += b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
            head += (b"Transfer-Encoding: chunked\r\n\r\n" if chunked
                     else b"Content-Length: %d\r\n\r\n" % len(body))
            c.sendall(head)
            try:
                for at in range(0, len(body), 1 << 20):
                    part = body[at: at + (1 << 20)]
                    c.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            except OSError:  # the server answered and closed without reading it all
                pass
            c.settimeout(10)
            status = c.recv(64).split(b"\r\n")[0]
            c.close()
            return status

        before = _rss_bytes(s.process.pid)
        big = b"x" * (100 << 20)
        assert b"401" in post(big, None)
        assert b"401" in post(big, None, chunked=True)
        assert b"413" in post(big, "k")
        assert b"413" in post(big, "k", chunked=True)
        assert _rss_bytes(s.process.pid) - before < 10 << 20
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    finally:
        assert s.stop() == 0


def test_a_tensor_parallel_server_outlives_idleness_and_reports_a_lost_rank(tmp_path):
    s = Server(tmp_path, "--model", "tiny-v41", "--random-init", "--tensor-parallel-size", "2",
               "--parallel-timeout", "3")
    try:
        first = s.client.completions.create(model="tiny-v41", prompt="hi", max_tokens=3,
                                            temperature=0)
        time.sleep(3 * 3 + 1)  # idle for three timeouts
        again = s.client.completions.create(model="tiny-v41", prompt="hi", max_tokens=3,
                                            temperature=0)
        assert again.choices[0].text == first.choices[0].text
        with open(f"/proc/{s.process.pid}/task/{s.process.pid}/children") as f:
            children = [int(pid) for pid in f.read().split()]
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children}
        rank = next(pid for pid, command in commands.items()
                    if b"spawn_main" in command and b"resource_tracker" not in command)
        os.kill(rank, signal.SIGKILL)
        deadline = time.time() + 30
        status = 200
        while status == 200 and time.time() < deadline:
            time.sleep(0.5)
            try:
                status = urllib.request.urlopen(s.url + "/health", timeout=5).status
            except urllib.error.HTTPError as e:
                status = e.code
        assert status == 503  # a load balancer takes it out
        with pytest.raises(openai.InternalServerError, match="engine has stopped"):
            s.client.completions.create(model="tiny-v41", prompt="hi", max_tokens=3)
    finally:
        s.stop(signal.SIGKILL)


@pytest.mark.parametrize("shared", [False, True])
def test_tenants_see_only_their_own_sessions_and_prefix_cache(tmp_path, shared):
    from fastapi.testclient import TestClient

    from kvstack import AsyncLLM
    from kvstack.serve.app import ServeConfig, build_app

    engine = AsyncLLM(LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16,
                          cache_dir=tmp_path))
    config = ServeConfig("tiny", api_keys=("key-a", "key-b"), share_prefix_cache=shared)
    a, b = ({"Authorization": f"Bearer key-{t}"} for t in "ab")
    prompt = "the secret plan of tenant a is written in this prompt, " * 3

    def complete(headers, text, **extra):
        r = client.post("/v1/completions", headers=headers, json={
            "model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    with TestClient(build_app(engine, config)) as client:
        complete(a, prompt, session="agent")
        a_tokens = client.get("/v1/sessions/agent", headers=a).json()["tokens"]
        assert client.get("/v1/sessions", headers=b).json()["data"] == []
        assert client.get("/v1/sessions/agent", headers=b).status_code == 404
        assert client.delete("/v1/sessions/agent", headers=b).status_code == 404
        complete(b, "b's own start", session="agent")  # b's "agent", not a's
        assert client.get("/v1/sessions/agent", headers=a).json()["tokens"] == a_tokens
        assert [s["id"] for s in client.get("/v1/sessions", headers=a).json()["data"]] == [
            "agent"]
        guess = complete(b, prompt[:-5])  # a guessed prefix of a's prompt
        cached = guess["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > 0) if shared else (cached == 0)
        again = complete(a, prompt[:-5])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert client.delete("/v1/sessions/agent", headers=a).json()["deleted"]
        assert client.get("/v1/sessions/agent", headers=b).json()["tokens"] > 0


def test_sessions_under_load_are_saved_with_their_cache_blocks(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from kvstack import AsyncLLM
    from kvstack.cache.disk import DiskTier
    from kvstack.serve.app import ServeConfig, build_app

    # Two slots for eight clients: every finished turn's kept cache is wanted at once by
    # a waiting request.
    engine = AsyncLLM(LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16,
                          cache_dir=tmp_path, max_num_seqs=2))
    with TestClient(build_app(engine, ServeConfig("tiny"))) as client:
        def turn(i: int) -> int:
            return client.post("/v1/completions", json={
                "model": "tiny", "prompt": f"session {i} " * 8, "max_tokens": 4,
                "ignore_eos": True, "session": f"s{i}"}).status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(turn, range(8))) == [200] * 8
    disk = DiskTier(tmp_path, 1 << 30)
    assert all(disk.show(f"s{i}").held_tokens > 0 for i in range(8))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("system", [False, True])
def test_a_chat_session_sent_back_by_the_openai_client_continues_its_cache(server, stream,
                                                                           system):
    session = f"chat-{stream}-{system}"
    messages = [{"role": "system", "content": "answer in Python"}] if system else []

    settings = GREEDY | {"extra_body": GREEDY["extra_body"] | {"session": session}}

    def ask(history):
        if not stream:
            out = server.client.chat.completions.create(model=MODEL, messages=history,
                                                        **settings)
            return out.choices[0].message.content, out.usage
        chunks = list(server.client.chat.completions.create(
            model=MODEL, messages=history, stream=True,
            stream_options={"include_usage": True}, **settings))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].usage

    previous_prompt = 0
    for turn, question in enumerate(["read a file", "now parse it", "and print it"]):
        messages.append({"role": "user", "content": question})
        reply, usage = ask(messages)
        if turn:  # everything the previous turn's prompt and reply held is reused
            assert usage.prompt_tokens_details.cached_tokens >= previous_prompt
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply})
    # A client that edits history: the session starts over on what it was sent.
    edited = [*messages[:-3], {"role": "user", "content": "something else"}]
    reply, usage = ask(edited)
    assert usage.prompt_tokens_details.cached_tokens < previous_prompt
    fresh = server.client.chat.completions.create(model=MODEL, messages=edited, **GREEDY)
    assert reply == fresh.choices[0].message.content  # the same as without a session


def test_a_text_prompt_extends_tokens_that_would_not_re_tokenize_the_same(local):
    from kvstack.serve.sessions import SessionTable

    sessions = SessionTable(local)
    word = next(w for w in ("return", "import", "def") if len(local.encode(w)) == 1)
    split = [t for c in word for t in local.encode(c)]  # the same text in other tokens
    tokens = local.encode("x = ") + split
    text = "x = " + word + "(1)"
    ids = local.encode(text)
    assert ids[: len(tokens)] != tokens  # as ids the prompt does not extend the session
    session = local.session("extend")
    session.token_ids = tokens
    assert sessions._extension(session, ids, text, [], None) == (local.encode("(1)"), [])
    # an edited history
    assert sessions._extension(session, ids, "y = " + word, [], None) is None


def test_the_server_steps_its_engine_in_a_process_of_its_own(tmp_path):
    """`kvstack serve` runs the engine core in a child process (HTTP never waits on the
    step's interpreter); a child that dies takes the server out of rotation: /health and
    new requests answer 503 naming why."""
    s = Server(tmp_path)
    try:
        children = Path(f"/proc/{s.process.pid}/task/{s.process.pid}/children")
        engines = [int(pid) for pid in children.read_text().split()
                   if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(engines) == 1
        out = s.client.completions.create(model=MODEL, prompt="def main(", **GREEDY)
        assert out.usage.completion_tokens == 12
        os.kill(engines[0], signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                urllib.request.urlopen(s.url + "/health", timeout=1)
            except urllib.error.HTTPError as e:
                assert e.code == 503 and b"exited" in e.read()
                break
            time.sleep(0.1)
        else:
            raise AssertionError("/health kept answering 200")
        with pytest.raises(openai.InternalServerError, match="exited"):
            s.client.completions.create(model=MODEL, prompt="def main(", **GREEDY)
    finally:
        assert s.stop() == 0


def test_metrics_follow_prometheus_conventions(server):
    from prometheus_client.parser import text_string_to_metric_families

    server.client.completions.create(model=MODEL, prompt=LONG, **GREEDY)
    stream = server.client.completions.create(model=MODEL, prompt="def f(", stream=True,
                                              max_tokens=200, temperature=0)
    next(iter(stream))
    stream.close()  # a client that gives up: counted as aborted
    time.sleep(1)
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = [s for f in families.values() for s in f.samples]
    assert not any(s.name.endswith("_created") for s in samples)
    assert all(s.labels.get("model_name") == MODEL for s in samples)
    for total in ("kvstack:prefix_cache_hit_tokens", "kvstack:prefix_cache_queried_tokens",
                  "kvstack:tokens_replayed", "kvstack:window_checkpoint_restores",
                  "kvstack:prompt_tokens", "kvstack:request_success"):
        assert families[total].type == "counter", total
    for level in ("kvstack:num_requests_running", "kvstack:device_blocks_used"):
        assert families[level].type == "gauge", level
    assert families["kvstack:e2e_request_latency_seconds"].type == "histogram"
    reasons = {s.labels["finished_reason"]: s.value
               for s in families["kvstack:request_success"].samples}
    assert reasons.get("abort", 0) >= 1 and reasons.get("length", 0) >= 1


def test_the_server_logs_requests_and_stats_and_refuses_bad_json_by_position(tmp_path,
                                                                            caplog):
    from fastapi.testclient import TestClient

    from kvstack import AsyncLLM
    from kvstack.serve.app import ServeConfig, build_app

    engine = AsyncLLM(LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16,
                          cache_dir=tmp_path))
    # Stats lines far more often than a 200-token request takes on any machine, so that
    # some fall while it runs.
    config = ServeConfig("tiny", default_max_tokens=5, stats_interval_s=0.02)
    caplog.set_level(logging.INFO, logger="kvstack")
    with TestClient(build_app(engine, config)) as client:
        out = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True}).json()
        assert out["usage"]["completion_tokens"] == 5  # the server's default max_tokens
        client.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                             "max_tokens": 200, "ignore_eos": True})
        bad = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": }',
                          headers={"Content-Type": "application/json"})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] is None and "not valid JSON (at character" in error["message"]
        time.sleep(0.3)
    assert "POST /v1/chat/completions 200 prompt=" in caplog.text
    assert "kvstack access: testclient POST /v1/completions 200 prompt=2 cached=0 " \
           "generated=200" in caplog.text
    assert "POST /v1/completions 400" in caplog.text
    stats = [r.message for r in caplog.records if r.message.startswith("kvstack stats")]
    assert any("running 1" in line and "generation 0.0" not in line for line in stats)


def test_a_port_in_use_is_said_before_the_model_loads(capsys):
    from kvstack.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--random-init", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and " on http://" not in err


def test_the_servers_connections_send_small_writes_at_once():
    """The listening socket `bind` makes gives connections with Nagle's algorithm off, as
    uvicorn's own do: a streamed token is a small write, which Nagle would hold until the
    client acknowledged the one before (a delayed ACK: tens of milliseconds a token on a
    kept-alive connection)."""
    import asyncio

    from kvstack.serve.app import ServeConfig, bind

    sock = bind(ServeConfig(model_name="tiny", host="127.0.0.1", port=free_port()))

    async def accepted_nodelay() -> int:
        loop = asyncio.get_running_loop()
        made: asyncio.Future = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                made.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock.listen()
        server = await loop.create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(made, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_min_tokens_stop_token_ids_and_logit_bias_over_http(app_client):
    client = app_client
    auth = {"Authorization": "Bearer sesame"}
    base = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    eos = client.app.state.sessions.engine.tokenizer.eos_id

    def ask(**extra):
        return client.post("/v1/completions", json=base | extra, headers=auth)

    out = ask(min_tokens=2, logit_bias={str(eos): 100}, return_token_ids=True).json()
    assert out["choices"][0]["token_ids"][2] == eos
    assert out["usage"]["completion_tokens"] == 3
    first = ask(ignore_eos=True, return_token_ids=True).json()["choices"][0]["token_ids"][0]
    stopped = ask(ignore_eos=True, stop_token_ids=[first]).json()
    assert stopped["usage"]["completion_tokens"] == 1
    assert stopped["choices"][0]["finish_reason"] == "stop"
    for extra, param in ((dict(logit_bias={"x": 1}), "logit_bias"),
                         (dict(stop_token_ids=[10**6]), "stop_token_ids"),
                         (dict(min_tokens=9), "min_tokens")):
        bad = ask(**extra)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, extra


def test_every_refused_field_is_documented_and_refused_by_name(app_client):
    from kvstack.serve.protocol import UNSUPPORTED

    readme = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    auth = {"Authorization": "Bearer sesame"}
    for field in UNSUPPORTED:
        assert f"`{field}`" in readme, field
        refused = app_client.post("/v1/completions", headers=auth, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 1, field: "on"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_json_schema_replies_parse_and_validate_on_twenty_prompts(server):
    import json

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    prompts = [f"# record {i}\n" + w for i, w in enumerate(
        ["person = ", "def load():\n    return ", "data: ", "x = ", "config = "] * 4)]
    for prompt in prompts:
        out = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=80,
            temperature=0.7, seed=len(prompt), response_format=fmt)
        reply = json.loads(out.choices[0].message.content)
        assert set(reply) == {"name", "age"} and isinstance(reply["name"], str)
        assert len(reply["name"]) <= 24 and isinstance(reply["age"], int)
        assert 0 <= reply["age"] <= 150 and out.choices[0].finish_reason == "stop"
    any_object = server.client.completions.create(
        model=MODEL, prompt="settings = ", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(any_object.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError, match="not a schema"):
        server.client.completions.create(
            model=MODEL, prompt="x", max_tokens=5,
            extra_body={"response_format": {"type": "json_schema",
                                            "json_schema": {"schema": {"type": 12}}}})


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["a", "b"],
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                           "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}]


def test_tools_return_well_formed_tool_calls_streamed_and_not(server):
    import json

    messages = [{"role": "developer", "content": "use the tools"},
                {"role": "user", "content": "what is 2 + 3?"}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        out = server.client.chat.completions.create(
            model=MODEL, messages=messages, tools=WEATHER, tool_choice=choice,
            max_tokens=60, temperature=0)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and message.content is None
        call = message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        if call.function.name == "add":
            assert set(arguments) == {"a", "b"} and all(0 <= v <= 99 for v in arguments.values())
        else:
            assert call.function.name == "get_weather" and set(arguments) == {"city"}
        if isinstance(choice, dict):
            assert call.function.name == "add"
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER, tool_choice="required",
        max_tokens=60, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) is not None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call and the tool's answer go back in the history, as agent loops send them.
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {
            "name": calls[0].function.name, "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "5"}]
    answer = server.client.chat.completions.create(
        model=MODEL, messages=history, tools=WEATHER, tool_choice="none", max_tokens=8,
        temperature=0)
    assert answer.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        server.client.chat.completions.create(
            model=MODEL, messages=messages, tools=WEATHER, max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "nope"}})


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n"
          "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_jinja_chat_template_from_tokenizer_config_renders_as_transformers_does(tmp_path):
    import json

    from fastapi.testclient import TestClient

    from kvstack import AsyncLLM
    from kvstack.engine.chat_template import ChatTemplate, JinjaTemplate
    from kvstack.engine.tokenizer import byte_level_tokenizer_json
    from kvstack.serve.app import ServeConfig, build_app

    LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16).model.save_pretrained(
        tmp_path)
    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": {"content": "<|eos|>"}}))
    template = ChatTemplate.for_model(tmp_path)
    assert isinstance(template, JinjaTemplate)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert template.render(messages) == expected
    assert '"name": "add"' in template.render(messages, [{"name": "add"}])
    engine = AsyncLLM(LLM(tmp_path, kv_budget="1MiB", block_tokens=16, cache_dir=tmp_path))
    with TestClient(build_app(engine, ServeConfig("m"))) as client:
        tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert engine.llm.tokenizer.decode(tokens) == expected
        out = client.post("/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 3}).json()
        assert out["usage"]["prompt_tokens"] == len(tokens)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if"}))
    with pytest.raises(ValueError, match="chat_template cannot be used"):
        ChatTemplate.for_model(tmp_path)


HERMES = (CHATML.replace("{{ tools | tojson }}", "call one as <tool_call>{\"name\": ..., "
                         "\"arguments\": ...}</tool_call>: {% for t in tools %}"
                         "{{ t.function.name }} {% endfor %}"))
SMALL_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Oslo", "Rome"]}}}}}]


def test_a_hermes_template_gets_its_tool_calls_parsed_and_held_to_its_syntax(tmp_path,
                                                                             caplog):
    import json

    from fastapi.testclient import TestClient

    from kvstack import AsyncLLM
    from kvstack.engine.tokenizer import byte_level_tokenizer_json
    from kvstack.serve.app import ServeConfig, build_app

    LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16).model.save_pretrained(
        tmp_path)
    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": HERMES, "eos_token": {"content": "<|eos|>"}}))
    caplog.set_level(logging.INFO, "kvstack")
    engine = AsyncLLM(LLM(tmp_path, kv_budget="1MiB", block_tokens=16, cache_dir=tmp_path))
    messages = [{"role": "user", "content": "what is 2 + 3?"}]
    with TestClient(build_app(engine, ServeConfig("m"))) as client:
        assert "tool calls in the hermes syntax (by the chat template)" in caplog.text

        def ask(**extra):
            return client.post("/v1/chat/completions", json={
                "model": "m", "messages": messages, "tools": SMALL_TOOLS, "max_tokens": 80,
                "temperature": 0} | extra)

        out = ask(tool_choice={"type": "function", "function": {"name": "add"}},
                  return_token_ids=True).json()["choices"][0]
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
        [call] = out["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "add"
        assert 0 <= json.loads(call["function"]["arguments"])["a"] <= 99
        written = engine.llm.tokenizer.decode(out["token_ids"])  # the model's own syntax
        assert written.startswith('<tool_call>\n{"name": "add", "arguments": {"a": ')
        assert written.endswith("}}\n</tool_call>")

        def streamed(**extra) -> list[dict]:
            body = ask(stream=True, **extra).text
            return [json.loads(line[6:])["choices"][0] for line in body.splitlines()
                    if line.startswith("data: {")]

        chunks = streamed(tool_choice="required")
        assert not "".join(c["delta"].get("content") or "" for c in chunks)  # no marker
        calls = [tc for c in chunks for tc in c["delta"].get("tool_calls") or []]
        assert len(calls) == 1 and calls[0]["function"]["name"] in ("add", "get_weather")
        assert json.loads(calls[0]["function"]["arguments"]) and calls[0]["index"] == 0
        assert chunks[-1]["finish_reason"] == "tool_calls"
        # Cut short, the call is malformed: it comes back as text (streamed too), not a 500.
        short = ask(tool_choice="required", max_tokens=6).json()["choices"][0]
        assert short["finish_reason"] == "length" and "tool_calls" not in short["message"]
        assert short["message"]["content"] == "<tool_"  # six byte tokens
        chunks = streamed(tool_choice="required", max_tokens=6)
        assert "".join(c["delta"].get("content") or "" for c in chunks) == short[
            "message"]["content"]
        # A call sent back in the history is written as the model writes it.
        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {
                "name": "add", "arguments": '{"a": 2}'}}]},
            {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
        tokens = client.post("/tokenize", json={"messages": history}).json()["tokens"]
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}'
                '\n</tool_call><|im_end|>') in engine.llm.tokenizer.decode(tokens)
    build_app(engine, ServeConfig("m", tool_call_parser="json"))  # the operator's choice
    assert "tool calls in the json syntax (by --tool-call-parser)" in caplog.text
    with pytest.raises(ValueError, match="--tool-call-parser 'qwen': one of json, hermes"):
        ServeConfig("m", tool_call_parser="qwen")
