"""The engine core: interleaved front ends each see their own outputs, steps that fail
roll back, the engine settings in one object."""

import resource
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from kvstack import LLM, EngineConfig, EngineError, SamplingParams
from kvstack.cache import rows as rows_module
from kvstack.config import preset
from kvstack.engine.output import Detokenizer
from kvstack.engine.tokenizer import ByteTokenizer, JsonTokenizer
from kvstack.model.model import Layer, Model, grouped_mm, grouped_mm_by_group
from kvstack.model.packed import PackedExperts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tiny(**settings) -> LLM:
    settings = {"kv_budget": "2MiB", "block_tokens": 16, "replay": "exact"} | settings
    return LLM("tiny", random_init=True, **settings)


def prompts(n: int) -> list[list[int]]:
    """The first n of four fixed prompts of different lengths."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (length,), generator=g).tolist()
            for length in (37, 5, 59, 18)][:n]


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt's greedy output, run by itself on a fresh engine."""
    return [tiny().generate(p, GREEDY)[0].token_ids for p in prompts(4)]


def test_interleaved_streams_each_see_their_own_outputs(alone):
    llm = tiny()
    streams = [llm.stream(p, GREEDY) for p in prompts(4)]
    seen: list[list] = [[] for _ in streams]
    order = [0, 2, 2, 1, 3, 0, 0, 3, 1, 2]  # an arbitrary interleaving, then round robin
    live = set(range(len(streams)))
    step = 0
    while live:
        i = order[step] if step < len(order) else sorted(live)[step % len(live)]
        step += 1
        if i not in live:
            continue
        try:
            seen[i].append(next(streams[i]))
        except StopIteration:
            live.discard(i)
    for i, outs in enumerate(seen):
        assert {o.request_id for o in outs} == {outs[0].request_id}
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        assert outs[-1].token_ids == alone[i]
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(lengths)
    assert llm.core.requests == {}


def test_generate_while_a_stream_and_a_session_run(alone):
    llm = tiny()
    p = prompts(4)
    stream = llm.stream(p[0], GREEDY)
    first = next(stream)
    session = llm.session("s")
    session.append(p[1])
    turn = session.stream(GREEDY)
    next(turn)
    outs = llm.generate([p[2], p[3]], GREEDY)  # runs the stream's and session's requests too
    assert [o.token_ids for o in outs] == alone[2:]
    rest = list(stream)  # its final output waited for it
    assert rest[-1].finished and rest[-1].token_ids == alone[0]
    assert rest[-1].request_id == first.request_id
    assert list(turn)[-1].token_ids == alone[1]
    assert session.token_ids == p[1] + alone[1]


def test_a_stream_closed_early_frees_its_request():
    llm = tiny()
    free = llm.cache.manager.num_free
    stream = llm.stream(prompts(1)[0], GREEDY)
    next(stream)
    stream.close()
    assert llm.core.requests == {} and llm.cache.manager.num_free == free


def fail_layer(monkeypatch, llm: LLM, when) -> list[int]:
    """Layer 5 of 8 raises when when(batch request ids) is true: the layers before it have
    written their rings and streams by then. Returns the list of failures."""
    failures: list[int] = []
    batch: list[list[str]] = [[]]
    runner = llm.runner
    decode, prefill = runner.decode, runner.prefill

    def record_decode(seqs):
        batch[0] = [s.request_id for s in seqs]
        return decode(seqs)

    def record_prefill(seq):
        batch[0] = [seq.request_id]
        return prefill(seq)

    monkeypatch.setattr(runner, "decode", record_decode)
    monkeypatch.setattr(runner, "prefill", record_prefill)
    layer = llm.model.layers[5]
    forward = Layer.forward

    def failing(self, s, start, store, ctx):
        if self is layer and when(batch[0], len(failures)):
            failures.append(len(batch[0]))
            raise RuntimeError("injected fault")
        return forward(self, s, start, store, ctx)

    monkeypatch.setattr(Layer, "forward", failing)
    return failures


def test_a_failed_batched_decode_is_rolled_back_and_recomputed(monkeypatch, alone):
    llm = tiny()
    free = llm.cache.manager.num_free
    ids = [llm.add_request(p, GREEDY) for p in prompts(2)]
    llm.step()  # both prefilled
    llm.step()  # a batched decode
    failures = fail_layer(monkeypatch, llm, lambda batch, n: len(batch) == 2 and n == 0)
    done = {}
    while len(done) < 2:
        done |= {o.request_id: o for o in llm.step() if o.finished}
    assert failures == [2]  # one batch of two failed inside layer 5
    assert [done[i].token_ids for i in ids] == alone[:2]
    assert all(done[i].finish_reason == "length" for i in ids)
    assert llm.cache.manager.num_free == free


def test_a_request_that_keeps_failing_ends_with_its_error_and_the_others_go_on(
        monkeypatch, alone):
    llm = tiny()
    free = llm.cache.manager.num_free
    bad = {"1"}
    failures = fail_layer(monkeypatch, llm, lambda batch, n: bool(bad & set(batch)))
    outs = llm.generate(prompts(3), GREEDY)
    assert failures  # the bad request failed, in a batch and then alone
    assert outs[1].finish_reason == "error" and "injected fault" in outs[1].error
    assert outs[0].token_ids == alone[0] and outs[2].token_ids == alone[2]
    assert llm.cache.manager.num_free == free
    session = llm.session("s")
    session.append(prompts(1)[0])
    bad.add("3")  # the session's request
    with pytest.raises(EngineError, match="session 's': RuntimeError: injected fault"):
        session.generate(GREEDY)


