"""The inference engine: paged cache, continuous batching, the LLM front door."""

from kvstack._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "AsyncLLM": "kvstack.engine.async_llm",
    "EngineConfig": "kvstack.engine.config",
    "EngineCore": "kvstack.engine.core",
    "EngineError": "kvstack.engine.core",
    "LLM": "kvstack.engine.llm",
    "RequestOutput": "kvstack.engine.sequence",
    "SamplingParams": "kvstack.engine.sampling",
})
__all__ = ["LLM", "AsyncLLM", "EngineConfig", "EngineCore", "EngineError", "RequestOutput",
           "SamplingParams"]
