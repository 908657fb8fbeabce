"""The engine: paged cache, continuous batching, preemption, the LLM API, measured bytes."""

import logging
import os

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.cache.paged import PagedCache
from kvstack.cache.rows import PackedRows
from kvstack.config import preset
from kvstack.engine.sequence import Sequence
from kvstack.model.model import KEY_CHUNK
from kvstack.units import parse_bytes

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BF16 = dict(kv_format="bf16", index_format="bf16", window_format="bf16")


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by the reference forward, every token recomputed from scratch."""
    ids, out = list(prompt), []
    for _ in range(n):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
    return out


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("formats", ["bf16", "fp4"])
def test_greedy_output_equals_the_reference_with_requests_joining_mid_run(formats):
    config = preset("tiny").replace(**BF16) if formats == "bf16" else preset("tiny")
    llm = LLM(config, random_init=True, kv_budget="2MiB", replay="exact", block_tokens=16)
    first, late = prompts([5, 37]), prompts([70, 12], seed=1)
    ids = [llm.add_request(p, GREEDY) for p in first]
    for _ in range(4):
        llm.step()
    ids += [llm.add_request(p, GREEDY) for p in late]  # join a running batch
    outputs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out
    for request_id, prompt in zip(ids, first + late, strict=True):
        out = outputs[request_id]
        assert out.finish_reason == "length"
        assert out.token_ids == reference_greedy(llm.model, prompt, 10), request_id


def test_preemption_finishes_every_request_with_the_roomy_output():
    work = prompts([40, 33, 50, 20], seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = LLM("tiny", random_init=True, kv_budget="4MiB", replay="exact", block_tokens=16)
    expected = [o.token_ids for o in roomy.generate(work, params)]
    # Room for about two of the four sequences at full length.
    ring_bytes = roomy.cache.layout.window_bytes_per_sequence
    block = 16 * roomy.memory_report()["bytes_per_token"]
    tight = LLM("tiny", random_init=True, kv_budget=int(4 * ring_bytes + 10 * block),
                replay="exact", block_tokens=16, max_num_seqs=4, window_checkpoints=0)
    assert tight.memory_report()["blocks_total"] == 10
    outputs = tight.generate(work, params)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert sum(o.metrics["preemptions"] for o in outputs) > 0
    assert tight.cache.manager.num_free == 10  # everything given back


def fill(store, n_tokens: int, config, seed: int = 0) -> None:
    """Write n_tokens of context into a sequence's store through its real write path
    (quantise, pack, place in its blocks) without running the model."""
    g = torch.Generator().manual_seed(seed)
    assert store.reserve(n_tokens + 1)
    store.append_tokens(torch.randint(0, 256, (1, n_tokens), generator=g))
    for layer in {s.layer for s in store.pools.layout.streams}:
        ratio = config.compress_ratios[layer]
        store.append_stream(layer, {
            "kv": torch.randn(1, n_tokens // ratio, config.head_dim, generator=g),
            "index": torch.randn(1, n_tokens // ratio, config.index_head_dim, generator=g)})


def test_v41_layout_small_measures_890_bytes_per_token():
    llm = LLM("v41-layout-small", random_init=True, kv_budget="64MiB", max_num_seqs=2)
    report = llm.memory_report()
    assert report["bytes_per_token"] == 890 and report["planned_bytes_per_token"] == 890
    assert "measured" in report["basis"]
    rows = {(s["layer"], s["kind"]): s for s in report["streams"]}
    assert rows[20, "kv"]["bytes_per_token"] == 288 and rows[2, "index"]["bytes_per_token"] == 34
    assert report["window_bytes_per_sequence"] == 40 * 128 * 528 == (
        report["planned_window_bytes_per_sequence"])
    assert report["warnings"] == []
    # A real request through the engine lands in the pools it measures.
    prompt = prompts([2000])[0]
    llm.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.step()
    report = llm.memory_report()
    assert report["tokens_in_use"] == len(prompt)
    assert report["blocks_in_use"] == -(-len(prompt) // 64)
    # 16K tokens more: whole blocks are allocated, so the in-use figure is 890 plus at most
    # one block's padding per sequence.
    fill(llm.cache.open_sequence(), 16 * 1024 + 40, llm.config)
    report = llm.memory_report()
    assert report["tokens_in_use"] == len(prompt) + 16 * 1024 + 40
    assert 890 <= report["in_use_bytes_per_token"] <= 890 * (1 + 2 * 64 / (16 * 1024))


def test_a_stream_stored_wider_than_planned_is_reported_loudly(caplog):
    llm = LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16)
    pool = llm.cache.pools.rows[4, "kv"]
    pool.data = torch.zeros(*pool.data.shape[:-1], 2 * pool.data.shape[-1], dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="kvstack"):
        report = llm.memory_report()
    assert report["bytes_per_token"] > report["planned_bytes_per_token"]
    assert any("layer 4 kv stream stores 36 B per entry" in w for w in report["warnings"])
    assert "MISMATCH" in caplog.text


def test_decode_at_32k_reads_no_float_copy_of_the_context(monkeypatch):
    """One decode step at 32K tokens of context by torch's ops dequantises window rows,
    indexer keys KEY_CHUNK at a time, and only the selected KV rows: never a [context,
    head_dim] float tensor. (The C kernels make no float copy of a key at all.)"""
    config = preset("tiny").replace(max_seq_len=40_000)
    llm = LLM(config, random_init=True, kv_budget="64MiB", block_tokens=64, max_num_seqs=1,
              cpu_kernels="torch")
    context = 32 * 1024
    store = llm.cache.open_sequence()
    fill(store, context, config)
    seq = Sequence("probe", [1] * context, GREEDY, output_ids=[7], store=store)

    largest = []
    original = PackedRows.read

    def counting_read(self, rows):
        largest.append(rows[..., 0].numel())
        return original(self, rows)

    monkeypatch.setattr(PackedRows, "read", counting_read)
    token = llm.runner.decode([seq])[0].token
    assert 0 <= token < config.vocab_size
    assert store.num_tokens == context + 1
    assert max(largest) <= KEY_CHUNK < context


def test_sampling_controls():
    llm = LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=11,
                            ignore_eos=True)
    a, b = llm.generate(["same prompt", "same prompt"], seeded)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    hook = llm.model.head.register_forward_hook(  # the model now writes "xyxyxy..."
        lambda module, args, out: out.index_fill(-1, torch.tensor([ord("x")]), 1e4)
        if len(llm.scheduler.running) and len(llm.scheduler.running[0].output_ids) % 2 == 0
        else out.index_fill(-1, torch.tensor([ord("y")]), 1e4))
    stopped = llm.generate("abc", SamplingParams(max_tokens=10, temperature=0,
                                                 ignore_eos=True, stop=["yx"]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == "x"  # "xyx": cut at "yx"
    hook.remove()
    eos = llm.tokenizer.eos_id
    llm.model.head.register_forward_hook(
        lambda module, args, out: out.index_fill(-1, torch.tensor([eos]), 1e4))
    out = llm.generate("x", SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos] and out.text == ""
    out = llm.generate("x", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == [eos] * 5


def test_stream_yields_growing_outputs_and_abort_frees_blocks():
    llm = LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16)
    seen = [out.token_ids for out in llm.stream("hello", GREEDY)]
    assert [len(t) for t in seen] == list(range(1, 11))
    request = llm.add_request("a long running request", SamplingParams(max_tokens=50))
    llm.step()
    assert llm.cache.manager.num_free < llm.cache.manager.n_blocks
    llm.abort(request)
    assert not llm.has_unfinished_requests()
    assert llm.cache.manager.num_free == llm.cache.manager.n_blocks


def test_bad_requests_are_refused_and_the_engine_keeps_serving():
    llm = LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16)
    good = llm.add_request("still served", GREEDY)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.add_request("", GREEDY)
    with pytest.raises(ValueError, match=r"outside the vocabulary 0\.\.511"):
        llm.add_request([1, 2, 999], GREEDY)
    with pytest.raises(ValueError, match="leaves no room under max_seq_len 512"):
        llm.add_request([1] * 512, GREEDY)
    with pytest.raises(ValueError, match="a prompt is a string or a list of token ids"):
        llm.add_request(3.5, GREEDY)
    small = LLM(preset("tiny").replace(max_seq_len=4096), random_init=True, kv_budget="40KiB",
                block_tokens=16, max_num_seqs=1)
    capacity = small.memory_report()["capacity_tokens"]
    with pytest.raises(ValueError, match=f"does not fit the cache pool of {capacity} tokens"):
        small.add_request([1] * capacity, GREEDY)
    finished = {}
    while llm.has_unfinished_requests():
        finished |= {o.request_id: o for o in llm.step() if o.finished}
    assert finished[good].finish_reason == "length"
    out = llm.generate("after the refusals", GREEDY)[0]
    assert len(out.token_ids) == 10
    assert llm.core.requests == {}  # finished requests are not kept around


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(max_tokens=0), "max_tokens must be an integer from 1"),
    (dict(temperature=-1), "temperature must be between 0 and 100"),
    (dict(temperature=float("nan")), "temperature must be between 0 and 100"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-3), "top_k must be a non-negative integer"),
    (dict(stop=[""]), "stop must be non-empty strings"),
])
def test_absurd_sampling_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_model_directories_with_missing_or_mismatched_files(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(tmp_path / "nothing")
    model = LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16).model
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer\.json is missing"):
        LLM(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot load"):
        LLM(tmp_path, kv_budget="1MiB", block_tokens=16)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        LLM("huge", random_init=True)


def test_a_fifo_for_weights_and_a_config_past_memory_are_refused_not_hung(tmp_path):
    from kvstack.engine.tokenizer import byte_level_tokenizer_json

    LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16).model.save_pretrained(
        tmp_path)
    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (tmp_path / "model.safetensors").unlink()
    os.mkfifo(tmp_path / "model.safetensors")  # opening it for reading would block
    with pytest.raises(ValueError, match=r"model\.safetensors is not a regular file"):
        LLM(tmp_path, kv_budget="1MiB", block_tokens=16)
    huge = preset("tiny-v41").replace(n_routed_experts=1_000_000)
    with pytest.raises(ValueError, match="GiB, more than this machine's"):
        LLM(huge, random_init=True, kv_budget="1MiB")


def test_budget_and_block_size_are_checked():
    config = preset("tiny")
    with pytest.raises(ValueError, match="kv_budget of 1,000 bytes is too small"):
        PagedCache(config, 1000, 16, 8)
    with pytest.raises(ValueError, match="block_tokens must be a positive multiple of 2"):
        PagedCache(config, "1MiB", 15, 8)
    with pytest.raises(ValueError, match="not a size like 4GiB"):
        parse_bytes("four gigs")
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("1.5 MB") == 1_500_000


def test_a_kept_conversation_continues_without_recomputing_it(monkeypatch):
    llm = LLM("tiny", random_init=True, kv_budget="2MiB", replay="exact", block_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = list(llm.stream("first turn", params, keep_cache=True))[-1]
    assert first.finished and llm.memory_report()["tokens_in_use"] > 0  # the cache stays
    fed = []
    original = llm.runner.prefill

    def counting_prefill(seq):
        fed.append(seq.num_tokens - seq.store.num_tokens)
        return original(seq)

    monkeypatch.setattr(llm.runner, "prefill", counting_prefill)
    second = list(llm.stream(" and a second", params, continue_from=first.request_id))[-1]
    assert fed == [1 + len(" and a second")]  # the last answer token and the new turn only
    # The same as one request over the whole conversation, from scratch.
    whole = first.prompt_token_ids + first.token_ids + list(b" and a second")
    fresh = LLM("tiny", random_init=True, kv_budget="2MiB", replay="exact", block_tokens=16)
    assert second.token_ids == fresh.generate(whole, params)[0].token_ids
    assert llm.memory_report()["tokens_in_use"] == 0  # not kept this time
    with pytest.raises(ValueError, match="not a finished request to continue"):
        llm.add_request("more", params, continue_from=first.request_id)


def test_kept_caches_yield_their_room_to_new_requests():
    llm = LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    kept = list(llm.stream("keep me", params, keep_cache=True))[-1]
    # The only ring slot is kept; a new request evicts it instead of waiting forever.
    assert len(llm.generate("another", params)[0].token_ids) == 4
    again = list(llm.stream(" more", params, continue_from=kept.request_id))[-1]
    assert len(again.token_ids) == 4  # recomputed from its token ids


@pytest.mark.parametrize("name", ["tiny", "dense-tiny", "tiny-v41"])
def test_one_batched_decode_equals_decoding_each_sequence_alone(name):
    """Sequences at different positions (different stream lengths, ring fill, partial
    groups, block tables; a prefix block shared) decode together in one model call over the
    pools, as each would alone through its own store; and so again in a batch padded with
    rows of its own (a compiled step's bucket), which change none of theirs."""
    from kvstack.cache.batch import DecodeBatch
    from kvstack.cache.paged import PagedCache
    from kvstack.model import Model

    torch.manual_seed(0)
    model = Model(preset(name)).eval()
    lengths = [3, 17, 40, 40]  # 17: a ratio-2 group left open; 3: shorter than the window
    texts = prompts(lengths, seed=5)
    texts[3] = texts[2][:32] + texts[3][32:]  # shares two full blocks with the third
    caches = [PagedCache(model.config, "4MiB", 16, 4, prefix_seed=b"seed", pad_slot=padded)
              for padded in (False, False, True)]
    alone, together, padded = [], [], []
    for ids in texts:
        for cache, stores in zip(caches, (alone, together, padded), strict=True):
            store = cache.open_sequence()
            cached = cache.attach_prefix(store, ids)
            assert store.reserve(len(ids) + 3)
            if store.needs_replay:
                model.rebuild_window(store, replay="exact")
                store.needs_replay = False
            model.prefill(torch.tensor([ids[cached:]]), store, replay="exact")
            cache.register_full_blocks(store)
            stores.append(store)
    assert together[3].block_table[:2] == together[2].block_table[:2]
    nxt = [11, 22, 33, 44]
    for _ in range(3):
        expected = torch.cat([model.decode(torch.tensor([t]), s)
                              for t, s in zip(nxt, alone, strict=True)])
        got = model.decode(nxt, DecodeBatch(together))
        assert (got - expected).abs().max() < 2e-5
        got = model.decode([*nxt, 0, 0, 0], DecodeBatch(padded, rows=7))
        assert got.shape[0] == 7 and (got[:4] - expected).abs().max() < 2e-5
        nxt = expected.argmax(-1).tolist()
    for stores in (together, padded):
        assert [s.held_ids for s in stores] == [s.held_ids for s in alone]
        assert all(s.caught_up for s in stores)


def test_a_decode_batch_reads_nothing_past_a_sequence_s_entries():
    """A batch reads a stream by whole blocks; the rows of a sequence's last block past
    its entries (left by an earlier sequence, or never written) come back as the null
    block's zeros, never as what is there."""
    from kvstack.cache.batch import DecodeBatch
    from kvstack.cache.paged import PagedCache
    from kvstack.model import Model

    model = Model(preset("tiny")).eval()
    cache = PagedCache(model.config, "2MiB", 16, 2)
    store = cache.open_sequence()
    assert store.reserve(24)
    model.prefill(torch.tensor([list(range(1, 21))]), store)  # 20 tokens of 2 blocks
    layer, kind = 1, "index"  # a ratio-2 stream: 10 entries, 8 per block
    pool = cache.pools.rows[layer, kind]
    pool.data[store.block_table[1], 2:] = 0xFF  # NaN scales past the sequence's entries
    batch = DecodeBatch([store])
    n = batch.stream_len(layer)
    rows = batch.read_stream(layer, kind, 0, n)
    held = batch.stream_lens[layer].item()  # 10: this step's entry included
    assert torch.equal(rows[0, held:], torch.zeros_like(rows[0, held:]))
    assert torch.equal(rows[0, :held - 1], store.read_stream(layer, kind, 0, held - 1)[0])
    assert torch.equal(batch.read_stream(layer, kind, 3, 13), rows[:, 3:13])


def test_a_decode_batch_refuses_stores_it_cannot_step():
    from kvstack.cache.batch import DecodeBatch
    from kvstack.cache.paged import PagedCache
    from kvstack.model import Model

    model = Model(preset("tiny")).eval()
    cache = PagedCache(model.config, "2MiB", 16, 2)
    store = cache.open_sequence()
    assert store.reserve(32)  # two blocks of 16
    model.prefill(torch.tensor([list(range(1, 33))]), store)
    with pytest.raises(ValueError, match="no room reserved"):
        DecodeBatch([store])  # its blocks are full
    assert store.reserve(33)
    batch = DecodeBatch([store])
    with pytest.raises(ValueError, match="holds 1 sequences, got a batch of 2"):
        model.decode([1, 2], batch)
    with pytest.raises(ValueError, match="one token for each"):
        batch.append_tokens([[1, 2]])
    with pytest.raises(ValueError, match="needs a cache with a pad slot"):
        DecodeBatch([store], rows=2)
    with pytest.raises(ValueError, match="cannot be padded to 0 rows"):
        DecodeBatch([store], rows=0)
    store.drop_window_state()
    with pytest.raises(ValueError, match="replay first"):
        DecodeBatch([store])
    with pytest.raises(ValueError, match="each sequence once"):
        DecodeBatch([cache.open_sequence()] * 2)


def test_a_decode_step_is_one_model_call(monkeypatch):
    llm = LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16)
    for p in prompts([5, 9, 30]):
        llm.add_request(p, GREEDY)
    llm.step()  # prefill all three
    calls = []
    original = llm.model.decode
    monkeypatch.setattr(llm.model, "decode",
                        lambda ids, cache: calls.append(len(ids)) or original(ids, cache))
    outs = llm.step()
    assert calls == [3] and len(outs) == 3