def test_a_request_the_pool_cannot_hold_is_reported_not_left_hanging():
    llm = tiny(kv_budget="12KiB", max_num_seqs=1, window_checkpoints=0)
    report = llm.memory_report()
    capacity = report["capacity_tokens"]
    assert capacity < report["context"]  # the pool, not max_model_len, is what stops it
    out = llm.generate(list(range(1, 20)), SamplingParams(max_tokens=10 * capacity,
                                                          temperature=0, ignore_eos=True))[0]
    assert out.finished and out.finish_reason == "length"
    # Every position the pool holds, and the token sampled from the last (never stored).
    assert len(out.prompt_token_ids) + len(out.token_ids) == capacity + 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_engine_reuses_freed_memory_instead_of_faulting_it_in_again():
    """Once an engine is made on the CPU, a freed 4 MiB temporary (a decode step has
    dozens) is handed out again without the kernel faulting its pages in anew (by
    default each is a fresh mmap: 1,024 page faults every time)."""
    LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16, device="cpu")

    def faults_of_one_temporary() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(1 << 20)  # 4 MiB, written whole, then freed
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # The least of a few: another allocation in between may take the freed chunk once.
    assert min(faults_of_one_temporary() for _ in range(5)) < 100


def test_the_engine_settings_are_one_validated_object():
    config = EngineConfig(kv_budget="2MiB", block_tokens=16, max_model_len=100, threads=1)
    llm = LLM("tiny", config, random_init=True)
    assert llm.engine_config is config and torch.get_num_threads() == 1
    assert llm.memory_report()["context"] == 100
    with pytest.raises(ValueError, match="leaves no room under max_model_len 100"):
        llm.add_request(list(range(100)), GREEDY)
    for bad, match in ((dict(block_tokens=0), "block_tokens must be a positive integer"),
                       (dict(replay="fast"), "replay must be one of bounded, exact"),
                       (dict(kv_budget="lots"), "kv_budget 'lots': not a size"),
                       (dict(threads=True), "threads must be a positive integer"),
                       (dict(numerics="fp8"), "numerics must be one of default, reference"),
                       (dict(device="tpu"), "device 'tpu': not a device name like cpu or cuda"),
                       (dict(device="mps"), "device 'mps': kvstack runs on cpu or cuda")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': CUDA is not available"):
            EngineConfig(device="cuda")
    with pytest.raises(ValueError, match="max_model_len 1000 exceeds the model's max_seq_len"):
        LLM("tiny", random_init=True, max_model_len=1000)
    with pytest.raises(ValueError, match="unexpected keyword argument 'kv_budgt'"):
        LLM("tiny", random_init=True, kv_budgt="1MiB")
    with pytest.raises(ValueError, match="not both"):
        LLM("tiny", config, random_init=True, kv_budget="1MiB")


def test_a_json_tokenizer_gives_the_tokenizer_files_own_ids():
    """The ids are those the tokenizers library's own encode gives (kvstack's encode goes
    through its batch call, which lets go of the interpreter), special tokens included."""
    from tokenizers import Tokenizer as HFTokenizer

    from kvstack.demo import bundled_model

    path = bundled_model() / "tokenizer.json"
    tok, reference = JsonTokenizer(path), HFTokenizer.from_file(str(path))
    texts = ["", "hello world", "<|eos|> x<|bos|>", "naïve café — 日本語",
             (Path(__file__).read_text())]
    for text in texts:
        assert tok.encode(text) == reference.encode(text).ids
    assert len(tok.encode(texts[-1])) > 1000


def test_incremental_text_equals_the_whole_decode_and_stops_where_a_stop_string_starts(
        tmp_path):
    from kvstack.engine.tokenizer import byte_level_tokenizer_json

    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    text = "naïve café — 日本語 ok\n\tdone"
    for tok in (ByteTokenizer(), JsonTokenizer(tmp_path / "tokenizer.json")):
        ids = tok.encode(text)
        d = Detokenizer(tok, ())
        for i, token in enumerate(ids):
            d.add(token)
            assert tok.decode(ids[: i + 1]).startswith(d.text)  # never ahead, never wrong
        d.flush()
        assert d.text == tok.decode(ids) == text
        d = Detokenizer(tok, ("日本", "zz"))
        stopped_at = next(i for i, t in enumerate(ids) if d.add(t))  # the request ends there
        assert d.text == "naïve café — "
        assert stopped_at == len(tok.encode("naïve café — 日本")) - 1


def test_text_a_stop_string_may_still_cut_is_held_back_until_it_cannot():
    """What a stream shows (`settled`) never holds the start of a stop string that a later
    token completes: "\nuser" waits for its ":" (which stops) or for what rules it out."""
    tok = ByteTokenizer()
    d = Detokenizer(tok, ("\nuser:", "\nsystem:"))
    shown = []
    for token in tok.encode("ok\nuser:"):
        stopped = d.add(token)
        shown.append(d.settled())
    assert stopped and d.text == "ok"
    assert all(s in ("", "o", "ok") for s in shown)
    d = Detokenizer(tok, ("\nuser:",))
    for token in tok.encode("a\nus"):
        d.add(token)
    assert d.settled() == "a" and d.text == "a\nus"
    for token in tok.encode("e it"):
        d.add(token)
    assert d.settled() == d.text == "a\nuse it"


def test_a_requests_text_is_made_off_the_step_unless_a_stop_string_may_end_it():
    """The step hands over outputs without text where no stop string can end the request;
    the front end makes it (`with_text`), equal to decoding the tokens, whatever order its
    outputs are read in, with an incomplete character kept back until its end; a request
    with stop strings gets its text from the step, which stops it there."""
    llm = LLM("tiny", random_init=True, kv_budget="2MiB")
    core, tok = llm.core, llm.tokenizer
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = core.add_request([1, 2, 3], params)
    raw = []
    while core.has_unfinished_requests():
        raw += [o for o in core.step() if o.request_id == plain]
    assert all(o.text is None for o in raw) and raw[-1].finished
    newest_first = [o.with_text().text for o in reversed(raw)]
    final = tok.decode(raw[-1].token_ids)
    assert newest_first[0] == final  # ended by its length: nothing held back
    texts = [o.with_text().text for o in raw]  # asked again, oldest first
    assert texts == newest_first[::-1]
    in_order = Detokenizer(tok, ())  # what the step itself made, output by output
    for o in raw:
        for token in o.token_ids[len(in_order.ids):]:
            in_order.add(token)
        if o.finished:
            in_order.flush()
        assert texts[raw.index(o)] == in_order.text
    assert all(final.startswith(t) for t in texts)

    # "é" is two bytes: after the first, nothing shows; after the second, all of it.
    d = Detokenizer(tok, ())
    first, second = tok.encode("é")
    assert d.text_for([first], final=False, flush=False) == ""
    assert d.text_for([first, second], final=False, flush=False) == "é"
    assert d.text_for([first], final=False, flush=False) == ""
    d = Detokenizer(tok, ())
    assert d.text_for([first], final=True, flush=True) == "\ufffd"  # ended mid-character

    stop = core.add_request(tok.encode("ab"), SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, stop=["zz"]))
    while core.has_unfinished_requests():
        outs = [o for o in core.step() if o.request_id == stop]
        assert all(isinstance(o.text, str) for o in outs)
    assert llm.step() == []


