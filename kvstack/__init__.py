"""kvstack: the DeepSeek-V4.1 compressed KV-cache stack."""

from kvstack._lazy import lazy_exports
from kvstack.engine import __all__ as _ENGINE_NAMES  # the engine package itself loads lazily

__getattr__ = lazy_exports(__name__, dict.fromkeys(_ENGINE_NAMES, "kvstack.engine"))
__all__ = list(_ENGINE_NAMES)
