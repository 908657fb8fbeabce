"""The inference engine: paged cache, continuous batching, the LLM front door."""

from kvstack._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "LLM": "kvstack.engine.llm",
    "RequestOutput": "kvstack.engine.sequence",
    "SamplingParams": "kvstack.engine.sampling",
})
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