def test_requests_of_a_failed_batch_decode_alone_until_they_step(monkeypatch, alone):
    # Request 1 fails every batch it is in with others, never alone: without the solo
    # retries its batch-mates would fail with it until they ran out of tries.
    llm = tiny()
    failures = fail_layer(monkeypatch, llm,
                          lambda batch, n: "1" in batch and len(batch) > 1)
    outs = llm.generate(prompts(3), GREEDY)
    assert len(failures) >= 2
    assert [o.token_ids for o in outs] == alone[:3]
    assert all(o.finish_reason == "length" for o in outs)


def test_front_ends_on_several_threads_each_get_their_own_outputs(alone):
    import threading

    llm = tiny()
    p = prompts(4)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    reports: list[dict] = []

    def run(i: int) -> None:
        try:
            if i == 3:  # a streaming caller beside generate callers
                results[i] = list(llm.stream(p[i], GREEDY))[-1].token_ids
            else:
                results[i] = llm.generate(p[i], GREEDY)[0].token_ids
        except BaseException as e:  # surfaced below, not lost in the thread
            errors.append(e)

    def watch() -> None:
        while len(results) + len(errors) < 4:
            reports.append(llm.memory_report())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and [results[i] for i in range(4)] == alone
    assert reports and llm.core.requests == {}


def test_the_pools_take_memory_as_they_fill_not_at_start():
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from kvstack import LLM, SamplingParams\n"
        "def rss():\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmRSS'))\n"
        "LLM('tiny', random_init=True, kv_budget='16MiB')  # imports and first use, once\n"
        "before = rss()\n"
        "llm = LLM('tiny', random_init=True, kv_budget='1GiB')\n"
        "llm.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))\n"
        "print(json.dumps(rss() - before))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    grown = json.loads(done.stdout.strip().splitlines()[-1])
    assert grown < 200 * 2**20, grown  # a 1 GiB budget, a few blocks used


# What reads a value back from the device (a host sync on an accelerator).
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero",
              "unique", "cpu", "numpy")


