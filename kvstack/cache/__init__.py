"""KV-cache storage: the layout of a config, the storage interface, and its stores."""

from kvstack.cache.contiguous import ContiguousCache
from kvstack.cache.layout import CacheLayout
from kvstack.cache.reference import ReferenceStore
from kvstack.cache.store import KVStore

__all__ = ["CacheLayout", "ContiguousCache", "KVStore", "ReferenceStore"]
