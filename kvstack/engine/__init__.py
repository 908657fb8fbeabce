"""The inference engine: paged cache, continuous batching, the LLM front door."""

from kvstack.engine.llm import LLM
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.sequence import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
