"""The data training and evaluation share: the standard-library corpus and its held-out
split, the tokenizer and token caches, and the retrieval samples in their written forms.
Below both `kvstack.train` and `kvstack.eval`, so an evaluation reads the very split and
samples a run trained on without depending on the trainer."""
