"""DSpark's measured schedule (`kvstack.engine.pace`): when a sequence drafts, from timings
handed to it here (what the engine measures in its steps), and what it does to outputs."""

from types import SimpleNamespace

import torch

from kvstack.engine import SamplingParams
from kvstack.engine.pace import MAX_PAUSE, DraftPace, size_class
from kvstack.engine.sequence import DraftPause
from tests.test_speculative import GREEDY, PROMPTS, engine, oracle, run

WINDOW = 64  # the states a draft reads, in the schedules made here


def sequences(n: int) -> list:
    """Sequences that hold the target states a draft reads (a window's)."""
    return [SimpleNamespace(draft_pause=DraftPause(), draft_context=None,
                            draft_states=[torch.zeros(WINDOW, 1)],
                            store=SimpleNamespace(num_tokens=100)) for _ in range(n)]


def plain_steps(pace: DraftPace, seqs: list) -> int:
    """The steps the sequences decode plainly before the schedule drafts again."""
    steps = 0
    while not any(pace.drafting(seqs)):
        for seq in seqs:
            pace.skipped(seq)
        steps += 1
    return steps


def measured(batch: int, plain: float, drafting: float) -> DraftPace:
    """A schedule that timed a plain step and a drafting step of `batch` sequences."""
    pace = DraftPace("measured", WINDOW)
    seqs = sequences(batch)
    for _ in range(2):  # nothing timed: plain steps first (the first one not counted)
        assert pace.drafting(seqs) == [False] * batch
        pace.timed(batch, 0, plain * batch)
    for _ in range(2):  # then drafting ones
        assert pace.drafting(seqs) == [True] * batch
        pace.timed(batch, batch, drafting * batch)
    return pace


