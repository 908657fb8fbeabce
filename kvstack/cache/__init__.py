"""KV-cache storage: the layout of a config, the storage interface, and its stores."""

from kvstack._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "CacheLayout": "kvstack.cache.layout",
    "ContiguousCache": "kvstack.cache.contiguous",
    "KVStore": "kvstack.cache.store",
    "ReferenceStore": "kvstack.cache.reference",
})
__all__ = ["CacheLayout", "ContiguousCache", "KVStore", "ReferenceStore"]
