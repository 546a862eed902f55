"""Tensor parallelism: the rank's process group and its all-reduce, Megatron-style parallel
layers, and model sharding."""
