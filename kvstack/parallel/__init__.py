"""Splitting one model over ranks: the sharding plan (no torch: `kvstack plan` reads it)
and the cut of a model to one rank's shard with the collectives that rejoin it."""