def count_host_reads(monkeypatch, outside: type | None = None) -> list[str]:
    """Patch every way torch hands a value back to the host; the list fills with the
    method name of each call (not counting calls made inside `outside.forward`)."""
    reads: list[str] = []
    inside = [0]

    def counting(name, original):
        def read(*args, **kwargs):
            if not inside[0]:
                reads.append(name)
            return original(*args, **kwargs)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "argwhere", "masked_select"):
        monkeypatch.setattr(torch, name, counting(f"torch.{name}", getattr(torch, name)))
    if outside is not None:
        forward = outside.forward

        def excluded(self, *args, **kwargs):
            inside[0] += 1
            try:
                return forward(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        monkeypatch.setattr(outside, "forward", excluded)
    return reads


def decoding_engine(config, cpu_kernels: str = "auto") -> LLM:
    llm = LLM(config, random_init=True, kv_budget="2MiB", block_tokens=16,
              cpu_kernels=cpu_kernels)
    for p in prompts(3):
        llm.add_request(p, GREEDY)
    llm.step()  # prefill
    llm.step()  # a first decode step
    return llm


@pytest.mark.parametrize("kernels", ["torch", "c"])
def test_a_decode_step_reads_one_thing_back_from_the_device(monkeypatch, kernels):
    """A batch of three at different positions, through every layer kind, the window
    rings, partial groups and packed pools: the step's only read back is the sampled
    tokens with their finiteness (one copy); with the C kernels not even that (one C pass
    takes each row's greedy token and finiteness where the logits lie)."""
    from kvstack.config import preset

    config = preset("tiny").replace(n_routed_experts=0, n_shared_experts=0,
                                    n_activated_experts=0, moe_inter_dim=0, inter_dim=64)
    llm = decoding_engine(config, kernels)
    reads = count_host_reads(monkeypatch)
    outputs = llm.step()
    assert len(outputs) == 3 and all(len(o.token_ids) == 3 for o in outputs)
    assert reads == (["tolist"] if kernels == "torch" else [])


@pytest.mark.parametrize("name", ["tiny", "tiny-v41"])
def test_with_experts_only_their_dispatch_reads_back(monkeypatch, name):
    """Routing tokens to experts in eager torch needs the chosen experts on the host; the
    rest of the step (with Engram and hyper-connections on tiny-v41) reads nothing more."""
    from kvstack.model.model import MoE

    llm = decoding_engine(name, "torch")
    reads = count_host_reads(monkeypatch, outside=MoE)
    llm.step()
    assert reads == ["tolist"]


def test_a_decode_step_gone_non_finite_is_recomputed_not_sampled(monkeypatch, alone):
    """Nothing in a decode step looks at its values; a NaN written anywhere reaches the
    logits, which the step checks, and the batch is recomputed."""
    llm = tiny()
    ids = [llm.add_request(p, GREEDY) for p in prompts(2)]
    llm.step()
    llm.step()
    layer, forward = llm.model.layers[5], Layer.forward
    poisoned = []

    def poisoning(self, s, start, store, ctx):
        out = forward(self, s, start, store, ctx)
        if self is layer and isinstance(start, torch.Tensor) and not poisoned:
            poisoned.append(True)
            out.x[0] = float("nan")
        return out

    monkeypatch.setattr(Layer, "forward", poisoning)
    done = {}
    while len(done) < 2:
        done |= {o.request_id: o for o in llm.step() if o.finished}
    assert poisoned and [done[i].token_ids for i in ids] == alone[:2]


def test_asyncio_front_end_requests_interleave_with_a_sync_caller(alone):
    """Concurrent coroutines on the engine thread, a sync generate from another thread on
    the same core, and a coroutine that walks away early (aborted): each sees exactly its
    own outputs, final included, equal to running alone; no block is left held."""
    import asyncio
    import contextlib

    from kvstack import AsyncLLM

    llm = tiny()
    free = llm.cache.manager.num_free

    async def run(engine: AsyncLLM) -> tuple[list, list, list]:
        async def collect(prompt):
            return [out async for out in engine.generate(prompt, GREEDY)]

        async def walk_away():
            seen = []
            async with contextlib.aclosing(engine.generate(prompts(4)[3], GREEDY)) as outs:
                async for out in outs:
                    seen.append(out)
                    if len(seen) == 2:
                        break
            return seen

        sync = asyncio.to_thread(llm.generate, prompts(4)[2], GREEDY)
        results = await asyncio.gather(collect(prompts(4)[0]), collect(prompts(4)[1]),
                                       sync, walk_away())
        return results

    with AsyncLLM(llm) as engine:
        first, second, sync, left = asyncio.run(run(engine))
        for outs, expected in ((first, alone[0]), (second, alone[1])):
            assert outs[-1].finished and outs[-1].token_ids == expected
            assert [o.finished for o in outs].count(True) == 1
            assert len({o.request_id for o in outs}) == 1
            assert all(len(o.token_ids) == i + 1 for i, o in enumerate(outs))
        assert sync[0].token_ids == alone[2]
        assert len(left) == 2 and not left[-1].finished
        # The walked-away request's abort reaches the engine thread through its inbox,
        # after the coroutine has returned.
        deadline = time.monotonic() + 30
        while llm.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not llm.has_unfinished_requests()
        assert llm.cache.manager.num_free == free

        async def bad():
            return [o async for o in engine.generate("", GREEDY)]
        with pytest.raises(ValueError, match="the prompt is empty"):
            asyncio.run(bad())


# Every layer mode in five layers: window only, Full at ratio 2 and its Reuse (encoder),
# the CED stream at ratio 1 as the candidate source, Reindex inside its pool; with the
# tiny preset's MoE and hyper-connections.
FIVE_LAYERS = preset("tiny").replace(
    n_layers=5, compress_ratios=[0, 2, 2, 1, 1], kv_source_layers=[1, 3],
    index_source_layers=[1, 3, 4], candidate_source_layer=3, n_encoder_layers=3)


def test_a_compiled_decode_step_decodes_as_the_eager_one(monkeypatch):
    """Traced one graph per batch-size bucket with fullgraph (a graph break is
    an error): three sequences at different positions decode the same greedy tokens as
    eager -- padded to a batch of 4, then the first alone as 1 once the other two end (a
    batch of 2 would run the same code as either, and each trace of five layers takes
    half a minute on 2 cores) -- and their tables growing by blocks make no new graph.
    Traced with aot_eager, which runs the captured graphs without Inductor's code
    generation (minutes on a 2-core machine; bench/decode.py --compile measures
    Inductor's)."""
    original = Model.compile_decode
    monkeypatch.setattr(Model, "compile_decode", lambda self: original(self, "aot_eager"))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 3, 3)]
    # 59, 5 and 9 tokens: tables of 4, 1 and 1 blocks; the first grows to 7
    three = [prompts(3)[2], prompts(3)[1], prompts(3)[0]]
    settings = {"kv_budget": "2MiB", "block_tokens": 16, "max_num_seqs": 4}
    eager = LLM(FIVE_LAYERS, random_init=True, **settings)
    assert eager.memory_report()["backend"] == {"decode": "eager", "attention": "torch",
                                                "cpu_kernels": "c", "matrices": "float32"}
    llm = LLM(FIVE_LAYERS, random_init=True, compile_decode=True, **settings)
    assert llm.memory_report()["backend"]["graphs"] == 0
    outputs = llm.generate(three, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager.generate(three, params)]
    backend = llm.memory_report()["backend"]
    assert backend["decode"] == "torch.compile"
    assert backend["batch_buckets"] == [1, 2, 4]
    assert backend["graphs"] == 2  # buckets 4 and 1
    assert backend["compile_seconds"] > 0
    # A second compiled model in the process makes its own graphs, and each model's step
    # looks only at its own (torch.compile tries a code object's graphs in turn). It
    # reads every ring and gathered row through the opaque op a large batch uses. Traced
    # by dynamo alone (the "eager" backend runs its graphs as captured), which is what
    # keeps graphs on code objects; aot_eager above has checked the graphs themselves.
    # The longest sequence alone: one graph, its table growing from 4 blocks to 7.
    monkeypatch.setattr(rows_module, "OPAQUE_READ_ROWS", 1)
    monkeypatch.setattr(Model, "compile_decode", lambda self: original(self, "eager"))
    again = LLM(FIVE_LAYERS, random_init=True, compile_decode=True, **settings)
    assert again.generate(three[:1], params[:1])[0].token_ids == outputs[0].token_ids
    assert again.memory_report()["backend"]["graphs"] == 1
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    codes = [_step_code(m) for m in (llm.model, again.model)]
    assert codes[0] is not codes[1]
    assert [len(_debug_get_cache_entry_list(code)) for code in codes] == [2, 1]


