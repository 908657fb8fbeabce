"""DSpark's draft-verify step in the engine: greedy outputs equal a run that never drafted,
and a rejected token leaves nothing in the cache."""

import pytest
import torch

from kvstack import native
from kvstack.cache.batch import DecodeBatch
from kvstack.cache.paged import PagedCache
from kvstack.cli import main
from kvstack.config import preset
from kvstack.engine import LLM, EngineConfig, SamplingParams
from kvstack.engine.runner import verify_lengths
from kvstack.engine.sampling import speculative_accept
from kvstack.model import Model
from kvstack.serve.engine_ops import ServeOps
from kvstack.serve.metrics import EngineCollector

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38],
           [2, 7, 1, 8, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74, 71, 35, 26, 62, 49]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ENGINE = dict(random_init=True, seed=0, kv_budget="16MiB", block_tokens=16, threads=1)


def engine(speculative: str = "none", **settings) -> LLM:
    """The test model's engine; with DSpark, drafting every step unless told otherwise
    (the measured schedule's choices follow the machine's timings)."""
    if speculative == "dspark":
        settings.setdefault("speculative_schedule", "always")
    return LLM("tiny-v41-dspark", speculative=speculative, **{**ENGINE, **settings})


def oracle(llm: LLM, replies: dict[int, list[int]]) -> None:
    """Make llm's draft propose the true continuation (replies: each prompt's first token
    -> its prompt and reply, from a run without drafting; other text gets the draft
    layers' own), wrong from a position that
    moves from block to block (sometimes none), all with full confidence: long accepted
    runs, whole blocks and every rejection point."""
    model = llm.runner.model
    k = model.config.dspark_block_size
    calls = iter(range(1 << 20))
    own = model.draft.block

    def draft(_model, window, token, position, sample=None, padding=None):
        block = own(_model, window, token, position, sample, padding)
        positions = torch.as_tensor(position).reshape(-1).expand(token.shape[0])
        for row, (t, p) in enumerate(zip(token.tolist(), (positions + 1).tolist(),
                                         strict=True)):  # p: the position of t
            tokens = next((r for r in replies.values() if len(r) > p and r[p] == t), None)
            if tokens is None:  # a turn it was not told: the draft layers' own block
                continue
            proposed = list(tokens[p + 1 : p + 1 + k])
            proposed += [0] * (k - len(proposed))
            wrong = next(calls) % (k + 2)
            if wrong < k:
                proposed[wrong] = (proposed[wrong] + 1) % model.config.vocab_size
            block.tokens[row, 1:] = torch.tensor(proposed)
            block.confidence[row] = 10.0
        return block

    model.draft.block = draft


def run(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return run(engine(), PROMPTS, GREEDY)


def test_greedy_outputs_equal_a_run_that_never_drafted(plain):
    """The model's own (random) draft layers, and a draft that is right for a while: the
    same tokens, batch 1 and both prompts at once (each engine fresh: a prompt run again
    hits the prefix cache, whose bounded replay moves logits), with drafts accepted and
    rejected."""
    drafting = [engine("dspark") for _ in PROMPTS]
    assert [run(llm, [p], GREEDY)[0] for llm, p in zip(drafting, PROMPTS, strict=True)] == plain
    assert run(engine("dspark"), PROMPTS, GREEDY) == plain
    accepted = sum(llm.runner.accepted_tokens for llm in drafting)
    assert 0 < accepted < sum(llm.runner.drafted_tokens for llm in drafting)

    told = engine("dspark")
    oracle(told, {p[0]: p + reply for p, reply in zip(PROMPTS, plain, strict=True)})
    assert run(told, PROMPTS, GREEDY) == plain
    # Whole blocks go through: far fewer verifies than tokens.
    assert told.runner.verifies < sum(map(len, plain)) / 2


def test_requests_it_does_not_draft_for_decode_as_without_it(plain):
    """A sampled request that asks for log-probabilities (which drafted tokens do not
    report) decodes one token a step beside a drafting one, as without DSpark: the same
    seeded tokens."""
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True,
                             logprobs=0)
    want = run(engine(), PROMPTS, [GREEDY, sampled])
    assert run(engine("dspark"), PROMPTS, [GREEDY, sampled]) == want
    assert want[0] == plain[0]


