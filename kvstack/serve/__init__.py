"""`kvstack serve`: the OpenAI-compatible HTTP server over the engine (the `serve` extra)."""
