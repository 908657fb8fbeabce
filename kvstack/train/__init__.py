"""Training models of the family: data with no download, the trainer."""