def test_preemption_and_prefix_hits_keep_the_outputs(plain):
    """A pool too small for both sequences (one is preempted and recomputed) and a prompt
    that hits the prefix cache of the one before."""
    tight = dict(kv_budget=None, max_num_seqs=2)
    config = preset("tiny-v41-dspark")
    probe = PagedCache(config, "16MiB", 16, 2)
    per_block = probe.pools.nbytes // probe.pools.n_blocks
    ring = probe.layout.window_bytes_per_sequence
    tight["kv_budget"] = 2 * ring + 16 * ring + 4 * per_block  # 2 slots, 16 checkpoints
    for speculative in ("none", "dspark"):
        llm = engine(speculative, **tight)
        out = llm.generate(PROMPTS, GREEDY)
        again = llm.generate([PROMPTS[1]], GREEDY)[0]
        if speculative == "none":
            want = [o.token_ids for o in out], again.token_ids
            assert sum(o.metrics["preemptions"] for o in out) > 0
        else:
            assert ([o.token_ids for o in out], again.token_ids) == want
            assert again.num_cached_tokens > 0


def test_a_stop_inside_a_block_leaves_the_store_at_the_reply(plain):
    """The reply ends on a token inside an accepted run: the kept cache holds the reply
    and not the drafts after it, and the next turn equals a run that never drafted."""
    stop = plain[0][5]
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop,))
    replies = {}
    for speculative in ("none", "dspark"):
        llm = engine(speculative)
        if speculative == "dspark":
            oracle(llm, {PROMPTS[0][0]: PROMPTS[0] + plain[0]})
        first = llm.add_request(PROMPTS[0], params, keep_cache=True, watch=True)
        while not (out := llm.wait(first)).finished:
            pass
        store = llm.scheduler.kept[first].store
        assert store.held_ids == PROMPTS[0] + out.token_ids[:-1]
        assert out.token_ids[-1] == stop
        second = llm.add_request([7, 7, 9], GREEDY, continue_from=first, watch=True)
        while not (follow := llm.wait(second)).finished:
            pass
        replies[speculative] = out.token_ids, follow.token_ids
    assert replies["dspark"] == replies["none"]


def test_a_session_saved_and_resumed_between_turns(tmp_path, plain):
    replies = {}
    for speculative in ("none", "dspark"):
        first = engine(speculative, cache_dir=tmp_path / speculative)
        session = first.session("talk")
        session.append(PROMPTS[1])
        one = session.generate(GREEDY).token_ids
        session.save()
        again = engine(speculative, cache_dir=tmp_path / speculative).resume("talk")
        again.append([5, 6, 7])
        replies[speculative] = one, again.generate(GREEDY).token_ids
    assert replies["dspark"] == replies["none"]
    assert replies["none"][0] == plain[1]


def _state(cache: PagedCache, store) -> dict[str, object]:
    """Every byte the store's sequence holds: token log, stream lengths and rows (each
    block's rows up to its length), rings and their positions, partial groups up to their
    fills."""
    pools, slot = cache.pools, store.slot
    state: dict[str, object] = {"tokens": list(store.held_ids), "fill": dict(store._fill),
                                "len": {k: v for k, v in store._len.items()}}
    for (layer, kind), rows in pools.rows.items():
        entries = store.stream_len(layer)
        flat = rows.data[store.block_table].reshape(-1, rows.data.shape[-1])
        state[f"stream {layer} {kind}"] = flat[:entries].clone()
        state[f"beyond {layer} {kind}"] = flat[entries:].clone()
    for layer, ring in cache.rings.rows.items():
        state[f"ring {layer}"] = ring.data[slot].clone()
        state[f"ring positions {layer}"] = cache.rings.pos[layer][slot].clone()
    for source, values in cache.partials.values.items():
        fill = store._fill[source]
        state[f"partial {source}"] = values[slot, :fill].clone()
        state[f"partial gates {source}"] = cache.partials.gates[source][slot, :fill].clone()
    return state