def test_size_classes_are_powers_of_two():
    assert [size_class(b) for b in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


def test_break_even_is_a_drafting_steps_time_over_a_plain_ones():
    pace = measured(1, plain=0.002, drafting=0.005)
    assert pace.break_even(1) == 2.5
    assert pace.break_even(4) == 1.0  # not timed at that size
    pace.timed(1, 1, 0.015)  # a running mean: a tenth of the new reading
    assert abs(pace.break_even(1) - 3.0) < 1e-9


def test_the_first_step_of_each_kind_at_a_size_is_not_timed_nor_its_verifies_judged():
    pace = DraftPace("measured", WINDOW)
    [seq] = sequences(1)
    pace.timed(1, 0, 0.050)  # cold: the calls' buffers of new shapes made
    pace.timed(1, 0, 0.002)
    pace.timed(1, 1, 0.500)
    pace.verified(seq, 1, 1)  # no break-even yet: the verify is not judged
    assert seq.draft_pause == DraftPause() and pace.try_gain == {}
    pace.timed(1, 1, 0.005)
    assert pace.break_even(1) == 2.5
    pace.verified(seq, 1, 1)
    assert pace.try_gain == {1: -1.5}


def test_a_verify_that_pays_drafts_again_and_one_that_does_not_pauses_doubling():
    pace = measured(1, plain=0.002, drafting=0.005)  # break-even 2.5
    # A hundred verifies at this size kept 2.0 on the whole, less than break-even: the runs
    # decide.
    pace.kept_mean[1], pace.kept_count[1] = 2.0, 100
    [seq] = seqs = sequences(1)
    pace.verified(seq, 1, 4)  # a try that paid: in a run
    assert pace.drafting(seqs) == [True]
    pace.verified(seq, 1, 3)
    assert pace.drafting(seqs) == [True]
    pace.verified(seq, 1, 1)  # the run's end: 1.5 + 0.5 - 1.5 over break-even, in all
    assert pace.try_gain[1] == 0.5
    pauses = []
    for _ in range(4):
        pauses.append(plain_steps(pace, seqs))
        pace.verified(seq, 1, 3)  # a try that pays a little (0.5), then a miss (-1.5)
        pace.verified(seq, 1, 1)
    assert pauses == [1, 1, 1, 1]  # a verify that paid set the pause back to one step
    pace.try_gain[1] = 0.0
    seq.draft_pause = DraftPause()
    pauses = []
    for _ in range(7):
        pauses.append(plain_steps(pace, seqs))
        pace.verified(seq, 1, 2)  # a miss
        pace.try_gain[1] = 0.0  # as if tries paid on the whole
    assert pauses == [0, 1, 2, 4, 8, 16, MAX_PAUSE]


def test_where_verifies_keep_more_than_break_even_on_the_whole_every_sequence_drafts():
    """Single misses among verifies that pay on the whole are the text's noise: every
    sequence that holds a window drafts every step, a paused one and one that never tried
    alike, and plain steps keep their states; a string of misses that brings the running
    mean below break-even hands the choice back to the runs."""
    pace = measured(4, plain=0.002, drafting=0.005)  # break-even 2.5
    seqs = sequences(3)
    for kept in (4, 4, 1):  # a mean of 3.0
        pace.verified(seqs[0], 3, kept)
    assert pace.pays(4) and seqs[0].draft_pause.steps_left == 1  # the miss paused it
    seqs[2].draft_states = None  # holds no window
    assert pace.drafting(seqs) == [True, True, False]
    assert all(pace.keeps_states(seq, 3) for seq in seqs)
    for _ in range(12):
        pace.verified(seqs[0], 3, 1)
    assert not pace.pays(4)
    assert pace.drafting(seqs) == [False] * 3  # paused; no try pays for the step


def test_where_tries_do_not_pay_a_sequence_tries_again_after_max_pause_steps_a_sequence():
    pace = measured(1, plain=0.002, drafting=0.005)
    [seq] = seqs = sequences(1)
    pace.verified(seq, 1, 1)  # a try that missed: its run is worth -1.5
    assert pace.try_gain[1] == -1.5
    assert plain_steps(pace, seqs) == MAX_PAUSE
    pace = measured(2, plain=0.002, drafting=0.005)  # a try costs both sequences' step
    seqs = sequences(2)
    for seq in seqs:
        pace.verified(seq, 2, 1)
    assert plain_steps(pace, seqs) == 2 * MAX_PAUSE


def test_at_a_large_batch_a_few_sequences_in_a_run_do_not_pay_for_a_drafting_step():
    pace = measured(16, plain=0.001, drafting=0.002)  # break-even 2.0
    seqs = sequences(16)
    for seq in seqs:
        pace.verified(seq, 16, 1)  # every try missed: tries do not pay at this size
    assert pace.try_gain[16] < 0
    for seq in seqs:
        pace.skipped(seq)  # their pauses end
    for seq in seqs[:4]:
        seq.draft_pause = DraftPause(kept=4)  # four in a run: 4 x 3 tokens over one each
    assert pace.drafting(seqs) == [False] * 16  # the step costs 16 x 1 token
    for seq in seqs[4:8]:
        seq.draft_pause = DraftPause(kept=4)
    assert pace.drafting(seqs) == [True] * 8 + [False] * 8  # 24 tokens: it pays


def test_plain_steps_keep_the_states_a_draft_may_read_within_a_window():
    pace = DraftPace("measured", WINDOW)
    [seq] = seqs = sequences(1)
    assert pace.keeps_states(seq, 16)  # nothing timed: a try comes soon
    pace = measured(16, plain=0.001, drafting=0.002)
    assert pace.keeps_states(seq, 16)  # tries have paid (none judged yet)
    for other in sequences(16):
        pace.verified(other, 16, 1)  # tries do not pay: the next after 16 x 32 steps
    keeps = []
    for _ in range(MAX_PAUSE * 16):
        keeps.append(pace.keeps_states(seq, 16))
        pace.skipped(seq)
    assert keeps == [False] * (MAX_PAUSE * 16 - WINDOW) + [True] * WINDOW
    seq.draft_pause = DraftPause(kept=3)  # in a run: it drafts next step
    assert pace.keeps_states(seq, 16)
    seq.draft_pause = DraftPause()
    assert pace.keeps_states(seq, 1)  # at batch 1 a try is MAX_PAUSE <= a window away
    assert DraftPace("always", WINDOW).keeps_states(seq, 16)
    pace = measured(1, plain=0.002, drafting=0.005)
    seq.draft_pause.idle = MAX_PAUSE  # a try is due
    assert pace.drafting(seqs) == [True]
    seq.draft_states = [torch.zeros(WINDOW - 1, 1)]  # short of a window: not ready to draft
    assert pace.drafting(seqs) == [False]
    seq.draft_states = None
    seq.draft_context = torch.zeros(2, WINDOW - 1, 8)
    assert pace.drafting(seqs) == [False]
    seq.draft_states = [torch.zeros(1, 1)]  # a window, kept partly as entries: ready
    assert pace.drafting(seqs) == [True]
    seq.store.num_tokens, seq.draft_states = 5, [torch.zeros(5, 1)]  # all of a short one
    seq.draft_context = None
    assert pace.drafting(seqs) == [True]


def test_always_drafts_every_sequence_every_step():
    pace = DraftPace("always", WINDOW)
    seqs = sequences(3)
    seqs[0].draft_pause.steps_left = 5
    assert pace.drafting(seqs) == [True] * 3


def test_the_measured_schedule_keeps_the_outputs_whether_or_not_drafting_pays():
    """Greedy outputs equal a run that never drafted, batch 1 and 2: with the schedule's
    own timings, with timings where drafting never pays (every step a plain decode call
    that keeps the target states) and where it does (a draft that is right for a while:
    runs of verifies, misses, pauses and tries)."""
    want = run(engine(), PROMPTS, GREEDY)
    assert run(engine("dspark", speculative_schedule="measured"), PROMPTS, GREEDY) == want
    for drafting, pays in ((100.0, False), (1.2, True)):

        def timed(drafting: float = drafting, pays: bool = pays):
            """An engine of the measured schedule, handed these timings (each run on a
            fresh one: a prompt run again hits the prefix cache, whose replay moves
            logits)."""
            llm = engine("dspark", speculative_schedule="measured")
            if pays:
                oracle(llm, {p[0]: p + reply for p, reply in zip(PROMPTS, want, strict=True)})
            pace = llm.runner.pace
            pace.plain_seconds = {1: 1.0, 2: 1.0}
            pace.drafting_seconds = {1: drafting, 2: drafting}
            pace.try_gain = {} if pays else {1: -1.0, 2: -1.0}
            return llm

        engines = [timed() for _ in range(len(PROMPTS) + 1)]
        assert [run(llm, [p], GREEDY)[0]
                for llm, p in zip(engines, PROMPTS, strict=False)] == want
        assert run(engines[-1], PROMPTS, GREEDY) == want
        for llm in engines:
            assert (llm.runner.verifies > 0) == pays
            assert llm.runner.undrafted > 0


def test_a_sampled_request_under_the_measured_schedule_draws_as_plain_decoding_does():
    """Where drafting never pays, a seeded sampled request decodes one token a step as a
    run without DSpark does: the same tokens."""
    sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
    want = run(engine(), PROMPTS[:1], sampled)
    llm = engine("dspark", speculative_schedule="measured")
    llm.runner.pace.plain_seconds, llm.runner.pace.drafting_seconds = {1: 1.0}, {1: 100.0}
    llm.runner.pace.try_gain = {1: -1.0}
    assert run(llm, PROMPTS[:1], sampled) == want


def test_a_try_after_steps_that_kept_no_states_reads_the_window_before_it():
    """Where tries at a batch size have not paid, a sequence's plain steps keep no target
    states until a window of steps before its next try (after MAX_PAUSE steps); the try
    reads a whole window, the states of exactly the tokens before it (labelled here by
    their positions), and the outputs are a plain run's."""
    params = SamplingParams(max_tokens=3 * MAX_PAUSE, temperature=0, ignore_eos=True)
    want = run(engine(), PROMPTS[:1], params)
    llm = engine("dspark", speculative_schedule="measured")
    pace, model, c = llm.runner.pace, llm.runner.model, llm.config
    pace.plain_seconds, pace.drafting_seconds, pace.try_gain = {1: 1.0}, {1: 2.0}, {1: -1.0}
    stages = len(c.draft_layers)

    def labelled(target_hidden, position):
        b, n, _ = target_hidden.shape
        at = torch.as_tensor(position).reshape(-1, 1) - n + 1 + torch.arange(n)  # [P, n]
        return at.float().expand(b, n)[None, ..., None].expand(stages, b, n, c.head_dim)

    reads, own = [], model.draft.block

    def block(_model, window, token, position, *rest, **settings):
        reads.append((window[0, 0, :, 0].tolist(), int(torch.as_tensor(position).max())))
        return own(_model, window, token, position, *rest, **settings)

    held, skipped = [], pace.skipped

    def skip(seq):
        if seq.status.name != "FINISHED":  # (a finished one keeps nothing)
            held.append((seq.draft_pause.idle, seq.draft_context is not None
                         or bool(seq.draft_states)))
        skipped(seq)

    model.draft.window, model.draft.block, pace.skipped = labelled, block, skip
    assert run(llm, PROMPTS[:1], params) == want
    assert len(reads) == 2 and len(held) > 2 * MAX_PAUSE
    for window, position in reads:
        assert window == [float(p) for p in range(position - c.window_size + 1, position + 1)]
    assert all(holds == (idle >= MAX_PAUSE - c.window_size) for idle, holds in held)
