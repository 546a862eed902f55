"""What the Triton unified attention kernel supports, importable without triton.

The cuda platform delegates every batch its CUDA kernels do not cover to this kernel, so it
declares these capabilities too (all but attention sinks, which its CUDA decode kernels lack); both
read them from here, where neither plugin's availability check needs triton to be installed.
"""

from __future__ import annotations

import torch

from pagedserve.platforms.api import AttentionCapabilities

UNIFIED_ATTENTION_CAPABILITIES = AttentionCapabilities(
    # Any head size <= 256 works (padded to a power of two); these are the ones tested.
    head_sizes=frozenset({32, 64, 80, 96, 112, 128, 192, 256}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    block_sizes=frozenset({16, 32, 64}),
    sliding_window=True,
    logit_softcap=True,
    # The kernels take the FP8 encoding from the cache pointer. NVIDIA GPUs need sm_89+ (Ada,
    # Hopper) for FP8 conversions; a ROCm platform reusing the kernels declares the fnuz variants.
    kv_cache_dtypes=frozenset({torch.float8_e4m3fn, torch.float8_e5m2}),
    # API 1.13 (gpt-oss): the 2D kernel starts each row's softmax from its sink, the 3D kernel's
    # reduction adds it once (`unified_attention`).
    attention_sinks=True,
)
