"""`TritonCascadeBackend`: plugin API 1.16's three cascade operations on the Triton cascade kernels,
written once for every backend that runs its cascade steps there (triton and rocm, and cuda, whose
CUDA kernels have none).

Importable without triton, like `capabilities`: the kernels' wrapper (`cascade.TritonCascade`) is
built on the first cascade call, so importing or constructing a backend compiles and imports no
kernel (the cuda backend is built on machines where triton may not import yet).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from pagedserve.platforms.api import AttentionBackend
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.attention_states import AttentionState
from pagedserve_triton.launch_params import LaunchParams

if TYPE_CHECKING:
    from pagedserve_triton.cascade import TritonCascade


class TritonCascadeBackend(AttentionBackend):
    """An attention backend whose `prefix_attention`, `suffix_attention` and
    `merge_attention_states` launch `cascade_kernels` through one `TritonCascade`. A subclass says
    which launch parameters (tuned configs) the kernels read; it still declares
    `cascade_attention` in its capabilities itself."""

    # Set by `_triton_cascade` on the first cascade call. Two threads racing there build equal,
    # stateless wrappers, and either may stay.
    _cascade: TritonCascade | None = None

    @abstractmethod
    def _cascade_launch_params(self) -> LaunchParams:
        """Where the cascade kernels read their tuned launch parameters. Called once per instance."""

    def _triton_cascade(self) -> TritonCascade:
        if self._cascade is None:
            from pagedserve_triton.cascade import TritonCascade

            self._cascade = TritonCascade(self._cascade_launch_params())
        return self._cascade

    def prefix_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> AttentionState:
        """API 1.16: `cascade_kernels.cascade_prefix_kernel` (see `cascade.TritonCascade`)."""
        self.check_cascade_call(
            query, kv_cache, metadata, scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap
        )
        return self._triton_cascade().prefix(
            query, kv_cache, metadata, scale=scale, logit_softcap=logit_softcap
        )

    def suffix_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> AttentionState:
        """API 1.16: `cascade_kernels.cascade_suffix_kernel` (see `cascade.TritonCascade`)."""
        self.check_cascade_call(
            query, kv_cache, metadata, scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap
        )
        return self._triton_cascade().suffix(
            query, kv_cache, metadata, scale=scale, logit_softcap=logit_softcap
        )

    def merge_attention_states(
        self, prefix: AttentionState, suffix: AttentionState, out: torch.Tensor
    ) -> torch.Tensor:
        """API 1.16: `cascade_kernels.merge_states_kernel`."""
        return self._triton_cascade().merge(prefix, suffix, out)
