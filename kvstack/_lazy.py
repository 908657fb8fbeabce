"""Package attributes imported on first use, so that `import kvstack.config` (and the
`kvstack` command's start) does not pull in torch, the model and the engine."""

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for a package whose names live in submodules (name ->
    module path)."""

    def getattr_(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_
