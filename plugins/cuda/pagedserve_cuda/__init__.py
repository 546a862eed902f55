"""The cuda platform: paged-attention v1/v2 decode kernels and KV-cache ops in CUDA C++, compiled
at first use with NVRTC (no toolkit needed), plus the Triton unified kernel for prefill batches."""
