"""Training models of the family: the trainer (its data, shared with evaluation:
`kvstack.corpus`)."""
