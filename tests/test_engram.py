"""Engram: primes, multipliers, token map, n-gram hash and gate, against hand computations."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from kvstack.model.engram import (
    Engram,
    EngramHash,
    build_token_map,
    engram_primes,
    hash_multipliers,
    is_prime,
    next_prime,
)

BUNDLED_TOKENIZER = Path(__file__).parent.parent / "kvstack" / "data" / "default" / "tokenizer.json"
MAX_LONG = 2**63 - 1


def trial_division_prime(n: int) -> bool:
    """Independent primality check for the test (slow, obviously right)."""
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def rule_primes(vocab_size, n_layers, max_ngram, n_heads):
    """The prime rule written again with trial division, for small cases."""
    taken, out = set(), []
    for _ in range(n_layers):
        layer = []
        for _ in range(max_ngram - 1):
            c, heads = vocab_size - 1, []
            for _ in range(n_heads):
                c += 1
                while c in taken or not trial_division_prime(c):
                    c += 1
                taken.add(c)
                heads.append(c)
            layer.append(tuple(heads))
        out.append(tuple(layer))
    return tuple(out)


# ---- primes --------------------------------------------------------------------------------


def test_primes_match_published_num_embeddings():
    primes = engram_primes(16_000_000, 2, 4, 8)
    assert len(primes) == 2 and all(len(layer) == 3 for layer in primes)
    assert all(len(per) == 8 for layer in primes for per in layer)
    sums = [sum(p for per in layer for p in per) for layer in primes]
    assert sums == [384006168, 384016682]  # the released engram_num_embeddings
    flat = [p for layer in primes for per in layer for p in per]
    assert len(set(flat)) == len(flat) == 48
    assert all(p >= 16_000_000 and trial_division_prime(p) for p in flat)
    # each (layer, n-gram size) restarts at the vocab size, so its primes rise
    assert all(list(per) == sorted(per) for layer in primes for per in layer)


def test_primes_small_hand_case():
    # vocab 10: primes above 9 are 11, 13, 17, 19, 23, 29, 31, 37, ...
    # layer 0, 2-gram: 11, 13; 3-gram restarts at 9, skips 11 and 13: 17, 19
    # layer 1, 2-gram restarts at 9, skips 11..19: 23, 29; 3-gram: 31, 37
    expected = (((11, 13), (17, 19)), ((23, 29), (31, 37)))
    assert engram_primes(10, 2, 3, 2) == expected
    assert rule_primes(10, 2, 3, 2) == expected
    assert engram_primes(11, 1, 2, 1) == (((11,),),)  # a prime vocab size is its own first bucket
    assert engram_primes(100, 3, 4, 3) == rule_primes(100, 3, 4, 3)


def test_next_prime():
    assert next_prime(10, set()) == 11
    assert next_prime(11, set()) == 13
    assert next_prime(10, {11, 13}) == 17
    assert next_prime(0, set()) == 2
    assert next_prime(2**61 - 2, set()) == 2**61 - 1


def test_is_prime_exact():
    limit = 20_000
    sieve = [True] * limit
    sieve[0] = sieve[1] = False
    for i in range(2, int(limit**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = [False] * len(sieve[i * i :: i])
    assert [is_prime(n) for n in range(limit)] == sieve

    carmichael = [561, 1105, 1729, 2465, 2821, 6601, 8911, 41041, 825265, 321197185]
    strong_pseudoprimes = [2047, 1373653, 25326001, 3215031751, 2152302898747,
                           3474749660383, 341550071728321, 3825123056546413051]
    for n in carmichael + strong_pseudoprimes:
        assert not is_prime(n), n
    known_primes = [2, 3, 1_000_000_007, 998_244_353, 2**31 - 1, 2**61 - 1, 2**62 - 57,
                    2**63 - 25, 2**64 - 59]
    for n in known_primes:
        assert is_prime(n), n
    assert not is_prime(2**61 + 1)  # 3 * 768614336404564651
    assert not is_prime((2**31 - 1) * (2**30 + 3))  # ~2^61, two odd factors
    assert not is_prime(1_000_000_007 * 998_244_353)
    for n in range(2**64 - 58, 2**64):  # 2^64 - 59 is the largest prime below 2^64
        assert not is_prime(n), n
    with pytest.raises(ValueError, match="beyond the range"):
        is_prime(318_665_857_834_031_151_167_461)  # a strong pseudoprime to bases 2..37


# ---- multipliers ---------------------------------------------------------------------------


def test_multipliers_match_numpy_rule():
    layer_ids, n, v = (1, 14), 4, 99092
    m = hash_multipliers(layer_ids, n, v)
    assert m.dtype == torch.int64 and m.shape == (2, 4)
    bound = (MAX_LONG // v) // 2
    for row, layer_id in zip(m.tolist(), layer_ids, strict=True):
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(n,),
                                                                 dtype=np.int64)
        assert row == (draws * 2 + 1).tolist()
        for x in row:
            assert x % 2 == 1 and 0 < x < 2 * bound
            assert x * (v - 1) <= MAX_LONG  # the largest compressed id cannot overflow
    assert not torch.equal(m[0], m[1])  # layers hash differently
    # a tiny compressed vocabulary still gives bounded, odd multipliers
    small = hash_multipliers((3,), 2, 5)
    assert (small % 2 == 1).all() and int(small.max()) * 4 <= MAX_LONG


# ---- token map -----------------------------------------------------------------------------


def small_tokenizer() -> Tokenizer:
    tokens = ["<unk>", "The", "é", "e", " the", "THE", "the", "<0xC3>", "<0xA9>", " ", "\t",
              "ﬁ", "fi", "A\t\tB", "a b", "É"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.decoder = decoders.ByteFallback()  # "<0xC3>" alone decodes to U+FFFD
    tok.add_special_tokens(["<pad>"])  # id 16
    return tok


def test_token_map_small_tokenizer():
    token_map, size = build_token_map(small_tokenizer())
    assert token_map.dtype == torch.int64 and token_map.shape == (17,)
    expected = [
        0,  # <unk>
        1,  # The -> "the", first seen here
        2,  # é -> "e" (NFD, accents stripped)
        2,  # e
        1,  # " the" (stripped)
        1,  # THE
        1,  # the
        3,  # <0xC3>: decodes to U+FFFD, keyed by its raw token
        4,  # <0xA9>: another raw token, another id
        5,  # " ": kept as one space (not the empty string)
        5,  # "\t": whitespace run -> one space
        6,  # ﬁ -> "fi" (NFKC)
        6,  # fi
        7,  # "A\t\tB" -> "a b"
        7,  # "a b"
        2,  # É -> "e"
        8,  # <pad>: special tokens are decoded, not skipped
    ]
    assert token_map.tolist() == expected
    assert size == 9 == int(token_map.max()) + 1


def test_token_map_bundled_tokenizer():
    tok = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    token_map, size = build_token_map(tok)
    assert token_map.numel() == tok.get_vocab_size(with_added_tokens=True)
    assert int(token_map.min()) == 0 and int(token_map.max()) + 1 == size
    assert size <= token_map.numel()
    # first-seen numbering: the first occurrence of each compressed id comes in order
    firsts = [token_map.tolist().index(i) for i in range(size)]
    assert firsts == sorted(firsts)


# ---- the hash ------------------------------------------------------------------------------

# A tiny layout: 2 engram layers, 2- and 3-grams, 2 heads; 6 compressed ids over 9 raw ids.
LAYER_IDS = (1, 2)
VOCAB = 10
MAX_NGRAM = 3
HEADS = 2
TOKEN_MAP = [0, 1, 2, 3, 1, 4, 5, 2, 0]
COMPRESSED = 6
PAD_ID = 5  # raw pad id; its compressed id is 4
PRIMES = (((11, 13), (17, 19)), ((23, 29), (31, 37)))  # from the hand case above
NUM_EMB = (60, 120)  # the per-layer sums of PRIMES: the smallest valid tables


def tiny_hash(**over) -> EngramHash:
    kw = dict(layer_ids=LAYER_IDS, num_embeddings=NUM_EMB, vocab_size=VOCAB,
              max_ngram_size=MAX_NGRAM, n_heads=HEADS, compressed_vocab_size=COMPRESSED,
              pad_id=PAD_ID, token_map=torch.tensor(TOKEN_MAP, device="cpu"))
    kw.update(over)
    return EngramHash(**kw)


def expected_rows(seq: list[int], pos: int, layer: int) -> list[int]:
    """Rows of the token at `pos` of the raw sequence `seq`, by the rule in plain ints."""
    mult = [int(np.random.default_rng(10007 * LAYER_IDS[layer]).integers(
        0, (MAX_LONG // COMPRESSED) // 2, size=(MAX_NGRAM,), dtype=np.int64)[s]) * 2 + 1
        for s in range(MAX_NGRAM)]
    pad = TOKEN_MAP[PAD_ID]

    def comp(q: int) -> int:
        return TOKEN_MAP[seq[q]] if q >= 0 else pad

    rows, offset = [], 0
    for g in range(2, MAX_NGRAM + 1):
        h = 0
        for s in range(g):
            h ^= comp(pos - s) * mult[s]
        for j in range(HEADS):
            p = PRIMES[layer][g - 2][j]
            rows.append(h % p + offset)
            offset += p
    return rows


def test_hash_buffers_and_layout():
    eh = tiny_hash()
    assert eh.n_columns == 4 and eh.pad_compressed == 4
    assert eh.primes.tolist() == [list(map(list, layer)) for layer in PRIMES]
    assert eh.offsets.tolist() == [[0, 11, 24, 41], [0, 23, 52, 83]]
    assert eh.multipliers.tolist() == hash_multipliers(LAYER_IDS, MAX_NGRAM, COMPRESSED).tolist()
    assert eh.state_dict() == {}  # everything is derived: nothing goes into a checkpoint
    assert {name for name, _ in eh.named_buffers()} == {
        "primes", "offsets", "multipliers", "token_map"}


def test_hash_hand_values_from_sequence_start():
    eh = tiny_hash()
    seq = [3, 7, 0, 8, 1, 6]
    out = eh(torch.tensor([seq]), torch.full((1, 2), 123456), 0)  # history is ignored at 0
    assert out.shape == (1, 6, 2, 4) and out.dtype == torch.int64
    for pos in range(len(seq)):
        for layer in range(2):
            assert out[0, pos, layer].tolist() == expected_rows(seq, pos, layer), (pos, layer)
    # every row lies in its own bucket range of the layer's table
    for layer in range(2):
        flat = [p for per in PRIMES[layer] for p in per]
        lo = torch.tensor([sum(flat[:c]) for c in range(4)])
        hi = lo + torch.tensor(flat)
        assert ((out[0, :, layer] >= lo) & (out[0, :, layer] < hi)).all()


def test_hash_first_positions_pad():
    eh = tiny_hash()
    seq = [PAD_ID, PAD_ID, 4]
    # position 0's 2-gram is (pad, token 0): with token 0 = the pad token it equals the
    # hash of two pad tokens, as at position 1
    out = eh(torch.tensor([seq]), torch.zeros(1, 2, dtype=torch.int64), 0)
    assert out[0, 0].tolist() == out[0, 1].tolist()
    assert out[0, 0, 0].tolist() == expected_rows([PAD_ID], 0, 0)


def test_hash_mid_sequence_with_history():
    eh = tiny_hash()
    seq = [2, 6, 3, 0, 8, 5, 1]
    start = 4
    out = eh(torch.tensor([seq[start:]]), torch.tensor([seq[start - 2 : start]]), start)
    for t, pos in enumerate(range(start, len(seq))):
        for layer in range(2):
            assert out[0, t, layer].tolist() == expected_rows(seq, pos, layer)
    # start 1: the history slot at position -1 is ignored (any value, even out of the map)
    out1 = eh(torch.tensor([seq[1:4]]), torch.tensor([[-77, seq[0]]]), 1)
    for t, pos in enumerate(range(1, 4)):
        assert out1[0, t, 1].tolist() == expected_rows(seq, pos, 1)


def test_hash_per_sequence_starts_match_single_runs():
    eh = tiny_hash()
    ids = torch.tensor([[1, 2, 3, 4], [8, 0, 5, 5], [7, 7, 6, 2]])
    history = torch.tensor([[999, -1], [3, 4], [0, 6]])
    starts = torch.tensor([0, 5, 1])
    out = eh(ids, history, starts)
    for b in range(3):
        alone = eh(ids[b : b + 1], history[b : b + 1], int(starts[b]))
        assert torch.equal(out[b : b + 1], alone)
    # a sequence at start 0 differs from the same ids mid-sequence (padding vs history)
    assert not torch.equal(out[0], eh(ids[:1], torch.tensor([[3, 4]]), 2)[0])


def test_hash_chunks_match_one_pass():
    eh = tiny_hash()
    seq = [4, 1, 1, 0, 8, 3, 2, 7, 6, 5, 0]
    whole = eh(torch.tensor([seq]), torch.zeros(1, 2, dtype=torch.int64), 0)
    parts, cut = [], [0, 1, 3, 4, 8, len(seq)]
    for a, b in itertools.pairwise(cut):
        hist = [seq[q] if q >= 0 else 10**9 for q in range(a - 2, a)]  # garbage before 0
        parts.append(eh(torch.tensor([seq[a:b]]), torch.tensor([hist]), a))
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_hash_rejects_ids_outside_map():
    eh = tiny_hash()
    with pytest.raises(ValueError, match=r"token id 9 is outside the token map.*9 tokens"):
        eh(torch.tensor([[1, 9]]), torch.zeros(1, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="token id -3"):
        eh(torch.tensor([[-3, 1]]), torch.zeros(1, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="token id 42"):  # a live history slot is checked
        eh(torch.tensor([[1]]), torch.tensor([[0, 42]]), 5)


def test_hash_validation_messages():
    with pytest.raises(ValueError, match=r"7 compressed ids but compressed_vocab_size is 8.*"
                                         r"multiplier"):
        tiny_hash(token_map=torch.tensor([0, 1, 2, 3, 4, 5, 6]), compressed_vocab_size=8)
    with pytest.raises(ValueError, match=r"outside 0\.\.5"):
        tiny_hash(token_map=torch.tensor([0, 1, 6]))
    with pytest.raises(ValueError, match=r"engram layer 2: num_embeddings 119 is below 120"):
        tiny_hash(num_embeddings=(60, 119))
    with pytest.raises(ValueError, match=r"engram layer 1: num_embeddings 10 is below 60"):
        tiny_hash(num_embeddings=(10, 120))
    with pytest.raises(ValueError, match="pad_id 9"):
        tiny_hash(pad_id=9)
    tiny_hash(num_embeddings=(61, 500))  # larger tables are fine


def test_hash_built_under_meta_is_real():
    with torch.device("meta"):
        eh = tiny_hash()
        released = EngramHash((1, 14), (384006168, 384016682), 16_000_000, 4, 8, 6, 2,
                              torch.tensor(TOKEN_MAP, device="cpu"))
        with pytest.raises(ValueError, match="meta"):
            tiny_hash(token_map=torch.tensor(TOKEN_MAP))  # a map without data is refused
    for module in (eh, released):
        for name, buf in module.named_buffers():
            assert buf.device.type == "cpu", name
    assert released.n_columns == 24 and released.offsets.shape == (2, 24)
    out = released(torch.tensor([[0, 1, 2]]), torch.zeros(1, 3, dtype=torch.int64), 0)
    assert out.shape == (1, 3, 2, 24)
    assert (out[:, :, 0] < 384006168).all() and (out[:, :, 1] < 384016682).all()


# ---- one layer's Engram --------------------------------------------------------------------


def test_table_rows_are_the_hashed_rows():
    eh = tiny_hash()
    layer = 1
    n_rows = NUM_EMB[layer]
    eng = Engram(dim=4, hc_mult=2, n_rows=n_rows, n_columns=eh.n_columns, head_dim=32, eps=1e-6)
    # row r holds its index in base-16 digits: small integers, exact in fp8_ue8m0_32
    r = torch.arange(n_rows)
    values = torch.zeros(n_rows, 32)
    for j in range(4):
        values[:, j] = ((r >> (4 * j)) & 15).float()
    eng.set_table(values)
    seq = torch.tensor([[3, 7, 0, 8, 1, 6, 6, 2]])
    rows = eh(seq, torch.zeros(1, 2, dtype=torch.int64), 0)[:, :, layer]  # [1, 8, 4]
    got = eng.lookup(rows)  # [1, 8, 4, 32]
    assert got.dtype == torch.float32 and got.shape == (1, 8, 4, 32)
    decoded = sum(got[..., j].long() << (4 * j) for j in range(4))
    assert torch.equal(decoded, rows)
    assert torch.equal(eng.lookup(r), values)  # the whole table reads back exactly
    assert eng.table_bytes == n_rows * (32 + 1)


def kv_value(w: torch.Tensor, e: list[float], hc: int, dim: int) -> list[float]:
    """The value part of wkv applied to the first three table entries e."""
    return [sum(w[o, i].item() * e[i] for i in range(3)) for o in range(hc * dim, (hc + 1) * dim)]


def test_gate_by_hand():
    dim, hc, head_dim, eps = 2, 2, 32, 1e-6
    eng = Engram(dim=dim, hc_mult=hc, n_rows=3, n_columns=1, head_dim=head_dim, eps=eps)
    table = torch.zeros(3, head_dim)
    table[0, :3] = torch.tensor([1.0, -0.5, 2.0])
    table[1, :3] = torch.tensor([0.25, 3.0, -1.0])
    table[2, :3] = torch.tensor([-2.0, 0.0, 0.5])
    eng.set_table(table)
    w = torch.zeros((hc + 1) * dim, head_dim)
    w[:, :3] = torch.tensor([[0.5, 1.0, -0.25], [1.0, 0.0, 0.5], [-1.0, 0.5, 0.0],
                             [0.25, 0.25, 1.0], [2.0, -1.0, 0.5], [0.0, 1.5, -0.5]])
    with torch.no_grad():
        eng.wkv.weight.copy_(w)
        eng.q_weight.copy_(torch.tensor([[1.0, 2.0], [0.5, -1.0]]))
        eng.k_weight.copy_(torch.tensor([[1.5, 1.0], [2.0, 1.0]]))
    x = torch.tensor([[[[0.3, -1.2], [2.0, 0.7]],
                       [[-0.4, 0.1], [0.0, 0.0]],
                       [[1.0, 1.0], [-3.0, 0.5]]]])  # [1, 3, 2, 2]
    rows = torch.tensor([[[0], [1], [2]]])  # [1, 3, 1]
    out = eng(x, rows)
    assert out.shape == x.shape and out.dtype == torch.float32

    qk = (eng.q_weight * eng.k_weight).tolist()
    for t in range(3):
        e = table[t, :3].tolist()
        kv = [sum(w[o, i].item() * e[i] for i in range(3)) for o in range((hc + 1) * dim)]
        value = kv[hc * dim :]
        for c in range(hc):
            key = kv[c * dim : (c + 1) * dim]
            h = x[0, t, c].tolist()
            dot = sum(h[d] * qk[c][d] * key[d] for d in range(dim))
            dot /= math.sqrt(sum(v * v for v in h) / dim + eps)
            dot /= math.sqrt(sum(v * v for v in key) / dim + eps)
            dot /= math.sqrt(dim)
            root = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)
            gate = 1 / (1 + math.exp(-root))
            for d in range(dim):
                assert out[0, t, c, d].item() == pytest.approx(h[d] + gate * value[d],
                                                                rel=1e-5, abs=1e-6)
    # a zero copy has dot 0: the clamp gives sqrt(1e-6), the gate sigmoid(+1e-3)
    gate_zero = out[0, 1, 1] / torch.tensor(kv_value(w, table[1, :3].tolist(), hc, dim))
    assert torch.allclose(gate_zero, torch.full((dim,), 1 / (1 + math.exp(-1e-3))))


def test_engram_fresh_init_and_checkpoint_names():
    torch.manual_seed(0)
    eng = Engram(dim=8, hc_mult=2, n_rows=50, n_columns=3, head_dim=64, eps=1e-6)
    names = set(eng.state_dict())
    assert names == {"table_codes", "table_scales", "wkv.weight", "q_weight", "k_weight"}
    assert eng.table_codes.dtype == torch.uint8 and eng.table_codes.shape == (50, 64)
    assert eng.table_scales.dtype == torch.uint8 and eng.table_scales.shape == (50, 2)
    assert eng.wkv.weight.shape == (3 * 8, 3 * 64)
    table = eng.lookup(torch.arange(50))
    assert 0.01 < table.std().item() < 0.03 and table.abs().max().item() < 0.2
    torch.manual_seed(0)
    again = Engram(dim=8, hc_mult=2, n_rows=50, n_columns=3, head_dim=64, eps=1e-6)
    assert torch.equal(again.table_codes, eng.table_codes)  # seeded by the global RNG
    x = torch.randn(2, 5, 2, 8)
    out = eng(x, torch.randint(0, 50, (2, 5, 3)))
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_engram_on_meta_skips_the_table_fill():
    with torch.device("meta"):
        eng = Engram(dim=16, hc_mult=4, n_rows=384006168, n_columns=24, head_dim=256, eps=1e-20)
    assert eng.table_codes.device.type == "meta"
    assert eng.table_bytes == 384006168 * (256 + 8)