def test_a_compiled_step_checks_its_guards_once_per_step_shape(monkeypatch):
    """A decode step of a (batch, table width) already seen runs only the guards that
    tell its graphs apart; the first step of a new width checks them all, so a layer
    that changes how it runs there gets its own graph. Here a Reindex layer's stream
    outgrows its candidate pool (4 blocks of 4 entries) when the table grows to a
    second block: two graphs, the eager tokens, and every other step skips the guards."""
    original = Model.compile_decode
    monkeypatch.setattr(Model, "compile_decode", lambda self: original(self, "eager"))
    config = FIVE_LAYERS.replace(candidate_topk_blocks=4, candidate_block_size=4)
    settings = {"kv_budget": "2MiB", "block_tokens": 16, "max_num_seqs": 1}
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    prompt = [prompts(2)[1]]  # 5 tokens
    eager = LLM(config, random_init=True, **settings).generate(prompt, params)
    llm = LLM(config, random_init=True, compile_decode=True, **settings)
    step, skipped = llm.model._compiled_step, []

    def counted(*args: object) -> object:
        skipped.append(torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance())
        return step(*args)

    llm.model._compiled_step = counted
    assert llm.generate(prompt, params)[0].token_ids == eager[0].token_ids
    assert llm.memory_report()["backend"]["graphs"] == 2
    # Tables of 1, 2 and 3 blocks (35 tokens at the end); the first token is prefill's.
    assert skipped.count(False) == 3 and len(skipped) == 29


