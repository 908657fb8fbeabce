"""The DeepSeek-V4.1 model family in PyTorch (and its dense control)."""

from kvstack._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "Model": "kvstack.model.model",
    "ModelOutput": "kvstack.model.model",
})
__all__ = ["Model", "ModelOutput"]