@pytest.mark.parametrize("kept", [0, 1, 2, 4])
@pytest.mark.parametrize("call", ["decode", "extend"])
def test_rejected_tokens_leave_no_byte_behind(kept, call):
    """Two verifies that share their first tokens and differ after, each settled on those
    first tokens: every byte of the two caches is equal, the rows past the kept tokens are
    zeros, and the next tokens' logits are equal. 27 tokens before: the verify straddles
    groups of the ratio-2 layers and a cache block. A verify as the engine makes it (one
    decode step of several rows) and as a prefill (`Model.extend`, where the C kernels
    cannot run the step)."""
    torch.manual_seed(0)
    config = preset("tiny-v41-dspark")
    model = Model(config).eval()
    prompt = (torch.arange(1, 28)[None] * 7) % config.vocab_size
    results = []
    for rejected in ([1, 2], [100, 200]):
        cache = PagedCache(config, "8MiB", 16, 2)
        store = cache.open_sequence()
        store.reserve(64)
        fed = torch.tensor([[5, 9, 4, 8, *rejected]])
        # The C kernels, as the engine runs them: their expert matmuls take each token
        # alone, so the rejected tokens' routes cannot move the kept ones' rounding.
        with native.active(native.resolve("auto")):
            model.prefill(prompt, store)
            store.speculate(fed.shape[1])
            if call == "extend":
                model.extend(fed, store, n_logits=fed.shape[1])
            else:
                model.verify(fed[0].tolist(), DecodeBatch([store], counts=[fed.shape[1]]))
        store.settle(kept)
        state = _state(cache, store)
        assert state["tokens"][27:] == fed[0, :kept].tolist()
        for (layer, kind) in cache.pools.rows:  # what the rejected tokens wrote is gone
            ratio = cache.pools.ratios[layer]
            written = (27 + fed.shape[1]) // ratio - store.stream_len(layer)
            assert not state[f"beyond {layer} {kind}"][:written].any(), (layer, kind)
        with native.active(native.resolve("auto")):
            logits = model.extend(torch.tensor([[11, 12, 13]]), store, n_logits=3).logits
        results.append((state, logits))
    (a, logits_a), (b, logits_b) = results
    for name in a:
        if not name.startswith("beyond"):
            assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])) if \
                isinstance(a[name], torch.Tensor) else a[name] == b[name], name
    assert torch.equal(logits_a, logits_b)


def test_verify_lengths_follow_the_confidence():
    sure, unsure = torch.full((4,), 10.0), torch.full((4,), -10.0)
    # survival 0.73, 0.53, 0.39, 0.29, 0.21, 0.15, 0.11, 0.08 (sigmoid(1) = 0.73 each)
    assert verify_lengths(torch.ones(1, 8), [8]) == [7]
    rows = torch.stack((sure, sure, unsure, torch.tensor([10.0, -10.0, 10.0, 10.0])))
    assert verify_lengths(rows, [4, 2, 4, 4]) == [4, 2, 0, 1]


def test_metrics_count_drafts_and_accepted_tokens():
    llm = engine("dspark")
    first = llm.add_request(PROMPTS[0], GREEDY, keep_cache=True, watch=True)
    while not llm.wait(first).finished:
        pass
    draft = llm.memory_report()["draft"]
    c = llm.config
    assert draft["context_bytes_per_sequence"] == len(c.draft_layers) * c.window_size \
        * c.head_dim * 4
    assert draft["context_bytes_held"] == 0  # a finished request drafts no more
    assert draft["verifies"] == llm.runner.verifies
    collector = EngineCollector("m")
    collector.stats = ServeOps(llm).stats()  # what a scrape reads from the engine
    families = {m.name: m.samples[0].value for m in collector.collect()}
    runner = llm.runner
    assert families["kvstack:spec_decode_num_drafts"] == runner.verifies > 0
    assert families["kvstack:spec_decode_num_draft_tokens"] == runner.drafted_tokens
    assert families["kvstack:spec_decode_num_accepted_tokens"] == runner.accepted_tokens
    assert families["kvstack:spec_decode_mean_acceptance_length"] == pytest.approx(
        (runner.accepted_tokens + runner.verifies) / runner.verifies)


def test_dspark_on_a_model_without_draft_layers_is_refused():
    with pytest.raises(ValueError, match="no DSpark draft layers"):
        LLM("tiny-v41", random_init=True, speculative="dspark", kv_budget="16MiB")
    with pytest.raises(ValueError, match="speculative must be one of none, dspark"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="draft on a model split over ranks"):
        EngineConfig(speculative="dspark", tensor_parallel_size=2)