def test_a_traced_read_of_packed_rows_equals_the_eager_one(monkeypatch):
    """A large read is one opaque op to a traced step, a small one the graph's own code;
    both give what the eager read gives."""
    g = torch.Generator().manual_seed(0)
    packed = rows_module.PackedRows("fp4_e4m3_16", 32, (6, 4), torch.device("cpu"))
    packed.data.copy_(packed.pack(torch.randn(6, 4, 32, generator=g))[0])
    index = torch.tensor([[23, 0, 5], [5, 17, 9]])  # rows counted over [6, 4] as one
    eager = packed.read_at(index)
    assert eager.shape == (2, 3, 32)
    assert torch.equal(eager[1, 1], packed.read(packed.data[4, 1]))
    graphs = []

    def keep_graph(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(str(gm.graph))
        return gm.forward

    for opaque_from, opaque in ((1, True), (1024, False)):
        monkeypatch.setattr(rows_module, "OPAQUE_READ_ROWS", opaque_from)
        traced = torch.compile(packed.read_at, fullgraph=True, backend=keep_graph)
        assert torch.equal(traced(index), eager)
        assert ("kvstack.read_rows" in graphs[-1]) is opaque


def _step_code(model: Model) -> types.CodeType:
    """The code object torch.compile keeps a model's compiled decode step's graphs on."""
    return model._compiled_step._torchdynamo_orig_callable.__func__.__code__


@pytest.mark.parametrize("tokens", [1, 6])
def test_the_grouped_moe_equals_each_expert_on_its_tokens(tokens):
    """Inference gathers the weights of each (token, expert) pair for a few pairs (1
    token: 2 of 4 experts) and runs grouped matmuls over the pairs sorted by expert for
    more (6 tokens: every expert, some twice), traced as well as eager; training runs each
    chosen expert on its tokens. They agree."""
    torch.manual_seed(0)
    moe = Model(preset("tiny")).layers[1].ffn
    x = torch.randn(tokens, 1, preset("tiny").dim)
    each = moe(x).detach()  # grad enabled: the per-expert loop
    with torch.no_grad():
        grouped = moe(x)
        traced = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(grouped, each, atol=1e-6, rtol=1e-5)
    assert torch.equal(traced, grouped)


def test_grouped_matmuls_by_group_equal_torch_s_grouped_gemm():
    """The per-group form (what a CUDA device runs for float32, and any shape whose rows
    are not whole 16 bytes) against torch's kernel, with an expert that has no rows."""
    g = torch.Generator().manual_seed(0)
    ends = torch.tensor([2, 2, 7], dtype=torch.int32)
    for width in (8, 5):  # 32-byte rows (torch's kernel), 20-byte ones (by group)
        x, w = torch.randn(7, 16, generator=g), torch.randn(3, 16, width, generator=g)
        got = grouped_mm(x, w, ends)
        assert torch.allclose(got, grouped_mm_by_group(x, w, ends), atol=1e-6)
        assert torch.allclose(got[:2], x[:2] @ w[0], atol=1e-6)
        assert torch.allclose(got[2:], x[2:] @ w[2], atol=1e-6)


def test_compiled_decode_refuses_packed_experts(monkeypatch):
    model = Model(preset("tiny"))
    monkeypatch.setattr(model.layers[1].ffn, "experts", PackedExperts([]))
    with pytest.raises(ValueError, match="packed"):
        model.compile_decode("aot_eager")


@pytest.mark.parametrize("replay", ["bounded", "exact"])
def test_a_prompt_prefilled_in_parts_gives_the_tokens_of_one_prefill(replay):
    """A step budget far below the prompts' lengths spreads each prompt over several steps
    (the encoder over leading parts, the decoder over the last); every request, joining
    while others decode, gets the greedy tokens of an engine that prefills each prompt
    whole."""
    g = torch.Generator().manual_seed(3)
    long_prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 41, 170)]
    whole = tiny(replay=replay, max_num_batched_tokens=4096, kv_budget="8MiB")
    expected = [o.token_ids for o in whole.generate(long_prompts, GREEDY)]
    parted = tiny(replay=replay, max_num_batched_tokens=24, kv_budget="8MiB")
    parts = []
    prefill_part = parted.runner.prefill_part
    parted.runner.prefill_part = lambda seq, n: (parts.append(n), prefill_part(seq, n))[1]
    assert [o.token_ids for o in parted.generate(long_prompts, GREEDY)] == expected
    final = parted.model.final_prefill_tokens(replay)
    assert len(parts) > 10 and max(parts) <= 24 and final > 1


def test_a_long_prompt_stalls_no_running_stream():
    """While a long prompt is prefilled in parts, every step still decodes the requests
    already running: each gains one token a step."""
    llm = tiny(max_num_batched_tokens=32, kv_budget="8MiB")
    running = llm.add_request(prompts(1)[0], SamplingParams(max_tokens=60, temperature=0,
                                                            ignore_eos=True))
    llm.step()  # its prefill
    long_id = llm.add_request(list(range(1, 250)), GREEDY)
    steps_until_first_token = 0
    while True:
        outs = {o.request_id: o for o in llm.step()}
        steps_until_first_token += 1
        assert running in outs  # the running stream moved in this step too
        if long_id in outs:
            break
    assert steps_until_first_token > 5  # the prompt took several steps, the stream with it


def test_a_prefix_hits_replay_spends_its_steps_budget():
    """A part whose store owes a replay counts the replayed tokens: two hits that do not
    fit one step's budget together prefill in two steps (the first alone, over the
    budget if it must), and their tokens are those of an engine with room for both."""
    from kvstack.engine.scheduler import Scheduler, StepPlan

    sched = Scheduler(tiny().cache, 4, 100, replay_tokens=lambda cached: min(cached, 30))
    hit = types.SimpleNamespace(num_tokens=90, store=types.SimpleNamespace(
        num_tokens=80, replay_owed=True))
    plan = StepPlan()
    assert sched._plan_part(plan, hit, 100) == 40  # 10 tokens after a replay of 30
    assert sched._plan_part(plan, hit, 25) == 0  # its replay alone outgrows what is left
    assert sched._plan_part(StepPlan(), hit, 20) == 40  # alone: it runs, over the budget
    hit.store.replay_owed = False  # it will copy a window checkpoint: no replay
    assert sched._plan_part(StepPlan(), hit, 100) == 10

    prefix = list(range(3, 163))
    asks = [[*prefix, 7, 8, 9], [*prefix, 11, 12]]
    roomy = tiny(max_num_batched_tokens=4096, kv_budget="8MiB")
    roomy.generate([prefix], GREEDY)
    expected = [o.token_ids for o in roomy.generate(asks, GREEDY)]
    llm = tiny(max_num_batched_tokens=4096, kv_budget="8MiB")
    llm.generate([prefix], GREEDY)
    replay = llm.model.rebuild_spans(len(prefix), "exact")[0]
    llm.scheduler.max_num_batched_tokens = replay + 8  # room for one hit's replay and part
    ids = [llm.add_request(ask, GREEDY) for ask in asks]
    steps, done = [], {}
    while llm.has_unfinished_requests():
        steps.append(outputs := llm.step())
        done |= {o.request_id: o.token_ids for o in outputs if o.finished}
    assert {o.request_id for o in steps[0]} == {ids[0]}  # the second hit waits a step
    assert ids[1] in {o.request_id for o in steps[1]}
    assert [done[i] for i in ids] == expected


