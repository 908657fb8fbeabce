"""Resume cost and fidelity (`kvstack.eval.replay`): a paused session resumed by replay."""

import json

import numpy as np
import pytest
import torch

from kvstack.config import preset
from kvstack.corpus.data import TokenCache
from kvstack.eval.replay import replay, replay_fidelity
from kvstack.model import Model


@pytest.fixture(scope="module")
def model() -> Model:
    torch.manual_seed(0)
    return Model(preset("tiny")).eval()


def tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_exact_replay_resumes_the_uninterrupted_session(model):
    n = 12 * model.config.window_size
    result = replay_fidelity(model, tokens(n), modes=["exact"], decode_tokens=4)["replay"]
    assert result["exact"]["kl_max"] < 1e-9
    assert result["exact"]["top1_agreement"] == 1.0


def test_bounded_replay_is_approximate_only_past_the_window(model):
    w = model.config.window_size
    for n, differs in ((w // 2, False), (w, False), (12 * w, True)):
        bounded = replay_fidelity(model, tokens(n, seed=n), modes=["bounded"],
                                  decode_tokens=4)["replay"]["bounded"]
        if differs:
            assert bounded["kl_mean"] > 1e-9, bounded
        else:
            assert bounded["kl_max"] < 1e-9, bounded


def test_replayed_tokens_follow_the_spans_and_stop_growing(model):
    longest = model.encoder_span("exact")
    counts = {}
    for n in (longest, 4 * longest):
        result = replay_fidelity(model, tokens(n), decode_tokens=1)
        counts[n] = {mode: (r["encoder_tokens"], r["decoder_tokens"])
                     for mode, r in result["replay"].items()}
        assert all(counts[n][mode] == model.rebuild_spans(n, mode) for mode in counts[n])
    assert counts[longest] == counts[4 * longest]
    assert counts[longest] == {
        "bounded": (model.encoder_span("bounded"), model.decoder_span("bounded")),
        "exact": (model.encoder_span("exact"), model.decoder_span("exact")),
    }


def test_short_contexts_replay_every_token(model):
    n = model.config.window_size - 3
    result = replay_fidelity(model, tokens(n), decode_tokens=1)["replay"]
    assert all((r["encoder_tokens"], r["decoder_tokens"]) == (n, n) for r in result.values())


def test_replay_on_held_out_text_is_json_ready(model):
    # The timings are measured (once) but not asserted on: they depend on the machine.
    data = TokenCache(np.asarray(tokens(400), dtype=np.int32), ["held-out"])
    result = replay(model, data, lengths=[40, 120], decode_tokens=2, repeats=1)
    assert json.loads(json.dumps(result)) == result
    assert [r["tokens"] for r in result["results"]] == [40, 120]
    for row in result["results"]:
        assert "reprefill_s" in row
        for entry in row["replay"].values():
            assert {"rebuild_s", "reprefill_over_rebuild", "kl_mean"} <= entry.keys()


def test_lengths_must_leave_room_to_decode(model):
    data = TokenCache(np.asarray(tokens(400), dtype=np.int32), ["held-out"])
    limit = model.config.max_seq_len
    with pytest.raises(ValueError, match=f"lengths \\[{limit - 2}\\] leave no room"):
        replay(model, data, lengths=[64, limit - 2], decode_tokens=4)
    with pytest.raises(ValueError, match="replay must be one of"):
        replay_fidelity(model, tokens(16), modes=["full"])
