"""Tensor parallelism: the rank's process group, Megatron-style parallel layers, and model sharding."""
