"""The prefix cache: hash chain over full blocks, reuse with window replay, eviction."""

import torch

from kvstack import LLM, SamplingParams
from kvstack.cache.paged import block_bytes
from kvstack.cache.prefix import block_hashes, chain_seed
from kvstack.config import preset
from kvstack.engine.config import EngineConfig
from kvstack.engine.sequence import Sequence
from kvstack.model import Model

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# Window-ring slots a tiny_llm's budget holds: one per sequence, one per window checkpoint.
RINGS = 8 + EngineConfig().window_checkpoints


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def tiny_llm(**kwargs) -> LLM:
    kwargs = {"kv_budget": "2MiB", "replay": "exact", "block_tokens": 8} | kwargs
    return LLM(kwargs.pop("model", "tiny"), random_init=True, **kwargs)


def test_the_chain_names_a_block_by_every_token_before_it_and_the_seed():
    seed = chain_seed("model-a", 4)
    ids = tokens(18)
    hashes = block_hashes(seed, ids, 4)
    assert len(hashes) == 4  # the partial fifth block is not named
    changed = [*ids[:9], ids[9] + 1, *ids[10:]]  # a token of block 2
    other = block_hashes(seed, changed, 4)
    assert other[:2] == hashes[:2] and all(a != b for a, b in zip(other[2:], hashes[2:],
                                                                  strict=True))
    assert not set(block_hashes(chain_seed("model-b", 4), ids, 4)) & set(hashes)
    assert chain_seed("model-a", 8) != seed
    assert block_hashes(seed, ids, 4, known=hashes[:2]) == hashes


def test_the_fingerprint_covers_weights_and_cache_formats():
    torch.manual_seed(0)
    model = Model(preset("tiny"))
    before = model.fingerprint()
    assert model.fingerprint() == before
    with torch.no_grad():
        model.embed.weight[0, 0] += 1
    assert model.fingerprint() != before
    torch.manual_seed(0)
    bf16 = Model(preset("tiny").replace(kv_format="bf16"))
    assert bf16.fingerprint() != before


def test_an_exact_hit_continues_as_the_cold_run():
    prompt = tokens(45)
    llm = tiny_llm()
    cold = llm.generate(prompt, GREEDY)[0]
    assert cold.num_cached_tokens == 0
    hit = llm.generate(prompt, GREEDY)[0]
    assert hit.num_cached_tokens == 40  # five full blocks; the last token is computed
    assert hit.token_ids == cold.token_ids

    shared = prompt[:24] + tokens(20, seed=1)  # three blocks in common
    out = llm.generate(shared, GREEDY)[0]
    assert out.num_cached_tokens == 24
    alone = tiny_llm(enable_prefix_caching=False).generate(shared, GREEDY)[0]
    assert out.token_ids == alone.token_ids

    report = llm.memory_report()["prefix_cache"]
    assert report["enabled"] and report["hit_tokens"] == 64
    assert report["queried_tokens"] == 44 + 44 + 43
    assert abs(report["hit_rate"] - 64 / 131) < 1e-12


