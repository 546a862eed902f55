"""Attention: the per-step metadata contract and the layer models call into."""
