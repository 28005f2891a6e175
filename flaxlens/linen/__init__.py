"""Flax Linen support: convert a `flax.linen.Module` into a tree of call nodes."""
