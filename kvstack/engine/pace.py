"""When DSpark drafts: while drafting pays on the machine at hand.

A DSpark step costs more than a plain one (a draft call, a verify of several rows), and
whether the tokens a verify keeps pay for that depends on the hardware, the batch and the
text. How many a sequence's next verify keeps follows how many its last one kept (a
greedy continuation that repeats itself keeps whole blocks, elsewhere the draft misses
from the first), so a sequence drafts while its verifies pay and, after one that does
not, decodes plainly for a while (1, 2, 4 ... up to MAX_PAUSE steps, reset by a verify
that pays) before it tries again. Lossless either way: a sequence's tokens are the
target's whether it drafts or not.

"Pays" is measured here, in the engine's own steps, by batch size (to the next power of
two): a step's seconds per sequence when none drafts and when some do. Their ratio is
the break-even: the tokens a verify must keep to make them as fast as plain steps. A
step drafts only where the tokens its ready sequences are expected to add pay for what
drafting adds to the whole step: a sequence whose last verify paid is expected to keep
as many again; one that tries again (new, or back from a pause) to break even, while
tries at this batch size have paid on the whole (the tokens over break-even of a try
and the run of verifies it started, a running mean) or it has not drafted for
MAX_PAUSE steps a sequence of the batch (a try costs the whole batch's step). So at
batch 1 tries go on where the runs they find pay for the misses, and at a large batch,
where a few sequences' drafts cannot pay for a step's draft call and verify, the batch
decodes plainly. Until both timings exist for a batch size, its first two steps decode
plainly and the next two draft (the first of each kind is not timed: it makes the
calls' buffers of new shapes).

Where the verifies at a batch size keep more than break-even on the whole (a running mean
over all of them), every sequence that holds a window drafts every step: single misses
are then the text's noise, not the end of a run that paid, and pausing at each would
give up steps that pay on average.

A plain step keeps a sequence's target states, which its next draft reads (a window of
them), unless that draft is more than a window of steps away: there (a large batch where
tries have not paid) its plain steps are the plain engine's, and it keeps them again a
window before its try, which waits until it holds a whole window.
"""

from kvstack.engine.sequence import DraftPause, Sequence

# The longest a sequence decodes plainly before it tries again (steps).
MAX_PAUSE = 32
# Weight of a new reading in the running means (machine noise moves single steps).
SMOOTHING = 0.1
# Weight of a verify's kept tokens in their running mean by batch size: what one verify
# keeps varies by more than a token (one keeps none of five drafts, the next all), so the
# mean that decides whether drafting pays on the whole reads the last fifty or so.
KEPT_SMOOTHING = 0.02


def size_class(batch: int) -> int:
    """The batch sizes timed together: to the next power of two."""
    return 1 << (batch - 1).bit_length()


