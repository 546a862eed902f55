"""The step's own keys and values beside the cache (plugin API 1.7): the engine passes them to a
backend only after `enable_new_kv_reads` answered True, only over an unquantized cache, and the
attention warm-up passes them too, so the kernels that read them compile before serving."""

from __future__ import annotations

import torch

from pagedserve.attention.forward_context import ForwardContext
from pagedserve.attention.layer import attend
from pagedserve.config import EngineArgs
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.startup.attention_sweep import attention_warmup_batches, warm_up_attention
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 8, 4


class Recording(ReferenceAttentionBackend):
    """The oracle, asking for the new keys and values and recording what each call got."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def enable_new_kv_reads(self) -> bool:
        return True

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        new_key: torch.Tensor | None = None,
        new_value: torch.Tensor | None = None,
        **options: object,
    ) -> torch.Tensor:
        self.seen.append(None if new_key is None or new_value is None else (new_key, new_value))
        return super().forward(query, kv_cache, metadata, **options)  # type: ignore[arg-type]


def _step(
    backend: Recording, new_kv_reads: bool, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    metadata = AttentionMetadata.build(
        [5, 3], [5, 7], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), BLOCK_SIZE
    )
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    cache = torch.zeros(2, 4, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=dtype)
    scales = [KVCacheScales(1.0, 1.0)] if fp8 else None
    ctx = ForwardContext(
        metadata, [cache], backend, ReferenceCacheOps(), kv_scales=scales, new_kv_reads=new_kv_reads
    )
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(8, HEADS, HEAD_SIZE, generator=gen)
    key, value = torch.randn(2, 8, KV_HEADS, HEAD_SIZE, generator=gen)
    out = attend(ctx, 0, query, key, value, scale=HEAD_SIZE**-0.5, sliding_window=None, logit_softcap=None)
    return out, key, value


def test_attend_passes_the_new_keys_and_values_only_when_asked() -> None:
    backend = Recording()
    plain, _, _ = _step(backend, new_kv_reads=False)
    assert backend.seen == [None]
    with_kv, key, value = _step(backend, new_kv_reads=True)
    seen = backend.seen[1]
    assert seen is not None and seen[0] is key and seen[1] is value
    torch.testing.assert_close(with_kv, plain)  # the oracle reads the cache either way


def test_attend_never_passes_them_over_an_fp8_cache() -> None:
    """An FP8 cache holds rounded values: the projections' keys and values are not what it holds."""
    backend = Recording()
    _step(backend, new_kv_reads=True, fp8=True)
    assert backend.seen == [None]


def test_warm_up_passes_them_for_an_unquantized_cache() -> None:
    spec = ModelSpec(
        architecture="LlamaForCausalLM",
        implementation="native",
        num_layers=1,
        num_q_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        hidden_size=HEADS * HEAD_SIZE,
        vocab_size=32,
        dtype=torch.float32,
        sliding_windows=(None,),
        logit_softcap=None,
        max_position_embeddings=64,
    )
    cache = torch.zeros(spec.kv_cache_shape(8, BLOCK_SIZE))
    batches = attention_warmup_batches(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    backend = Recording()
    warm_up_attention(backend, ReferenceCacheOps(), cache, spec, batches, new_kv_reads=True)
    assert len(backend.seen) == len(batches)
    for batch, seen in zip(batches, backend.seen, strict=True):
        assert seen is not None and seen[0].shape == (batch.num_tokens, KV_HEADS, HEAD_SIZE)
    backend = Recording()
    warm_up_attention(backend, ReferenceCacheOps(), cache, spec, batches)
    assert backend.seen == [None] * len(batches)


def test_engine_option_defaults_on() -> None:
    assert EngineArgs(model="m").attention_reads_new_kv
    assert not EngineArgs(model="m", attention_reads_new_kv=False).attention_reads_new_kv
