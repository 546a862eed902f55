"""Quantized checkpoints: what a checkpoint's `quantization_config` says each linear layer holds,
the layers that run those weights, and the readers of each format's tensors (docs/quantization.md)."""