def prefill_logits(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """The engine's own path for one prompt: admission with the prefix cache, replay,
    prefill; then the store is released (its full blocks stay cached)."""
    seq = Sequence("probe", prompt, GREEDY)
    seq.store = llm.cache.open_sequence()
    cached = llm.cache.attach_prefix(seq.store, prompt)
    assert seq.store.reserve(len(prompt))
    logits = llm.runner.prefill_logits(seq)[0].double()
    llm.cache.register_full_blocks(seq.store)
    llm.cache.close_sequence(seq.store)
    return logits, cached


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = p_logits.log_softmax(-1)
    return float((p.exp() * (p - q_logits.log_softmax(-1))).sum())


def test_a_bounded_hit_is_exact_for_a_prompt_shorter_than_the_window():
    llm = tiny_llm(replay="bounded", block_tokens=4)
    w = llm.config.window_size
    for n, within in ((w - 1, True), (5 * w + 1, False)):
        prompt = tokens(n, seed=n)
        cold, cached = prefill_logits(llm, prompt)
        hit, cached_again = prefill_logits(llm, prompt)
        assert cached == 0 and cached_again == (n - 1) // 4 * 4 > 0
        divergence = kl(cold, hit)
        if within:  # the cold prefill and the replay both see every token
            assert divergence < 1e-9, divergence
        else:
            assert divergence > 1e-9, divergence


def test_shared_blocks_are_counted_and_evicted_blocks_are_recomputed():
    prompt = tokens(40)
    llm = tiny_llm()
    llm.generate(prompt, GREEDY)
    manager = llm.cache.manager
    assert manager.num_free == manager.n_blocks  # cached blocks are free to hand out
    cached_blocks = set(manager.cached.values())
    assert len(cached_blocks) == 6  # 49 tokens held: six full blocks

    ids = [llm.add_request(prompt + tokens(3, seed=s), GREEDY) for s in (1, 2)]
    llm.step()  # both prefilled on the same cached blocks
    shared = [b for b in cached_blocks if manager.ref_counts[b] == 2]
    assert len(shared) == 5
    while llm.has_unfinished_requests():
        llm.step()
    assert manager.num_free == manager.n_blocks and ids

    # A small pool: other prompts take every block, the cached ones included.
    layout = llm.cache.layout
    budget = layout.window_bytes_per_sequence * RINGS + 13 * block_bytes(layout, 8)
    tight = tiny_llm(kv_budget=budget)
    assert tight.cache.pools.capacity_tokens == 104
    cold = tight.generate(prompt, GREEDY)[0]
    for s in range(3, 6):
        tight.generate(tokens(tight.cache.pools.capacity_tokens - 12, seed=s), GREEDY)
    again = tight.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens < 40
    assert again.token_ids == cold.token_ids


def test_blocks_evicted_to_the_host_tier_come_back_with_the_same_output():
    prompt = tokens(40)
    layout = tiny_llm().cache.layout
    budget = layout.window_bytes_per_sequence * RINGS + 13 * block_bytes(layout, 8)
    tiered = tiny_llm(kv_budget=budget, host_budget="1MiB")
    cold = tiered.generate(prompt, GREEDY)[0]
    for s in range(3, 6):  # every device block handed out again: the cached ones go down
        tiered.generate(tokens(tiered.cache.pools.capacity_tokens - 12, seed=s), GREEDY)
    report = tiered.memory_report()
    assert report["host_tier"]["blocks"] > 0 and report["host_tier"]["bytes"] > 0
    again = tiered.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens == 32  # four blocks (the last token is computed), from the host
    assert again.token_ids == cold.token_ids
    assert tiered.memory_report()["prefix_cache"]["host_hit_tokens"] == 32


def test_the_host_tier_keeps_the_newest_blocks_within_its_budget():
    layout = tiny_llm().cache.layout
    per_block = block_bytes(layout, 8)
    budget = layout.window_bytes_per_sequence * RINGS + 13 * per_block
    tiered = tiny_llm(kv_budget=budget, host_budget=3 * per_block)
    for s in range(3, 7):
        tiered.generate(tokens(tiered.cache.pools.capacity_tokens - 12, seed=s), GREEDY)
    host = tiered.memory_report()["host_tier"]
    assert host["blocks"] == 3 and host["bytes"] == 3 * per_block
    assert host["blocks_dropped"] > 0


def test_blocks_go_down_to_disk_and_come_back_here_or_in_a_new_engine(tmp_path):
    prompt = tokens(40)
    layout = tiny_llm().cache.layout
    per_block = block_bytes(layout, 8)
    tiers = dict(kv_budget=layout.window_bytes_per_sequence * RINGS + 13 * per_block,
                 host_budget=2 * per_block, disk_prefix_cache=True, cache_dir=tmp_path)
    tiered = tiny_llm(**tiers)
    cold = tiered.generate(prompt, GREEDY)[0]
    for s in range(3, 6):
        tiered.generate(tokens(tiered.cache.pools.capacity_tokens - 12, seed=s), GREEDY)
    assert tiered.memory_report()["disk_tier"]["prefix_bytes"] > 0
    again = tiered.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == cold.token_ids
    hits = tiered.memory_report()["prefix_cache"]
    assert hits["disk_hit_tokens"] > 0 and hits["host_hit_tokens"] + hits[
        "disk_hit_tokens"] == 32

    restarted = tiny_llm(**tiers)  # the disk tier outlives the engine
    later = restarted.generate(prompt, GREEDY)[0]
    assert later.num_cached_tokens == 32 and later.token_ids == cold.token_ids
    other_model = tiny_llm(seed=1, **tiers)  # another fingerprint: another chain
    assert other_model.generate(prompt, GREEDY)[0].num_cached_tokens == 0


def test_the_dense_control_reuses_blocks_without_replay():
    prompt = tokens(30)
    llm = tiny_llm(model="dense-tiny")
    cold = llm.generate(prompt, GREEDY)[0]
    hit = llm.generate(prompt, GREEDY)[0]
    assert hit.num_cached_tokens == 24 and hit.token_ids == cold.token_ids


def test_prefix_caching_can_be_turned_off():
    llm = tiny_llm(enable_prefix_caching=False)
    prompt = tokens(30)
    llm.generate(prompt, GREEDY)
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0
    assert not llm.memory_report()["prefix_cache"]["enabled"]


def test_the_disk_prefix_cache_serves_a_second_run_of_the_command(tmp_path, capsys):
    import json

    from kvstack.cli import main

    run = ["generate", "--model", "tiny", "--random-init", "--kv-budget", "2MiB",
           "--disk-prefix-cache", "--cache-dir", str(tmp_path), "--max-tokens", "4",
           "--temperature", "0", "--json", "--prompt", "def main():\n    return 42\n" * 6]
    assert main(run) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["num_cached_tokens"] == 0
    assert main(run) == 0  # a new process would see the same: the blocks were written through
    second = json.loads(capsys.readouterr().out)
    assert second["num_cached_tokens"] >= 64 and second["token_ids"] == first["token_ids"]
    assert second["memory"]["prefix_cache"]["disk_hit_tokens"] >= 64


def hit_and_keep(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, dict, int]:
    """A prefix hit through the engine's own path: its logits, its slot's window state
    after the prefill, and the tokens it replayed."""
    store = llm.cache.open_sequence()
    cached = llm.cache.attach_prefix(store, prompt)
    assert cached > 0 and store.reserve(len(prompt))
    replayed = llm.runner.replayed_tokens
    logits = llm.runner.prefill_store(store, prompt[cached:])
    state = {"rings": llm.cache.rings.copy_slot(store.slot),
             "partials": llm.cache.partials.copy_slot(store.slot)}
    llm.cache.close_sequence(store)
    return logits, state, llm.runner.replayed_tokens - replayed


def same_state(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for kind in a for key in a[kind]
               for x, y in zip(a[kind][key], b[kind][key], strict=True))


def test_a_second_hit_copies_the_window_state_the_first_hits_replay_built():
    llm = tiny_llm(replay="bounded")
    prompt = tokens(6 * llm.config.window_size + 5)
    llm.generate(prompt, GREEDY)  # names the prompt's blocks
    replayed_logits, replayed_state, replayed = hit_and_keep(llm, prompt)
    copied_logits, copied_state, none = hit_and_keep(llm, prompt)
    assert replayed > 0 and none == 0
    # Bit for bit what the replay built, rings and partial groups alike.
    assert torch.equal(copied_logits, replayed_logits)
    assert same_state(copied_state, replayed_state)
    report = llm.memory_report()["window_checkpoints"]
    assert report["saved"] == 1 and report["restored"] == 1 and report["held"] == 1
    assert report["bytes"] == (llm.cache.layout.window_bytes_per_sequence
                               + llm.cache.layout.partial_bytes_per_sequence
                               + 8 * len(llm.cache.rings.pos) * llm.config.window_size)

    without = tiny_llm(replay="bounded", window_checkpoints=0)
    without.generate(prompt, GREEDY)
    for _ in range(2):
        logits, state, replays = hit_and_keep(without, prompt)
        assert replays == replayed and torch.equal(logits, replayed_logits)
        assert same_state(state, replayed_state)


def test_a_hit_on_rewritten_blocks_replays_and_outputs_stay_the_cold_runs():
    prompt = tokens(40)
    layout = tiny_llm().cache.layout
    checkpoints = 2
    budget = layout.window_bytes_per_sequence * (8 + checkpoints) + 13 * block_bytes(layout, 8)
    tight = tiny_llm(kv_budget=budget, window_checkpoints=checkpoints)
    assert tight.cache.pools.capacity_tokens == 104  # the checkpoints' rings are in the budget
    cold = tight.generate(prompt, GREEDY)[0]
    assert tight.generate(prompt, GREEDY)[0].token_ids == cold.token_ids  # replays, kept
    assert tight.generate(prompt, GREEDY)[0].token_ids == cold.token_ids  # copies
    kept = tight.memory_report()["window_checkpoints"]
    assert (kept["saved"], kept["restored"]) == (1, 1)
    for s in range(3, 6):  # every block handed out again: the checkpoint names none now
        tight.generate(tokens(tight.cache.pools.capacity_tokens - 12, seed=s), GREEDY)
    tight.generate(prompt, GREEDY)  # recomputes its blocks
    again = tight.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == cold.token_ids
    report = tight.memory_report()["window_checkpoints"]
    assert report["restored"] == 1 and report["held"] <= checkpoints


def test_window_checkpoints_are_validated():
    import pytest

    with pytest.raises(ValueError, match="window_checkpoints"):
        tiny_llm(window_checkpoints=-1)