def test_a_prompt_part_keeps_room_for_the_decoder_span():
    """A part is cut so that the last part holds at least the decoder span; a prompt that
    cannot be cut so runs whole, over the budget, when nothing else prefills."""
    from kvstack.engine.scheduler import Scheduler, StepPlan

    sched = Scheduler(tiny().cache, 4, 100, final_prefill_tokens=20)
    seq = types.SimpleNamespace(num_tokens=110, store=types.SimpleNamespace(
        num_tokens=0, replay_owed=False))
    plan = StepPlan()
    assert sched._plan_part(plan, seq, 100) == 90  # leaves 20 for the last part
    seq.store.num_tokens = 90
    assert sched._plan_part(StepPlan(), seq, 15) == 20  # 20 left: whole, over the budget
    assert sched._plan_part(plan, seq, 15) == 0  # the step already prefills a part


def record_prefills(core, events: list) -> None:
    """Each prefill call of the core's runner recorded in `events` as it starts."""
    prefill = core.runner.prefill

    def recorded(seq):
        events.append(("prefill", seq.request_id))
        return prefill(seq)

    core.runner.prefill = recorded


def test_a_step_hands_out_each_output_when_its_model_call_returns():
    """A step that decodes a batch and prefills several prompts routes the decode
    batch's tokens before any prefill runs, and each prompt's first token before the next
    prompt's prefill, the shortest prompt first; a prompt whose rest fits a window runs as
    rows of the decode call, its first token out with the batch's."""
    llm = tiny(max_num_seqs=4)
    core, events = llm.core, []
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    running = core.add_request(list(range(1, 20)), params,
                               on_output=lambda out: events.append(("out", out.request_id)))
    core.step()  # prefilled: it decodes in the next step
    events.clear()
    record_prefills(core, events)
    long_, short = (core.add_request(ids, params, on_output=lambda out: events.append(
        ("out", out.request_id))) for ids in (list(range(1, 60)), list(range(1, 9))))
    outputs = core.step()
    assert core.runner.joins_decode(core.requests[short], 8)
    assert events == [("out", running), ("out", short), ("prefill", long_), ("out", long_)]
    assert [o.request_id for o in outputs] == [running, short, long_]


def test_a_prompt_that_owes_a_replay_prefills_after_the_decode_call():
    """A prefix hit with no window checkpoint owes a replay (a window of tokens through
    every layer): it runs as its own prefill once the decode call has handed out the
    running stream's token and the joined prompt's, not as rows of that call, which it
    would hold up; a later hit on the same blocks copies the checkpoint the replay left
    and joins the call."""
    llm = tiny(kv_budget="4MiB", block_tokens=8)
    core, events = llm.core, []
    prefix = list(range(1, 17))
    llm.generate([*prefix, 5], GREEDY)  # names the prefix's blocks
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    def out(o):
        events.append(("out", o.request_id))

    running = core.add_request(list(range(30, 40)), params, on_output=out)
    core.step()
    record_prefills(core, events)
    hit = core.add_request([*prefix, 7, 7], params, on_output=out)
    short = core.add_request([50, 51, 52], params, on_output=out)
    events.clear()
    core.step()
    assert core.requests[hit].store.replay_owed is False  # replayed in its prefill
    assert events == [("out", running), ("out", short), ("prefill", hit), ("out", hit)]
    again = core.add_request([*prefix, 8, 8], params, on_output=out)
    events.clear()
    core.step()
    assert ("prefill", again) not in events and ("out", again) in events


def test_a_steps_prompt_calls_run_cheapest_first_counting_an_owed_replay():
    """A step's prompt calls run by the tokens each runs: a prefix hit with two new tokens
    that owes a replay over its 40 cached ones runs after a fresh 20-token prompt."""
    llm = tiny(kv_budget="4MiB", block_tokens=8, max_num_seqs=4)
    core, events = llm.core, []
    prefix = list(range(1, 41))
    llm.generate([*prefix, 5], GREEDY)  # names the prefix's five blocks
    record_prefills(core, events)
    hit = core.add_request([*prefix, 7, 7], GREEDY)
    fresh = core.add_request(list(range(100, 120)), GREEDY)
    core.step()
    assert core.scheduler.replay_tokens(40) == 40
    assert events == [("prefill", fresh), ("prefill", hit)]


