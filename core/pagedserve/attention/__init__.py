"""Attention: the layer models call into and the per-forward context it reaches the cache through."""
