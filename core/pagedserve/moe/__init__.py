"""Mixture-of-experts layers: the router's expert choice, the torch formulation of the fused MoE op, and the block models call."""
