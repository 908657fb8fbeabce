"""KV-cache storage: the layout of a config, and the stores that hold it."""