class DraftPace:
    """Which sequences DSpark drafts for this step (`drafting`), learning from the steps'
    timings (`timed`) and each verify's kept tokens (`verified`). schedule "always": every
    sequence drafts every step (what SGLang's and vLLM's DSpark do); "measured": as the
    module says."""

    def __init__(self, schedule: str, window: int) -> None:
        """window: the states a draft reads (the model's window_size)."""
        self.schedule, self.window = schedule, window
        # By size class: a step's seconds per sequence when none drafted, and when some
        # did; the running mean of what a try and its run added over break-even.
        self.plain_seconds: dict[int, float] = {}
        self.drafting_seconds: dict[int, float] = {}
        self.try_gain: dict[int, float] = {}
        # What verifies keep: their running mean (KEPT_SMOOTHING) and how many there were.
        self.kept_mean: dict[int, float] = {}
        self.kept_count: dict[int, int] = {}
        self._seen: set[tuple[int, bool]] = set()  # (size, drafting) of the steps timed

    def drafting(self, seqs: list[Sequence]) -> list[bool]:
        """Whether each of a step's sequences drafts."""
        if self.schedule == "always":
            return [True] * len(seqs)
        size = size_class(len(seqs))
        if size not in self.plain_seconds:
            return [False] * len(seqs)
        if size not in self.drafting_seconds:
            return [True] * len(seqs)
        even = self.break_even(len(seqs))
        if self.pays(size):
            return [_holds_window(seq, self.window) for seq in seqs]
        # Where tries have not paid, a sequence tries again after MAX_PAUSE steps a
        # sequence of the batch: a try costs the whole batch's step.
        retry = None if self.try_gain.get(size, 0.0) >= 0 else MAX_PAUSE * size
        expected = [self._expected(seq.draft_pause, even, retry)
                    if _holds_window(seq, self.window) else None for seq in seqs]
        gain = sum(e - 1 for e in expected if e is not None)
        if gain <= 0 or gain < len(seqs) * (even - 1):
            return [False] * len(seqs)
        return [e is not None and e > 1 for e in expected]

    @staticmethod
    def _expected(pause: DraftPause, even: float, retry: int | None) -> float | None:
        """What the sequence's verify is expected to keep if it drafts now; None while it
        pauses. retry: the steps without a draft after which it tries even where tries
        have not paid (None: they have)."""
        if pause.steps_left:
            return None
        if pause.kept is not None:  # in a run
            return pause.kept
        return even if retry is None or pause.idle >= retry else 1.0

    def keeps_states(self, seq: Sequence, batch: int) -> bool:
        """Whether a plain step of `batch` sequences keeps the sequence's target states
        for its drafts: not where tries at that size have not paid and it will not try
        for more than a window of steps (none of those states would be read: it keeps
        them again from a window before its try). The states of a plain step cost a few
        percent of it at batch 16, where no sequence may draft for hundreds of steps."""
        if self.schedule == "always":
            return True
        size = size_class(batch)
        if (size not in self.drafting_seconds or self.try_gain.get(size, 0.0) >= 0
                or self.pays(size)):
            return True
        pause = seq.draft_pause
        return pause.kept is not None or MAX_PAUSE * size - pause.idle <= self.window

    def skipped(self, seq: Sequence) -> None:
        """A step the sequence decoded plainly."""
        pause = seq.draft_pause
        pause.steps_left = max(0, pause.steps_left - 1)
        pause.idle += 1

    def verified(self, seq: Sequence, batch: int, kept: int) -> None:
        """A verify of the sequence's drafts in a step of `batch` sequences kept `kept`
        tokens (accepted drafts and the target's own). Not judged before a drafting step
        of that size is timed (the break-even is not known yet)."""
        size = size_class(batch)
        if size not in self.drafting_seconds:
            return
        count = self.kept_count[size] = self.kept_count.get(size, 0) + 1
        mean = self.kept_mean.get(size, 0.0)  # the plain mean of the first ones, then a running one
        self.kept_mean[size] = mean + max(1 / count, KEPT_SMOOTHING) * (kept - mean)
        pause, even = seq.draft_pause, self.break_even(batch)
        if pause.kept is None:  # a try: its run starts
            pause.run_gain = 0.0
        pause.run_gain += kept - even
        pause.idle = 0
        if kept >= even:
            pause.steps_left, pause.length, pause.kept = 0, 1, kept
            return
        old = self.try_gain.get(size)
        self.try_gain[size] = (pause.run_gain if old is None
                               else old + SMOOTHING * (pause.run_gain - old))
        pause.steps_left, pause.kept = pause.length, None
        pause.length = min(2 * pause.length, MAX_PAUSE)

    def pays(self, size: int) -> bool:
        """Whether the verifies at this size class keep at least break-even on the whole
        (then every sequence drafts every step)."""
        kept = self.kept_mean.get(size)
        return kept is not None and kept >= self.break_even(size)

    def break_even(self, batch: int) -> float:
        """The tokens a sequence's verify must keep, on average over a step of `batch`
        sequences, for the step to make tokens as fast as plain steps: the ratio of a
        drafting step's seconds to a plain one's (1.0 until both are measured)."""
        size = size_class(batch)
        plain, drafting = self.plain_seconds.get(size), self.drafting_seconds.get(size)
        if plain is None or drafting is None:
            return 1.0
        return max(1.0, drafting / plain)

    def timed(self, batch: int, drafted: int, seconds: float) -> None:
        """A step of `batch` sequences, `drafted` of them drafting, took `seconds`. The
        first step of each kind at a size is not counted: it makes the calls' buffers of
        new shapes."""
        means = self.drafting_seconds if drafted else self.plain_seconds
        size, value = size_class(batch), seconds / batch
        if (size, bool(drafted)) not in self._seen:
            self._seen.add((size, bool(drafted)))
            return
        old = means.get(size)
        means[size] = value if old is None else old + SMOOTHING * (value - old)


def _holds_window(seq: Sequence, window: int) -> bool:
    """Whether the sequence holds the target states of the last window of tokens its store
    holds (all of them, if fewer), which its draft reads: not yet where plain steps kept
    none for a while (`DraftPace.keeps_states`)."""
    held = sum(map(len, seq.draft_states or ()))
    if seq.draft_context is not None:
        held += seq.draft_context.shape[1]
    return held >= min(window, seq.store.num_tokens)
