"""The Triton platform: unified paged attention (2D and split-KV 3D kernels) and KV-cache ops as
Triton kernels, for NVIDIA GPUs through CUDA and AMD GPUs through HIP."""