def test_a_verify_feeds_at_most_speculative_tokens_and_more_than_the_block_is_refused(
        plain, capsys):
    block = preset("tiny-v41-dspark").dspark_block_size
    with pytest.raises(ValueError, match=f"proposes blocks of {block} .*trained for"):
        engine("dspark", speculative_tokens=block + 1)
    with pytest.raises(ValueError, match="set it with speculative='dspark'"):
        EngineConfig(speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_tokens must be a positive integer"):
        EngineConfig(speculative="dspark", speculative_tokens=0)
    told = engine("dspark", speculative_tokens=1)
    oracle(told, {p[0]: p + reply for p, reply in zip(PROMPTS, plain, strict=True)})
    assert run(told, PROMPTS, GREEDY) == plain
    lengths = told.runner.verify_lengths
    assert lengths[1] > 0 and all(n <= 1 for n, count in lengths.items() if count)
    assert main(["generate", "--model", "tiny-v41", "--random-init", "--speculative-tokens",
                 "2", "--prompt", "hi"]) == 2
    assert "set it with speculative='dspark'" in capsys.readouterr().err


def test_speculative_sampling_draws_from_the_targets_distribution():
    """Drafts drawn from a draft distribution that is not the target's, the rule applied:
    each output position follows the target's distribution (20,000 draws, a tiny
    vocabulary); keeping every draft, or drawing a refused one's replacement from the
    target itself, would follow another."""
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4],
                           [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, 4)
    trials, seen_second = 8_000, 0
    for _ in range(trials):
        drafts = [int(torch.multinomial(row, 1, generator=g)) for row in draft]
        kept, token = speculative_accept(target, draft, drafts, g)
        outputs = [*drafts[:kept], token]
        counts[0, outputs[0]] += 1
        if len(outputs) > 1:
            counts[1, outputs[1]] += 1
            seen_second += 1
    assert (counts[0] / trials - target[0]).abs().max() < 0.025
    # The second output exists when the first draft was kept; given that, it follows
    # the target's second distribution too.
    assert (counts[1] / seen_second - target[1]).abs().max() < 0.045


def test_sampled_requests_draft_and_keep_the_targets_distribution():
    """Through the engine: seeded sampled requests (top-k 2, so a few outcomes) with and
    without DSpark give the same distribution of their third token, the second drawn by
    a verify."""
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=i,
                             ignore_eos=True) for i in range(96)]
    third = {}
    for speculative in ("none", "dspark"):
        llm = engine(speculative, enable_prefix_caching=False, max_num_seqs=16)
        outs = llm.generate([PROMPTS[0]] * len(params), params)
        third[speculative] = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]),
                                            minlength=512).float() / len(params)
        if speculative == "dspark":
            assert llm.runner.verifies > 0
    assert (third["none"] - third["dspark"]).abs().sum() / 2 < 0.2


def test_a_verify_step_equals_steps_of_one_token():
    """A decode batch with several consecutive tokens of each sequence (a verify: 4 rows
    of one, 3 of another) against the same tokens decoded one step at a time: the same
    stream and index-key rows, rings and token logs, byte for byte, and the same logits
    and partial groups within float rounding (the batched matmuls round alike only at
    equal row counts)."""
    torch.manual_seed(0)
    config = preset("tiny-v41-dspark")
    model = Model(config).eval()
    prompts = [(torch.arange(1, 28)[None] * 7) % 512, (torch.arange(1, 20)[None] * 5) % 512]
    tokens = [[5, 9, 4, 8], [11, 3, 7]]

    def started() -> tuple[PagedCache, list]:
        cache = PagedCache(config, "8MiB", 16, 2)
        stores = []
        for prompt in prompts:
            store = cache.open_sequence()
            store.reserve(64)
            model.prefill(prompt, store)
            stores.append(store)
        return cache, stores

    with native.active(native.resolve("c")):
        stepped, stores = started()
        logits: list[list[torch.Tensor]] = [[], []]
        for j in range(4):
            live = [i for i in range(2) if j < len(tokens[i])]
            out = model.decode([tokens[i][j] for i in live],
                               DecodeBatch([stores[i] for i in live]))
            for row, i in enumerate(live):
                logits[i].append(out[row])
        verified, rows = started()
        out = model.verify(tokens[0] + tokens[1], DecodeBatch(rows, counts=[4, 3]))
    torch.testing.assert_close(out.logits[:, 0], torch.stack(logits[0] + logits[1]),
                               rtol=0, atol=1e-5)
    assert out.target_hidden.shape == (7, 1, 3 * config.dim)
    for store, row_store in zip(stores, rows, strict=True):
        a, b = _state(stepped, store), _state(verified, row_store)
        for name in a:
            if name.startswith("partial"):
                torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)
            elif not name.startswith("beyond"):
                assert (torch.equal(a[name], b[name]) if isinstance(a[name], torch.Tensor)
                        else a[name] == b[name]), name


