"""The DeepSeek-V4.1 model family in PyTorch (and its dense control)."""

from kvstack.model.model import Model, ModelOutput

__all__ = ["Model", "ModelOutput"]
