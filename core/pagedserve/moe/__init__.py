"""Mixture-of-experts layers: the routers' expert choice, the fused MoE op's torch formulation,
and the sparse block the models call."""