def test_several_tokens_of_a_sequence_need_the_c_kernels():
    config = preset("tiny-v41-dspark")
    cache = PagedCache(config, "8MiB", 16, 2)
    store = cache.open_sequence()
    store.reserve(16)
    Model(config).eval().prefill(torch.tensor([[1, 2, 3]]), store)
    with native.active(False), pytest.raises(ValueError, match="runs the C kernels"):
        DecodeBatch([store], counts=[2])
    with native.active(native.resolve("c")):
        with pytest.raises(ValueError, match="one positive count per sequence"):
            DecodeBatch([store], counts=[0])
        batch = DecodeBatch([store], counts=[2])
        with pytest.raises(ValueError, match="ring read by torch takes one row a sequence"):
            batch.window(0)


def test_a_draft_for_a_model_of_one_residual_copy_and_a_dense_ffn():
    """The bundled model's shape (no hyper-connections, no MoE: the draft stage is a plain
    pre-norm residual with a dense feed-forward) with a random draft: the same greedy
    tokens with DSpark, drafts verified and some kept."""
    config = preset("default").replace(
        compress_ratios=[*preset("default").compress_ratios, 0], n_mtp_layers=1,
        dspark_block_size=4, dspark_noise_token_id=2, dspark_target_layer_ids=[5, 6, 7],
        dspark_markov_rank=16, max_seq_len=1024)
    prompts = [[(7 * i) % 2000 + 3 for i in range(40)], [(5 * i) % 1999 + 3 for i in range(70)]]
    outs = {}
    for speculative in ("none", "dspark"):
        drafts = dict(speculative_schedule="always") if speculative == "dspark" else {}
        llm = LLM(config, random_init=True, seed=0, kv_budget="32MiB", threads=1,
                  speculative=speculative, **drafts)
        outs[speculative] = run(llm, prompts, GREEDY)
    assert outs["dspark"] == outs["none"]
    assert llm.runner.verifies > 0 and llm.runner.drafted_tokens > 0


def test_a_sequences_draft_context_holds_the_entries_of_the_last_window_it_holds():
    """The entries a draft reads (made after the prefill, then from the states each step
    keeps, `Draft.window` over the states handed over) are those of the last window of
    positions its store holds, in order, whether the steps drafted or not: entries
    labelled with their position here, the schedule drafting every third step."""
    llm = engine("dspark")
    steps = iter(range(1 << 20))
    llm.runner.pace.drafting = lambda seqs: [next(steps) % 3 == 0 for _ in seqs]
    model, c = llm.runner.model, llm.config
    stages = len(c.draft_layers)

    def labelled(target_hidden: torch.Tensor, position) -> torch.Tensor:
        b, n, _ = target_hidden.shape
        at = torch.as_tensor(position).reshape(-1, 1) - n + 1 + torch.arange(n)  # [P, n]
        return at.float().expand(b, n)[None, ..., None].expand(stages, b, n, c.head_dim)

    model.draft.window = labelled
    request = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=3 * c.window_size,
                                                         temperature=0, ignore_eos=True))
    seq = llm.core.requests[request]
    checked = 0
    while request in llm.core.requests:
        llm.step()
        if seq.status.name == "FINISHED":
            continue
        llm.runner.make_draft_contexts([seq])  # what its next draft reads
        held = seq.store.num_tokens
        w = min(c.window_size, held)
        want = torch.arange(held - w, held).float()[None, :, None].expand(stages, w,
                                                                           c.head_dim)
        assert torch.equal(seq.draft_context, want)
        checked += 1
    assert checked > c.window_size // 2 and 0 < llm.runner.verifies < checked  # both kinds