def test_a_request_arriving_during_a_step_ends_it_after_the_current_prompt_call():
    """With a front end's request waiting (`EngineCore.arrivals`), a step stops after the
    prompt call it is in; the prompts it had left prefill in the next step, after that
    step's decode call, and every request's tokens are those of an engine that runs
    each step through."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    asks = [list(range(1, 31)), list(range(40, 80)), list(range(90, 110))]

    def run(yielding: bool) -> tuple[dict[str, list[int]], list]:
        llm = tiny(max_num_seqs=4)
        core, events, done = llm.core, [], {}

        def out(o):
            events.append(("out", o.request_id))
            if o.finished:
                done[o.request_id] = o.token_ids

        running = core.add_request(asks[0], params, on_output=out)
        core.step()
        record_prefills(core, events)
        first, second = (core.add_request(ids, params, on_output=out) for ids in asks[1:])
        # A request arrives while the step's first prompt call runs.
        core.arrivals = (lambda: ("prefill", second) in events) if yielding else None
        events.clear()
        core.step()
        step_one, left = list(events), core.requests[first].store.num_tokens
        core.arrivals = None
        events.clear()
        core.step()
        if yielding:  # the shorter prompt first, then the step ends
            assert step_one == [("out", running), ("prefill", second), ("out", second)]
            assert left == 0
            assert events == [("out", running), ("out", second), ("prefill", first),
                              ("out", first)]
        while core.has_unfinished_requests():
            core.step()
        return [done[i] for i in (running, first, second)], step_one

    assert run(True)[0] == run(False)[0]


def test_prompts_joined_to_the_decode_call_equal_a_prefill_each():
    """Prompts whose rest fits a window run as rows of the decode call, several at once
    beside running streams, one of them on a cached prefix (its window state copied from
    the checkpoint an earlier hit's replay left): every greedy output equals the model's
    own by a prefill of it alone, then decode steps."""
    from kvstack.cache.reference import ReferenceStore

    llm = tiny(kv_budget="4MiB", block_tokens=8)
    model, c = llm.model, llm.config
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, 256, (16,), generator=g).tolist()
    texts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 8, 6, 1)]
    texts[1] = prefix + texts[1]  # 16 cached tokens, 8 to go: restored, then joined
    llm.generate([*prefix, 5], GREEDY)  # names the prefix's blocks
    llm.generate([*prefix, 9, 9], GREEDY)  # a hit's replay leaves the blocks' checkpoint
    running = llm.add_request(texts[0], SamplingParams(max_tokens=20, temperature=0,
                                                       ignore_eos=True))
    llm.step()
    joined = []
    decode = llm.runner.decode_with_prompts

    def recorded(decoding, prompts):
        joined.append(len(prompts))
        return decode(decoding, prompts)

    llm.runner.decode_with_prompts = recorded
    outs = llm.generate(texts[1:], GREEDY)
    assert joined and max(joined) == 3  # the three prompts in one call with the stream
    assert outs[0].num_cached_tokens == 16
    for text, out in zip(texts[1:], outs, strict=True):
        store = ReferenceStore(c, 1, torch.device("cpu"))
        with torch.no_grad():
            logits = model.prefill(torch.tensor([text]), store, replay="exact")
            expected = [int(logits.argmax())]
            for _ in range(GREEDY.max_tokens - 1):
                expected.append(int(model.decode(torch.tensor([expected[-1]]), store).argmax()))
        assert out.token_ids == expected
    assert llm.has_request(running)


def test_a_prompt_as_rows_of_a_decode_step_gives_a_prefills_logits():
    from kvstack import native
    from kvstack.cache.batch import DecodeBatch
    from kvstack.cache.reference import ReferenceStore

    llm = tiny(kv_budget="4MiB", block_tokens=8)
    model, c = llm.model, llm.config
    ids = torch.randint(0, 256, (c.window_size,), generator=torch.Generator().manual_seed(3))
    store = llm.cache.open_sequence()
    assert store.reserve(len(ids))
    with torch.no_grad(), native.active(True):
        rows = model.decode(ids.tolist(), DecodeBatch([store], counts=[len(ids)]),
                            logit_rows=[len(ids) - 2, len(ids) - 1])
        whole = model.extend(ids[None], ReferenceStore(c, 1, torch.device("cpu")),
                             replay="exact", n_logits=2).logits[0]
    assert torch.allclose(rows, whole, atol=1e-4), (rows - whole).abs().max()
    llm.cache.close_sequence(store)


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine_thread():
    """Outputs for a coroutine whose loop has closed (it stopped reading before its abort
    landed) are dropped; the engine thread goes on serving the others."""
    import asyncio

    from kvstack import AsyncLLM

    llm = tiny()
    with AsyncLLM(llm) as engine:
        loop = asyncio.new_event_loop()
        outputs = engine.generate(prompts(1)[0], SamplingParams(max_tokens=30, temperature=0,
                                                                ignore_eos=True))
        first = loop.run_until_complete(outputs.__anext__())
        loop.close()  # the generator is left open: its request goes on, undelivered
        deadline = time.monotonic() + 30
        while len(llm.core.requests[first.request_id].output_ids) < 5 and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine._thread.is_alive()

        async def after() -> list[int]:
            return [o async for o in engine.generate(prompts(2)[1], GREEDY)][-1].token_ids

        assert asyncio.run(after()) == tiny().generate(prompts(2)[1], GREEDY)[0].token_ids
        llm.abort(first.request_id)


def test_a_call_to_the_in_process_engine_runs_between_steps_while_a_request_runs():
    """`AsyncLLM.call` is taken by the engine thread between steps: a reading made while a
    long request runs sees it running (it does not wait out the generation on the core's
    lock), and a handler's error reaches the caller, not the engine."""
    import asyncio

    from kvstack import AsyncLLM

    class Handler:
        def __init__(self, llm: LLM) -> None:
            self.llm = llm

        def running(self) -> int:
            with self.llm.core.lock:
                return len(self.llm.scheduler.running)

        def fail(self) -> None:
            raise KeyError("no such thing")

    with AsyncLLM(tiny()) as engine:
        engine.handler = Handler(engine.llm)

        async def run() -> tuple[list[int], int, int]:
            outputs = engine.generate(prompts(1)[0], SamplingParams(
                max_tokens=400, temperature=0, ignore_eos=True))
            first = await outputs.__anext__()
            readings = [await engine.call("running") for _ in range(3)]
            with pytest.raises(KeyError, match="no such thing"):
                await engine.call("fail")
            last = [o async for o in outputs][-1]
            return readings, len(first.token_ids), len(last.token_ids)

        readings, first_len, last_len = asyncio.run(run())
        assert readings == [1, 1, 1] and first_len < 400 and last_len == 400
        engine.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            asyncio.run(engine.call("running"))
