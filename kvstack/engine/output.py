"""Output processing: incremental detokenisation with stop strings, and each request's
outputs routed to the front end waiting for it.

The text of a request grows by decoding only its newest tokens (with a few before them
for context, as vLLM and HF's TextStreamer do), so a token costs the same at any length,
and a stop string is searched for only where it could have just appeared.

Where the text is made: a request with stop strings is detokenised in the engine's step,
since a stop string decides where it ends and what its kept cache holds. Any other
request's text is made off the step, by the front end that reads its outputs
(`RequestOutput.with_text`, on the reader's thread: the HTTP server's event loop, a
`LLM.generate` caller), so the step never waits on it.
"""

import threading
from collections.abc import Callable

from kvstack.engine.sequence import RequestOutput
from kvstack.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decode of an incomplete UTF-8 sequence ends with


class Detokenizer:
    """The text of a growing list of token ids."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        # ids[prefix:read] were decoded into text already; they give the next decode its
        # context (a byte-level or SentencePiece tokenizer decodes a token by its left).
        self.prefix = self.read = 0
        # text_for's: the text's length after each count of ids (an output read after a
        # newer one of its request gets its own text), and its readers' turns.
        self.lengths = [0]
        self.lock = threading.Lock()

    def add(self, token: int, check_stop: bool = True) -> bool:
        """Append a token; True when the text now holds a stop string (cut before it).
        check_stop=False: not looked for yet (min_tokens), as vLLM does."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return False  # an incomplete character: wait for the bytes that end it
        new = after[len(before) :]
        searched = len(self.text) - self.longest_stop + 1  # a stop may span the old end
        self.text += new
        self.prefix, self.read = self.read, len(self.ids)
        hits = [i for s in self.stop if check_stop
                and (i := self.text.find(s, max(0, searched))) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def settled(self) -> str:
        """The text no later token can take back: without the end of it where a stop
        string may be starting, so that a streamed reply never shows what a stop then cuts
        (its final text is `text`)."""
        for n in range(min(self.longest_stop - 1, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                return self.text[:-n]
        return self.text

    def text_for(self, ids: list[int], final: bool, flush: bool) -> str:
        """The text of a request without stop strings after the output that holds ids (its
        output ids so far), made by whoever reads it: the ids not seen yet are added, and
        a final output (flush: ended other than by a stop token) takes what is held back.
        Any thread may ask, in any order of its request's outputs."""
        with self.lock:
            if len(ids) < len(self.ids):  # an older output, read after a newer one
                return self.text[: self.lengths[len(ids)]]
            for token in ids[len(self.ids) :]:
                self.add(token, check_stop=False)
                self.lengths.append(len(self.text))
            if final and flush:
                self.flush()
            return self.text

    def flush(self) -> None:
        """At the end: whatever is still held back (an incomplete character) joins the
        text, as a decode of the whole would show it."""
        if self.read < len(self.ids):
            before = self.tokenizer.decode(self.ids[self.prefix : self.read])
            self.text += self.tokenizer.decode(self.ids[self.prefix :])[len(before) :]
            self.prefix = self.read = len(self.ids)


class OutputRouter:
    """The newest output of every request a front end waits on, until it takes it.

    Outputs are cumulative (all text and tokens so far), so only the newest is kept: a
    front end that missed a few steps loses nothing, and memory stays one output per
    request. A request's final output waits here until taken, whoever ran the step.

    A front end that is not polling (the asyncio one) subscribes instead: every output of
    the request is handed to its callback as the step that made it routes it."""

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput | None] = {}
        self._subscribers: dict[str, Callable[[RequestOutput], None]] = {}

    def watch(self, request_id: str) -> None:
        self._latest[request_id] = None

    def subscribe(self, request_id: str, deliver: Callable[[RequestOutput], None]) -> None:
        self._subscribers[request_id] = deliver

    def put(self, output: RequestOutput) -> None:
        if output.request_id in self._latest:
            self._latest[output.request_id] = output
        deliver = self._subscribers.get(output.request_id)
        if deliver is not None:
            if output.finished:
                del self._subscribers[output.request_id]
            deliver(output)

    def take(self, request_id: str) -> RequestOutput | None:
        """The newest output not taken yet (None if none); a final one ends the watch."""
        output = self._latest.get(request_id)
        if output is None:
            return None
        if output.finished:
            del self._latest[request_id]
        else:
            self._latest[request_id] = None
        return output

    def forget(self, request_id: str) -> None:
        self._latest.pop(request_id, None)
        self._subscribers.pop(request_id, None)
