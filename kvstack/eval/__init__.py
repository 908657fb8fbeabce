"""Evaluation of trained models: perplexity with FP4 against bf16 caches, retrieval,
resume cost and fidelity, and the `kvstack eval` sub-commands that run them."""