def test_the_bundled_model_serves_by_default():
    llm = LLM(kv_budget="16MiB", max_num_seqs=2)  # model="default"
    assert llm.config.n_encoder_layers == 4 and llm.config.kv_format == "fp4_e4m3_16"
    out = llm.generate("def main():\n", SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.token_ids and out.text
    assert llm.memory_report()["planned_bytes_per_token"] == 133.5


def test_penalties_change_the_logits_as_openai_and_vllm_define_them():
    from kvstack.engine.sampling import penalise

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    rep = penalise(logits, SamplingParams(repetition_penalty=2.0), [0], [1, 1])
    assert rep.tolist() == [1.0, -2.0, 0.5, 3.0]  # seen tokens: positive / 2, negative * 2
    both = penalise(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                    [0], [1, 1, 3])
    assert both.tolist() == [2.0, -1.0 - 0.5 - 0.5, 0.5, 3.0 - 0.25 - 0.5]
    for bad in (dict(presence_penalty=3), dict(repetition_penalty=0), dict(logprobs=21)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_logprobs_and_penalties_through_the_engine():
    llm = LLM("default", kv_budget="64MiB", threads=1)
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = "def main(self, name):\n"
    base = llm.generate(prompt, plain)[0]
    asked = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                ignore_eos=True, logprobs=3))[0]
    assert asked.token_ids == base.token_ids and base.logprobs is None
    assert len(asked.logprobs) == 24
    for token, entry in zip(asked.token_ids, asked.logprobs, strict=True):
        assert entry.top[0][0] == token and entry.logprob == entry.top[0][1] <= 0
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    penalised = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                    ignore_eos=True, frequency_penalty=2.0))[0]

    def most_repeated(ids: list[int]) -> int:
        return max(ids.count(t) for t in ids)

    assert most_repeated(penalised.token_ids) < most_repeated(base.token_ids)


