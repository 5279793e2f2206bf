"""Checkpoint readers, per-family name maps, meta skeletons and streaming materialization."""
