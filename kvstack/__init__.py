"""kvstack: the DeepSeek-V4.1 compressed KV-cache stack."""