def test_min_tokens_stop_token_ids_and_logit_bias():
    llm = LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16)
    eos = llm.tokenizer.eos_id
    prompt = list(range(5, 25))
    # End of sequence pushed to the top: held back for min_tokens, then taken at once.
    forced = SamplingParams(max_tokens=20, temperature=0, min_tokens=3,
                            logit_bias={eos: 100.0})
    out = llm.generate(prompt, forced)[0]
    assert eos not in out.token_ids[:3] and out.token_ids[3] == eos
    assert len(out.token_ids) == 4 and out.finish_reason == "stop"
    # A stop token id ends the reply as the end of sequence does.
    plain = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0,
                                                ignore_eos=True))[0].token_ids
    stop = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                          stop_token_ids=(plain[2],))
    out = llm.generate(prompt, stop)[0]
    assert out.token_ids == plain[: plain.index(plain[2]) + 1]
    assert out.finish_reason == "stop"
    # A bias of -100 rules the greedy token out.
    banned = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                            logit_bias={plain[0]: -100.0})
    assert llm.generate(prompt, banned)[0].token_ids != plain[:1]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt, SamplingParams(stop_token_ids=(10**6,)))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_a_json_schema_holds_the_reply_with_a_byte_tokenizer():
    import json

    llm = LLM("tiny", random_init=True, kv_budget="1MiB", block_tokens=16)
    schema = json.dumps({"type": "object", "required": ["ok"], "additionalProperties": False,
                         "properties": {"ok": {"type": "boolean"}}})
    for seed in range(3):
        out = llm.generate("x", SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                               json_schema=schema))[0]
        assert isinstance(json.loads(out.text)["ok"], bool) and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="json_schema"):
        llm.generate("x", SamplingParams(json_schema="{not json"))


