"""The DeepSeek-V4.1 model family in PyTorch."""
