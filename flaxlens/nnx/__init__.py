"""Flax NNX support: convert a `flax.nnx.Module` into a tree of call nodes."""