def test_constrained_rows_of_a_batch_decode_as_they_do_alone():
    import json

    llm = LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16)
    flag = {"type": "object", "required": ["ok"], "additionalProperties": False,
            "properties": {"ok": {"type": "boolean"}}}
    tagged = {"type": "object", "required": ["n", "tag"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                             "tag": {"enum": ["red", "green", "blue"]}}}
    prompts = ["x", "def f(", "y = ", "hello", "{", "import "]
    params = [SamplingParams(max_tokens=40, temperature=0, json_schema=json.dumps(flag)),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, json_schema=json.dumps(tagged)),
              SamplingParams(max_tokens=40, temperature=0, json_schema=json.dumps(tagged),
                             logprobs=2, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3,
                             json_schema=json.dumps(flag))]
    batch = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batch, strict=True):
        alone = llm.generate(prompt, p)[0]
        assert out.token_ids == alone.token_ids, prompt
        if p.json_schema is None:
            continue
        reply = json.loads(out.text)
        assert out.finish_reason == "stop"
        if p.json_schema == json.dumps(flag):
            assert set(reply) == {"ok"} and isinstance(reply["ok"], bool)
        else:
            assert set(reply) == {"n", "tag"} and 0 <= reply["n"] <= 999
            assert reply["tag"] in ("red", "green", "blue")


