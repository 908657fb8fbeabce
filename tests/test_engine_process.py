"""The engine core in a process of its own (`EngineProcess`, what `kvstack serve` runs):
the library's outputs, calls by name, aborts, refusals, and a child that dies."""

import asyncio
import functools
import os
import signal
import time

import pytest
import torch

from kvstack import LLM, EngineError, SamplingParams
from kvstack.engine.process import EngineProcess

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def tiny() -> LLM:
    """The engine the child builds (module-level: the child imports it by name)."""
    return LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16, replay="exact",
               threads=1)


class Probe:
    """The methods the tests call in the engine's process."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.finish_reasons: list[str] = []  # of every request the core finished
        finish = llm.core._finish

        def recording(seq, reason: str) -> None:
            self.finish_reasons.append(reason)
            finish(seq, reason)

        llm.core._finish = recording

    def reasons(self) -> list[str]:
        return self.finish_reasons

    def pid(self) -> int:
        return os.getpid()

    def unfinished(self) -> bool:
        return self.llm.has_unfinished_requests()

    def refuse(self, what: str) -> None:
        raise ValueError(f"no {what} here")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 5, 80)]


async def final(stream) -> object:
    outs = [out async for out in stream]
    return outs[-1]


@pytest.fixture(scope="module")
def engine():
    with EngineProcess(tiny, Probe) as engine:
        yield engine


def test_a_process_engine_gives_the_librarys_tokens_and_text(engine):
    expected = tiny().generate([*prompts(), "def main("], GREEDY)

    async def run():
        return await asyncio.gather(*(final(engine.generate(p, GREEDY))
                                      for p in [*prompts(), "def main("]))

    outs = asyncio.run(run())
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert [o.text for o in outs] == [e.text for e in expected]
    assert asyncio.run(engine.call("pid")) not in (os.getpid(), None)  # another process
    assert engine.info.max_model_len == tiny().core.max_model_len


def test_a_call_raises_what_the_engines_side_raised(engine):
    with pytest.raises(ValueError, match="no grammar here"):
        asyncio.run(engine.call("refuse", "grammar"))


def test_a_refused_request_raises_value_error(engine):
    too_long = list(range(1, 200)) * 200
    with pytest.raises(ValueError):
        asyncio.run(final(engine.generate(too_long, GREEDY)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(final(engine.generate([10**6], GREEDY)))


def test_a_stream_closed_early_is_aborted_in_the_engines_process(engine):
    async def run() -> bool:
        before = len(await engine.call("reasons"))
        stream = engine.generate(prompts()[0], SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(500):  # the abort reaches the engine between its steps
            if not await engine.call("unfinished"):
                break
            await asyncio.sleep(0.02)
        return (await engine.call("reasons"))[before:]

    assert asyncio.run(run()) == ["abort"]


def test_an_engine_that_cannot_load_says_why():
    with pytest.raises(ValueError, match="nonexistent-model-dir"):
        EngineProcess(functools.partial(LLM, "/nonexistent-model-dir"), Probe)


def test_a_killed_engine_process_fails_its_requests_and_says_why():
    engine = EngineProcess(tiny, Probe)
    try:
        async def run() -> None:
            stream = engine.generate(prompts()[0], SamplingParams(max_tokens=10**4,
                                                                  ignore_eos=True))
            async for _ in stream:
                os.kill(await engine.call("pid"), signal.SIGKILL)
                break
            async for _ in stream:  # the rest of the stream: the engine is gone
                pass

        with pytest.raises(EngineError, match="exited"):
            asyncio.run(run())
        deadline = time.time() + 10
        while engine.failure is None and time.time() < deadline:
            time.sleep(0.05)
        assert "exited" in engine.failure
        with pytest.raises(EngineError, match="exited"):
            asyncio.run(final(engine.generate("hi", GREEDY)))
        with pytest.raises(EngineError):
            asyncio.run(engine.call("pid"))
    finally:
        engine.shutdown()
