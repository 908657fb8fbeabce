"""kvstack: the DeepSeek-V4.1 compressed KV-cache stack."""

from kvstack.engine import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