def test_a_batch_masks_its_constrained_rows_with_one_application(monkeypatch):
    import json
    from types import SimpleNamespace

    import xgrammar

    from kvstack.engine.grammar import Grammars
    from kvstack.engine.sampling import sample_batch
    from kvstack.engine.tokenizer import ByteTokenizer

    vocab = ByteTokenizer.vocab_size
    grammars = Grammars(ByteTokenizer(), vocab)
    schemas = [json.dumps({"type": "object", "required": [k], "additionalProperties": False,
                           "properties": {k: {"type": "boolean"}}}) for k in ("a", "b")]
    applied, allocated = [], []
    apply, allocate = xgrammar.apply_token_bitmask_inplace, xgrammar.allocate_token_bitmask
    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace",
                        lambda logits, mask, **kw: applied.append(len(logits)) or apply(
                            logits, mask, **kw))
    monkeypatch.setattr(xgrammar, "allocate_token_bitmask",
                        lambda rows, size: allocated.append(rows) or allocate(rows, size))

    def request(schema: str | None, **settings) -> SimpleNamespace:
        params = SamplingParams(json_schema=schema, **settings)
        return SimpleNamespace(params=params, generator=None, prompt_ids=[1], output_ids=[],
                               end_ids=frozenset(),
                               grammar=grammars.matcher(params) if schema else None)

    requests = [request(schemas[0], temperature=0), request(None, temperature=0),
                request(schemas[1], temperature=0), request(None, temperature=0),
                request(schemas[0], temperature=0, logprobs=1)]
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    for step in range(3):
        samples = sample_batch(logits, requests)
        assert applied == [3] * (step + 1) and allocated == [3]  # one buffer, reused
        assert torch.equal(logits, raw)  # the raw logits untouched
        for i in (1, 3):  # unconstrained rows: their own argmax
            assert samples[i].token == int(raw[i].argmax())
        for i in (0, 2, 4):  # constrained: as masked alone, by the row's own bitmask
            alone, row = allocate(1, vocab), raw[i : i + 1].clone()
            requests[i].grammar.fill(alone, 0)
            apply(row, alone)
            assert samples[i].token == int(row.argmax())
        assert samples[4].logprobs.logprob == pytest.approx(
            float(raw[4].log_softmax(-1)[samples[4].token]))
        for r, s in zip(requests, samples, strict=True):
            if r.grammar is not None:
                r.grammar.accept(s.token)
