"""What the server asks of its engine besides requests, run where the engine runs, between
its steps: in the engine's own process (`kvstack.engine.process`), or by the engine's
thread in the server's process (`AsyncLLM`). The server reaches these methods by name
(`engine.call("stats")`); arguments and results cross a pipe, so they are plain data."""

from typing import TYPE_CHECKING, Any

from kvstack.engine.sampling import PromptLogprob, SamplingParams
from kvstack.engine.sequence import RequestOutput
from kvstack.model.vision import ImageSegment
from kvstack.serve.sessions import SessionTable, Turn

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM


class ServeOps:
    def __init__(self, llm: "LLM") -> None:
        self.llm = llm
        self.sessions = SessionTable(llm)

    def stats(self) -> dict[str, Any]:
        """One consistent reading of the engine, between steps: its memory report, the
        batch and queue, its running totals, the disk tier's bytes."""
        llm = self.llm
        with llm.core.lock:
            runner = llm.runner
            stats = {"report": llm.memory_report(), "running": len(llm.scheduler.running),
                     "waiting": len(llm.scheduler.waiting),
                     "replayed": runner.replayed_tokens,
                     "drafting": (runner.verifies, runner.drafted_tokens,
                                  runner.accepted_tokens)}
        return stats | {"disk_bytes": llm.disk.used_bytes}

    def prompt_logprobs(self, ids: list[int], top: int) -> list[PromptLogprob | None]:
        return self.llm.prompt_logprobs(ids, top)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (and cache) a constrained request's grammar before it is queued: a bad
        schema is a ValueError here, not a failed request."""
        self.llm.core.grammars.matcher(params)

    def saved_sessions(self) -> int:
        return len(self.llm.disk.names())

    def session_begin(self, key: str, cache_salt: str | None, ids: list[int],
                      text: str | None, images: list[ImageSegment],
                      marked: str | None) -> Turn:
        return self.sessions.begin(key, cache_salt, ids, text, images, marked)

    def session_end(self, key: str, final: RequestOutput, images: list[ImageSegment]) -> None:
        self.sessions.end(key, final, images)

    def session_reports(self, prefix: str | None) -> dict[str, dict[str, Any]]:
        return self.sessions.reports(prefix)

    def session_report(self, key: str) -> dict[str, Any] | None:
        return self.sessions.report(key)

    def session_delete(self, key: str) -> bool:
        return self.sessions.delete(key)
