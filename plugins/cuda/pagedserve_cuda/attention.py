"""`CudaPagedAttentionBackend`: per batch, the CUDA decode kernels (v1 or v2) or the Triton unified
kernel, as `selection.explain` decides. Every decision uses host-side metadata only (no sync).

Decode-only batches (`max_query_len == 1`) run `paged_attention.cu`; prefill, chunked-prefill,
speculative and mixed batches, and any shape the CUDA kernels do not cover, run the Triton backend
with the platform's tuned configs (its NVIDIA tables). The backend declares what the pair computes
together: everything Triton declares, since Triton covers every case the CUDA kernels do not.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from pagedserve.platforms.api import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayerShape,
    KVCacheScales,
    UnsupportedCase,
)
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.tuned_configs import TunedConfigs
from pagedserve_cuda.compiler import INSTALL_HINT
from pagedserve_cuda.paged_attention import (
    check_decode_layout,
    decode_source,
    decode_variant,
    launch_decode,
    vector_load_problem,
)
from pagedserve_cuda.selection import (
    BatchShape,
    DecodeTuning,
    DeviceProps,
    KernelChoice,
    LaunchShape,
    explain,
)
from pagedserve_cuda.tuning import decode_tuning, tuned_config_files
from pagedserve_triton.capabilities import UNIFIED_ATTENTION_CAPABILITIES
from pagedserve_triton.cascade_backend import TritonCascadeBackend
from pagedserve_triton.launch_params import LaunchParams

if TYPE_CHECKING:  # the CLI defines the query type; the backend only reads its fields
    from pagedserve.cli.platforms import BatchQuery

KernelOverride = Literal["auto", "cuda_v1", "cuda_v2", "triton"]
MAX_CACHED_CHOICES = 4096  # distinct batch shapes remembered; a serving engine sees few


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"CudaPagedAttentionBackend: {message}")


def _forced(choice: KernelChoice, kernel: KernelOverride, span: int, tuning: DecodeTuning) -> KernelChoice:
    """`choice` with the CUDA kernel replaced by `kernel` (tests, benchmarks). Cases the CUDA kernels
    cannot run stay on Triton. Pure."""
    if kernel == "auto" or choice.launch is None:
        return choice
    why = "forced by the backend's `kernel` argument"
    if kernel == "triton":
        return KernelChoice("triton", why, None)
    if kernel == "cuda_v1":
        return KernelChoice("cuda_v1", why, replace(choice.launch, partition_size=None, num_partitions=1))
    size = choice.launch.partition_size or tuning.partition_size
    return KernelChoice(
        "cuda_v2", why, replace(choice.launch, partition_size=size, num_partitions=-(-span // size))
    )


def _layout_of(t: torch.Tensor) -> tuple[object, ...]:
    """Everything `check_decode_layout` reads of a tensor: shape, strides, dtype, device and the
    address modulo 16 (the vector loads' alignment). Pure."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


class CudaPagedAttentionBackend(TritonCascadeBackend):
    """Paged attention on NVIDIA GPUs: CUDA v1/v2 decode kernels, Triton for everything else."""

    name: ClassVar[str] = "cuda_paged"
    # Triton runs every case the CUDA kernels do not, so the pair supports what it does, except
    # attention sinks (API 1.13): the CUDA decode kernels have none (models with sinks run on the
    # triton platform).
    # API 1.16: cascade steps run on the Triton plugin's cascade kernels, like prefill.
    capabilities: ClassVar[AttentionCapabilities] = replace(
        UNIFIED_ATTENTION_CAPABILITIES, attention_sinks=False, cascade_attention=True
    )
    # The kernel choice is host-only; v1/v2 CTAs of a sequence shorter than their partition return
    # at once (seq_len 0: every one), and v2's reduction writes row query_start_loc[seq], which
    # for a padding sequence is the first padding row. Prefill batches go to Triton, which
    # declares the same.
    supports_full_cuda_graph: ClassVar[bool] = True
    # A batch whose `max_query_len` bound is above 1 always goes to Triton, which declares it.
    supports_full_cuda_graph_mixed: ClassVar[bool] = True
    # Decision caches are dicts a second thread may fill again; the loader compiles different NVRTC
    # modules at once and a kernel's parameter block is packed under its lock (`launcher`); the
    # Triton backend declares the same.
    concurrent_batches: ClassVar[bool] = True

    def __init__(
        self,
        *,
        tuned_configs: TunedConfigs | None = None,
        kernel: KernelOverride = "auto",
        tuning: DecodeTuning | None = None,
    ) -> None:
        """`tuned_configs` is the platform's (`LoadedPlatform.tuned_configs()`); None reads this
        plugin's files (and the Triton plugin's). `kernel` forces a kernel for decode batches the
        CUDA kernels support (tests, benchmarks); `tuning` replaces the tuned decode thresholds."""
        if kernel not in ("auto", "cuda_v1", "cuda_v2", "triton"):
            raise ValueError(f"kernel={kernel!r} must be one of 'auto', 'cuda_v1', 'cuda_v2', 'triton'")
        self._configs = (
            tuned_configs if tuned_configs is not None else TunedConfigs.from_files(tuned_config_files())
        )
        self._kernel: KernelOverride = kernel
        self._tuning = tuning
        self._devices: dict[torch.device, DeviceProps] = {}
        self._tunings: dict[tuple[str, int, torch.dtype], DecodeTuning] = {}
        self._choices: dict[tuple[object, ...], KernelChoice] = {}
        self._triton: AttentionBackend | None = None
        self._validated: set[tuple[object, ...]] = set()  # layout signatures check_decode_layout passed
        self._dependent_max_tokens = 0  # `enable_programmatic_launch`, passed on to the Triton backend
        self._new_kv_reads = False  # `enable_new_kv_reads`, passed on to the Triton backend

    def enable_programmatic_launch(self, max_tokens: int) -> bool:
        """The Triton kernels (every batch the CUDA kernels do not take, the one-request decode
        included) launch as programmatic dependent launches for steps of at most `max_tokens`
        tokens; the CUDA v1/v2 kernels launch plainly. Returns True. Mutates the instance."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 0 (0 turns programmatic launches off)")
        self._dependent_max_tokens = max_tokens
        if self._triton is not None:
            self._triton.enable_programmatic_launch(max_tokens)
        return True

    def enable_new_kv_reads(self) -> bool:
        """Pass the step's new keys and values to the Triton backend, whose prefill kernel reads
        them (`TritonUnifiedAttentionBackend.enable_new_kv_reads`); the CUDA decode kernels read
        the cache. Returns True. Mutates the instance."""
        self._new_kv_reads = True
        if self._triton is not None:
            self._triton.enable_new_kv_reads()
        return True

    def device_props(self, device: torch.device) -> DeviceProps:
        """The GPU's name, SM count and capability, read once per device."""
        props = self._devices.get(device)
        if props is None:
            props = DeviceProps.of(device)
            self._devices[device] = props
        return props

    def decode_tuning(self, device_name: str, head_size: int, dtype: torch.dtype) -> DecodeTuning:
        """The constructor's `tuning`, else the tuned-config value for this device and shape (cached)."""
        if self._tuning is not None:
            return self._tuning
        key = (device_name, head_size, dtype)
        tuning = self._tunings.get(key)
        if tuning is None:
            tuning = decode_tuning(self._configs, device_name, head_size=head_size, dtype=dtype)
            self._tunings[key] = tuning
        return tuning

    def choose(self, shape: BatchShape, device: torch.device) -> KernelChoice:
        """`explain` for this batch on `device` (plus the constructor's `kernel` override). Host-only;
        mutates only the decision cache."""
        key = (shape, device)
        choice = self._choices.get(key)
        if choice is None:
            props = self.device_props(device)
            tuning = self.decode_tuning(props.name, shape.head_size, shape.dtype)
            span = (
                shape.max_seq_len
                if shape.sliding_window is None
                else min(shape.max_seq_len, shape.sliding_window)
            )
            if self._kernel != "auto":
                # A forced CUDA kernel must run even where the tuned table routes decode to Triton.
                tuning = replace(tuning, decode_kernels="cuda")
            choice = _forced(explain(shape, props, tuning), self._kernel, span, tuning)
            if len(self._choices) >= MAX_CACHED_CHOICES:
                self._choices.clear()
            self._choices[key] = choice
        return choice

    def explain_batch(self, batch: BatchQuery) -> str:
        """What `pagedserve platforms --explain` prints: the kernel `forward` would run for `batch`
        on the device it names, and why. Host-only; reads the tuned configs."""
        shape = BatchShape(
            num_seqs=batch.num_seqs,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            num_q_heads=batch.num_q_heads,
            num_kv_heads=batch.num_kv_heads,
            head_size=batch.head_size,
            dtype=batch.dtype,
            block_size=batch.block_size,
            sliding_window=batch.sliding_window,
            logit_softcap=batch.logit_softcap,
        )
        try:
            self.check_supported(
                head_size=shape.head_size,
                dtype=shape.dtype,
                block_size=shape.block_size,
                sliding_window=shape.sliding_window,
                logit_softcap=shape.logit_softcap,
            )
        except UnsupportedCase as e:
            return f"unsupported: {e}"
        props = DeviceProps(batch.device_name, batch.num_sms, batch.capability)
        tuning = self.decode_tuning(props.name, shape.head_size, shape.dtype)
        return explain(shape, props, tuning).describe()

    def _cascade_launch_params(self) -> LaunchParams:
        """The cascade kernels read the platform's tuned configs (the Triton plugin's schema)."""
        return LaunchParams(self._configs)

    def _triton_backend(self) -> AttentionBackend:
        if self._triton is None:
            try:
                from pagedserve_triton.attention import TritonUnifiedAttentionBackend
            except ImportError as e:
                raise RuntimeError(
                    f"the cuda platform runs prefill and mixed batches with the Triton plugin, which cannot "
                    f"be imported ({e}); {INSTALL_HINT}"
                ) from e
            self._triton = TritonUnifiedAttentionBackend(tuned_configs=self._configs)
            if self._dependent_max_tokens:
                self._triton.enable_programmatic_launch(self._dependent_max_tokens)
            if self._new_kv_reads:
                self._triton.enable_new_kv_reads()
        return self._triton

    def full_graph_key(self, metadata: AttentionMetadata, layer: AttentionLayerShape) -> Hashable:
        """What `forward` runs for `metadata` on a layer of shape `layer`: the CUDA kernel and its
        launch shape (v2's partition count follows `max_seq_len`), or the Triton backend's split
        plan for batches that go to Triton (prefill, unsupported shapes, tuned configs that
        route decode there, non-CUDA devices). `forward` also sends a call whose tensors the
        CUDA kernels' 16-byte loads cannot read to Triton; the key sees no tensors and assumes
        aligned ones (the models' layouts). Were that wrong, graphs would be grouped by the CUDA
        choice instead of the Triton plan: still correct, only planned for a longer bound than
        needed. Host-only; mutates only the decision caches."""
        if metadata.num_actual_tokens == 0 or metadata.num_reqs == 0:
            return ("none",)  # `forward` launches nothing
        choice = KernelChoice("triton", "", None)
        if layer.device.type == "cuda":
            shape = BatchShape(
                num_seqs=metadata.num_reqs,
                max_query_len=metadata.max_query_len,
                max_seq_len=metadata.max_seq_len,
                num_q_heads=layer.num_q_heads,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size,
                dtype=layer.dtype,
                block_size=layer.block_size,
                sliding_window=layer.sliding_window,
                logit_softcap=layer.logit_softcap,
            )
            choice = self.choose(shape, layer.device)
        if choice.launch is None:
            return ("triton", self._triton_backend().full_graph_key(metadata, layer))
        return (choice.kernel, choice.launch)  # not the reason: it names the lengths

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
        new_key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]; for Triton
        new_value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]; for Triton
        sinks: torch.Tensor | None = None,  # undeclared: refused by `check_call`
    ) -> torch.Tensor:
        """Attention output [num_tokens, num_q_heads, head_size]; rows past num_actual_tokens are left
        as they were in `out` (uninitialised when `out` is None). Writes only `out`."""
        self.check_call(
            query,
            kv_cache,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            kv_scales=kv_scales,
            sinks=sinks,
        )
        if out is None:
            out = torch.empty_like(query)
        if metadata.num_actual_tokens == 0 or metadata.num_reqs == 0:
            return out
        choice = self._call_choice(query, kv_cache, metadata, sliding_window, logit_softcap)
        if choice.launch is None:
            return self._triton_backend().forward(
                query, kv_cache, metadata, scale=scale, sliding_window=sliding_window,
                logit_softcap=logit_softcap, out=out, kv_scales=kv_scales, new_key=new_key,
                new_value=new_value,
            )  # fmt: skip
        self.run_decode(
            choice.launch, out, query, kv_cache, metadata, scale=scale, sliding_window=sliding_window,
            logit_softcap=logit_softcap, kv_scales=kv_scales,
        )  # fmt: skip
        return out

    def _call_choice(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> KernelChoice:
        """What `forward` runs for this call: `choose` for CUDA tensors the decode kernels' 16-byte
        loads can read, Triton for the rest. Host-only; mutates only the decision cache."""
        if query.device.type != "cuda" or vector_load_problem(query, kv_cache) is not None:
            return KernelChoice("triton", "", None)
        _, num_q_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        shape = BatchShape(
            num_seqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=query.dtype,
            block_size=block_size,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
        return self.choose(shape, query.device)

    def compile_key(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]
        kv_scales: KVCacheScales | None = None,
        new_key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]
        new_value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]
        sinks: torch.Tensor | None = None,  # undeclared: refused by `check_call`
    ) -> frozenset[Hashable] | None:
        """API 1.9: what `forward` would compile for this call. A CUDA decode batch needs the
        NVRTC module of its launch (`decode_variant`: the decode kernel's compile-time defines;
        partition counts and sizes are run-time arguments, so every v2 launch of one shape class
        shares a module); everything else is the Triton backend's `compile_key`. None for a
        subclass that launches differently (overrides `forward` without overriding this).
        Host-only; mutates only the decision caches."""
        if type(self).forward is not CudaPagedAttentionBackend.forward:
            return None
        self.check_call(
            query,
            kv_cache,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            kv_scales=kv_scales,
            sinks=sinks,
        )
        if metadata.num_actual_tokens == 0 or metadata.num_reqs == 0:
            return frozenset()
        choice = self._call_choice(query, kv_cache, metadata, sliding_window, logit_softcap)
        if choice.launch is None:
            return self._triton_backend().compile_key(
                query, kv_cache, metadata, scale=scale, sliding_window=sliding_window,
                logit_softcap=logit_softcap, out=out, kv_scales=kv_scales, new_key=new_key,
                new_value=new_value,
            )  # fmt: skip
        _, _, block_size, _, head_size = kv_cache.shape
        source = decode_source(query.dtype, head_size, block_size, choice.launch, kv_cache.dtype)
        return frozenset({decode_variant(source, query.device)})

    def run_decode(
        self,
        launch: LaunchShape,
        out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
    ) -> None:
        """Check the layout (once per layout signature) and launch the CUDA decode kernel `launch`
        describes. Writes `out`; mutates only the set of validated signatures."""
        args = (out, query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc)
        # The full contract check costs ~28 us on an H100 host, paid per layer per step; the tensors'
        # layout signature (~1 us per tensor) repeats across layers, so each layout is checked once.
        signature = (metadata.num_reqs, launch, *map(_layout_of, args))
        if signature not in self._validated:
            check_decode_layout(*args, metadata.num_reqs, launch)
            if len(self._validated) >= MAX_CACHED_CHOICES:
                self._validated.clear()
            self._validated.add(signature)
        launch_decode(
            *args, num_seqs=metadata.num_reqs, scale=scale, sliding_window=sliding_window,
            logit_softcap=logit_softcap, launch=launch, kv_scales=kv_scales,
        )  # fmt: skip
