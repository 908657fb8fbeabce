"""The DeepSeek-V4.1 model family in PyTorch (and its dense control)."""

from kvstack._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "Instruments": "kvstack.model.instruments",
    "Model": "kvstack.model.model",
    "ModelOutput": "kvstack.model.model",
})
__all__ = ["Instruments", "Model", "ModelOutput"]
