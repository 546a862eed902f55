"""The data contract between pagedserve's core and its platform plugins.

Everything a plugin returns from a hook is one of the types below. Changing any of them in a way
that breaks an existing plugin is an API break: bump `PLUGIN_API_VERSION`'s major number. Adding
an optional field or a new hook is a minor bump.

KV-cache layout (the only one in API 1.x, `KVCacheLayout.NHD`): each attention layer owns one tensor

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]

where index 0 holds keys and index 1 holds values. Token `t` of a request lives in physical block
`block_table[req, t // block_size]` at offset `t % block_size`; its *slot* is
`block_id * block_size + offset`.

FP8 KV caches (API 1.1): the cache tensor may have an FP8 dtype (`torch.float8_e4m3fn`,
`torch.float8_e5m2`, or the `fnuz` variants of AMD GPUs) while the model computes in its own
dtype. Each layer then has `KVCacheScales`: `reshape_and_cache` stores `fp8(clamp(x / scale))`
(keys with `k_scale`, values with `v_scale`, round to nearest even, clamped to the dtype's finite
range) and attention reads `stored * scale`. A backend opts in by listing the FP8 dtypes it reads
in `AttentionCapabilities.kv_cache_dtypes`; the core passes `kv_scales=` only for FP8 caches, so
a plugin written for API 1.0 is never called with it.

Linear kernels (API 1.2): a platform may run the matrix products of a model's linear layers itself
(`LinearKernel`, hook `pagedserve_linear_kernel`); the core then routes every linear layer of the
decoder through its operator, which must compute `x @ (weight * scale[:, None]).T + bias` for any
number of rows.

Fused gated activation (API 1.3): `LinearKernel.silu_gate_op`, optional, computes a SiLU-gated
MLP's activation `silu(gate) * up` straight from its input and fused gate/up weight, so a
platform whose GEMM can apply it in its epilogue faster than a separate kernel may do so.

Programmatic dependent launches (API 1.4): `LinearKernel.dependent_op`, optional, is `op` with its
kernels launched so that each may start while the previous kernel on the stream drains (NVIDIA
sm_90+), waiting on the device before it touches memory. The engine uses it when
`EngineArgs.programmatic_launch` is on (the default), and launches the compiled forward's kernels
the same way. `LinearKernel.dependent_silu_gate_op` (API 1.5), optional, is `silu_gate_op`
launched that way.

Programmatic launches of attention and cache writes (API 1.6): `AttentionBackend` and `CacheOps`
have an optional `enable_programmatic_launch(max_tokens)`. With `EngineArgs.programmatic_launch`
on, the engine asks both once, before the first step, to launch the kernels of steps of at most
`max_tokens` tokens that way too, so that a decode step's chain of kernels is programmatic from
one product to the next. The default answers False and changes nothing.

The step's own keys and values (API 1.7): `AttentionBackend.enable_new_kv_reads()`, optional. With
`EngineArgs.attention_reads_new_kv` on, the engine asks once, before the first step; a backend
that answers True is passed `new_key` and `new_value` (the keys and values `reshape_and_cache` has
just written, as the projections made them) on every `forward` over an unquantized cache, and may
read the new tokens' keys and values from them instead of the cache: contiguous rows that a
prefill kernel can stream with the GPU's bulk-copy engine. The default answers False, and the
keywords are then never passed.

Determinism and exact float32 (API 1.8): `AttentionCapabilities.deterministic` promises that
`forward` gives bit-identical outputs when called twice on the same inputs, and
`AttentionCapabilities.exact_float32` that float32 inputs are computed in float32 (no TF32 dot
products). Both default to False; the conformance kit then checks them (every case run twice;
float32 cases judged by a tolerance 250 times tighter).

Compile keys (API 1.9): `AttentionBackend.compile_key`, optional, names the compiled kernel
variants (a Triton specialisation, an NVRTC module, ...) that `forward` would launch for a call,
without launching. The engine's start-up warm-up runs a sweep of batch shapes so that no kernel
compiles while serving; with keys it runs only the calls that need a variant no earlier call
launched. The default (`None`) keeps the whole sweep.

Full-graph plans (API 1.2): `AttentionBackend.full_graph_key` tells the engine what a backend's
launches for a batch depend on besides tensor addresses (its plan: kernel, grid, split count), for
one layer shape (`AttentionLayerShape`). Full decode graphs are captured once per padded request
count and per distinct key over a ladder of `max_seq_len` bounds, so a batch of short sequences
replays a graph planned for short sequences. The default (`None`) says the launches do not change
with `max_seq_len`: one graph per padded size, as with API 1.1.
Full graphs of mixed steps (API 1.10): `AttentionBackend.supports_full_cuda_graph_mixed` promises
that a whole-forward graph captured for a batch of `num_actual_tokens` tokens, `num_reqs`
requests and a `max_query_len` bound replays correctly any batch with at most as many tokens and
requests and queries no longer than the bound: prefill chunks beside decodes, not only decode
batches. With it, `cudagraph_mode="full"` replays such steps as one graph each. The default
(False) keeps them on piecewise graphs.
Parallel start-up JIT (API 1.11): `AttentionBackend.concurrent_batches` promises that calls for
different batches (different metadata objects) may run `forward` on several host threads at once.
The start-up sweep then runs its calls on a pool of threads, beside the forward's compilation, so
the kernel variants compile in parallel. The default (False) keeps one thread, after the compile.

Batched LoRA (API 1.12): a platform may add the deltas of many LoRA adapters to a linear layer's
output in one operator (`LoRAKernel`, hook `pagedserve_lora_kernel`): every token with its own
request's adapter, tokens of several adapters in one step. The engine calls it behind every wrapped
linear layer when `EngineArgs.enable_lora` is on, in eager steps, compiled forwards and CUDA graphs
alike. No answer: the core's torch formulation (`pagedserve.lora.reference`), which computes every
slot for every token and masks.

Fused mixture-of-experts (API 1.13): a platform may run a sparse MoE block's experts in one
operator (`MoEKernel`, hook `pagedserve_moe_kernel`): from the router's logits to the weighted sum
of each token's top-k experts (`MoERouting` says how the logits choose them, `ExpertWeights`
holds the stacked expert matrices). The engine calls it in every MoE layer, in eager steps,
compiled forwards and CUDA graphs alike. No answer: the core's torch formulation
(`pagedserve.moe.reference`), which gathers each expert's tokens on the host's schedule and so
suits CPUs, not graph capture.

Integer-weight linear layers (API 1.14): a platform may run the products of linear layers whose
weights a quantized checkpoint stores as 4- or 8-bit integer codes with per-group scales and zero
points (`IntLinearKernel`, hook `pagedserve_int_linear_kernel`; the weights as `PackedIntWeight`),
reading the codes instead of a dense copy. The engine calls it for every such layer it takes, in
eager steps, compiled forwards and CUDA graphs alike. No answer: the core's dequantize-then-multiply
formulation (`pagedserve.quantization.int_linear`).

Attention sinks (API 1.13): a layer may add one learned logit per query head, its *sink*, to every
softmax denominator (gpt-oss, on sliding-window and full layers alike). For query row q of head h
whose visible scores are s_j (after the scale, the softcap and the causal and window masks), with
the sink logit `sinks[h]` taken as it is (neither scaled nor softcapped):

    m = max(max_j s_j, sinks[h]);  out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m))

The sink takes probability mass but has no value, exactly once per row however a kernel splits
the keys. A backend opts in with `AttentionCapabilities.attention_sinks`; the core then passes
`sinks=` (a contiguous float32 tensor [num_q_heads] of finite values, on the query's device) to
`forward` and `compile_key` of exactly the layers that have sinks, so a plugin written for an
older API is never called with it, and refuses a model with sinks on a platform none of whose
backends declares them.

Cascade attention (API 1.16): when every request of a step shares a long prefix of its context
(`CascadeMetadata`, on `AttentionMetadata.cascade`), the engine may attend to that prefix once for
all the step's queries and to each request's own suffix apart, then merge the two partial results
with their log-sum-exp (`attention_states`). A backend opts in with
`AttentionCapabilities.cascade_attention` and implements `prefix_attention`, `suffix_attention`
and `merge_attention_states`; the engine calls them instead of `forward` on such steps (no
sliding window, no sinks, unquantized caches only: it never asks for those). The defaults raise
`UnsupportedCase`, and a backend that does not declare it never sees a cascade step.

Import paths (API 1.15): the contract's types live under `pagedserve.platforms`, which imports
nothing above it: `AttentionMetadata` in `platforms.attention_metadata`, the KV-cache dtypes and
the reference FP8 quantization of cache writes in `platforms.kv_cache_dtype`. Their older paths
(`pagedserve.attention.metadata`, `pagedserve.attention.kv_cache_dtype`) stay importable.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.attention_states import AttentionState

PLUGIN_API_VERSION = "1.16"
"""The plugin API this build of pagedserve implements. Plugins declare the version they were written
against as a module attribute `PAGEDSERVE_PLUGIN_API = "1.16"`; a plugin is accepted when its major
number equals ours and its minor number is not newer than ours."""


@dataclass(frozen=True, slots=True)
class KVCacheScales:
    """Dequantization scales of one layer's FP8 KV cache (one per tensor): a stored key `s` means
    `s * k_scale`, a stored value `s * v_scale`. Both positive and finite."""

    k_scale: float
    v_scale: float

    def __post_init__(self) -> None:
        for name, value in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"KVCacheScales.{name} must be positive and finite, got {value}")


class KVCacheLayout(enum.Enum):
    """Physical layout of one layer's KV cache (see the module docstring)."""

    NHD = "NHD"  # [2, num_blocks, block_size, num_kv_heads, head_size]


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether a platform can run on this machine, and why (not)."""

    available: bool
    reason: str  # "NVIDIA H100 80GB HBM3 (sm_90)" when available; what is missing when not


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    """One platform, as a plugin registers it through `pagedserve_platforms`."""

    name: str  # unique across all plugins; what users pass as `platform=`
    priority: int  # automatic selection takes the highest-priority available platform
    device_type: str  # torch device type the platform's tensors live on: "cpu", "cuda", ...
    supported_dtypes: tuple[torch.dtype, ...]  # model/KV dtypes the platform computes in
    is_available: Callable[[], Availability]  # cheap, must not raise; called at most once per process
    description: str = ""


@dataclass(frozen=True, slots=True)
class AttentionCapabilities:
    """What an attention backend promises to compute correctly. The conformance suite checks every
    declared combination against cpu_reference; anything undeclared must raise `UnsupportedCase`."""

    head_sizes: frozenset[int]
    dtypes: frozenset[torch.dtype]
    block_sizes: frozenset[int]
    kv_cache_layout: KVCacheLayout = KVCacheLayout.NHD
    sliding_window: bool = False
    logit_softcap: bool = False
    max_query_len: int | None = None  # None: any number of new tokens per request (prefill included)
    # FP8 dtypes the backend reads as a quantized KV cache (with `KVCacheScales`), besides caches in
    # the query's dtype. Empty: the cache must have the query's dtype. (API 1.1)
    kv_cache_dtypes: frozenset[torch.dtype] = frozenset()
    # API 1.8. True promises determinism: `forward` called twice on the same inputs (same batch,
    # same tensors) writes and returns bit-identical outputs, whatever the batch holds (no atomics
    # or reduction orders that change from run to run). Default False: nothing promised.
    deterministic: bool = False
    # API 1.8. True promises that float32 queries are computed in float32 throughout (no TF32 or
    # lower-precision dot products), so the conformance kit judges float32 cases by the tighter
    # `EXACT_FLOAT32_TOLERANCE`. Default False: TF32 is allowed.
    exact_float32: bool = False
    # API 1.13. True: `forward` and `compile_key` take `sinks=` (one logit per query head added to
    # each softmax denominator, module docstring) and compute it. Default False: the core never
    # passes it, and `check_supported(attention_sinks=True)` raises `UnsupportedCase`.
    attention_sinks: bool = False
    # API 1.16. True: `prefix_attention`, `suffix_attention` and `merge_attention_states` compute
    # cascade steps (module docstring) for every declared head size, dtype and block size, with
    # or without a softcap, over caches in the query's dtype. Default False: the engine never
    # cascades on this backend.
    cascade_attention: bool = False


# (x [M, K], weight [N, K] in x's dtype or FP8, scale [N] float32 or None, bias [N] or None) -> [M, N]
LinearOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LinearKernel:
    """The matrix products of a model's linear layers, run by a platform (API 1.2).

    `op(x, weight, scale, bias)` returns `x @ (weight.to(x.dtype) * scale[:, None]).T + bias` for
    any number of rows M (scale and bias may be None). It must be a torch operator that
    `torch.compile` keeps opaque (a `torch.library.custom_op` with a fake implementation), must not
    sync, and may be recorded in CUDA graphs. FP8 weights (`float8_e4m3fn`, per-output-channel
    `scale`) arrive only when `torch.float8_e4m3fn` is in `weight_dtypes`; for them the operator
    computes what `pagedserve.models.fp8.scaled_linear` does for the rows it does not take itself
    (calling it is the simplest way)."""

    name: str  # for logs, e.g. "triton skinny GEMM (steps of <= 16 tokens; torch above)"
    op: LinearOp
    weight_dtypes: frozenset[torch.dtype]  # weight dtypes `op` takes besides the activation's
    # Optional: `gated_op(h, weight, scale, bias)` = `op(silu(h[:, :K]) * h[:, K:], weight, scale,
    # bias)` for a gated MLP's down projection, `h` [M, 2K] its fused gate/up output; silu and the
    # product computed in float32 and rounded once to h's dtype. None: the model computes it.
    gated_op: LinearOp | None = None
    # Optional (API 1.3): `silu_gate_op(x, weight, scale, bias)` = `silu(gate) * up` where
    # [gate | up] = `op(x, weight, scale, bias)` for a gated MLP's fused gate/up weight [2I, K]
    # (gate rows first); gate and up rounded to x's dtype, the product computed in float32 and
    # rounded once. Returns [M, I]. Used instead of `gated_op` when a kernel offers both.
    # None: the model computes it.
    silu_gate_op: LinearOp | None = None
    # Optional (API 1.4): `op` with its kernels launched as programmatic dependent launches where
    # the device has them (NVIDIA sm_90+; plainly elsewhere): each kernel may start while the
    # previous one on the stream drains and waits for it on the device (`griddepcontrol.wait`)
    # before its first memory access, and lets the next one launch only after that wait. Used
    # instead of `op` when `EngineArgs.programmatic_launch` is on. None: `op` everywhere.
    dependent_op: LinearOp | None = None
    # Optional (API 1.5): `silu_gate_op` launched the way `dependent_op` launches `op`; used
    # instead of it when `EngineArgs.programmatic_launch` is on. None: `silu_gate_op` everywhere.
    dependent_silu_gate_op: LinearOp | None = None


# (y [M, N], x [M, K], lora_a [S, R, K], lora_b [S, N, R], token_slots [T >= M] int32,
#  token_order [T] int32, slot_starts [S + 1] int32) -> None; adds the LoRA deltas into y
LoRAOp = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]


@dataclass(frozen=True, slots=True)
class LoRAKernel:
    """The deltas of many LoRA adapters on one linear layer, for a batch that mixes them (API 1.12).

    `op(y, x, lora_a, lora_b, token_slots, token_order, slot_starts)` adds, in place, to every row
    `t` of `y` whose token has an adapter slot `s = token_slots[t] >= 0`:

        y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T

    and leaves the other rows of `y` untouched (bit for bit). The same tokens, grouped: slot `s`'s
    tokens are `token_order[slot_starts[s]:slot_starts[s + 1]]` (ascending within a slot; slots in
    order, so `slot_starts` is non-decreasing, starts at 0 and ends at the number of tokens with an
    adapter). A kernel reads whichever of the two forms suits it; both describe the same step.
    `token_slots` and `token_order` may be longer than `y` has rows (fixed-size buffers): only the
    first M entries of `token_slots` and the first `slot_starts[S]` of `token_order` count, and the
    latter are < M. `x`, `y`: the activation dtype; `lora_a`, `lora_b`: the same dtype, contiguous;
    products accumulate in float32 (the intermediate `x @ A.T` may be rounded to the dtype once).

    It must not sync (it reads the mapping on the device), may allocate only within the call, and
    must be recordable in a CUDA graph and replayable for any mapping of the same shapes; it must
    be a torch operator that `torch.compile` keeps opaque (a `torch.library.custom_op` that
    declares `y` mutated) or plain torch code that dynamo traces."""

    name: str  # for logs, e.g. "triton segmented LoRA (shrink + expand)"
    op: LoRAOp


# How a gated expert turns its fused gate/up product [gate | up] into the down projection's input:
#   "silu": silu(gate) * up (Qwen-MoE, Mixtral);
#   "swiglu_limit": gate = min(gate, limit), up = clamp(up, -limit, limit),
#                   (up + 1) * gate * sigmoid(1.702 * gate) (gpt-oss; `MoERouting.swiglu_limit`).
MoEActivation = Literal["silu", "swiglu_limit"]


@dataclass(frozen=True, slots=True)
class MoERouting:
    """How a router's logits pick each token's experts and weigh them (API 1.13).

    "softmax_topk" (Qwen-MoE, Mixtral): p = softmax(logits) over every expert in float32; the
    `top_k` largest p, divided by their sum when `renormalize`. "topk_softmax" (gpt-oss): the `top_k`
    largest logits, then a softmax over those k (`renormalize` changes nothing). Ties go to the
    lower expert index, so every platform picks the same experts for the same logits."""

    top_k: int
    scoring: Literal["softmax_topk", "topk_softmax"]
    renormalize: bool
    activation: MoEActivation = "silu"
    swiglu_limit: float | None = None  # "swiglu_limit" only: the clamp bound (gpt-oss: 7.0)

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"MoERouting.top_k must be >= 1, got {self.top_k}")
        if (self.activation == "swiglu_limit") != (self.swiglu_limit is not None):
            raise ValueError("MoERouting.swiglu_limit is set exactly when activation='swiglu_limit'")


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One MoE layer's experts, stacked (API 1.13). E experts, hidden size H, this rank's
    intermediate size I (a tensor-parallel rank holds a slice of every expert's I; the caller sums
    the ranks' outputs). Matrices are contiguous, in the activation dtype or, when the kernel lists
    it in `MoEKernel.weight_dtypes`, `torch.float8_e4m3fn` with per-output-channel scales."""

    w13: torch.Tensor  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor  # [E, H, I]
    w13_scale: torch.Tensor | None = None  # [E, 2I] float32, FP8 w13 only: w13[e, n, :] * scale[e, n]
    w2_scale: torch.Tensor | None = None  # [E, H] float32, FP8 w2 only
    w13_bias: torch.Tensor | None = None  # [E, 2I] activation dtype (gpt-oss), added before the activation
    w2_bias: torch.Tensor | None = None  # [E, H] activation dtype (gpt-oss), added before the weighting

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def intermediate_size(self) -> int:
        return int(self.w2.shape[2])


# (x [M, H], router_logits [M, E] float32 or x's dtype (`logits_in_model_dtype`), experts, routing)
# -> [M, H] in x's dtype
MoEOp = Callable[[torch.Tensor, torch.Tensor, ExpertWeights, MoERouting], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MoEKernel:
    """A sparse mixture-of-experts block's experts in one operator (API 1.13).

    `op(x, router_logits, experts, routing)` returns, for every row t of x:

        out[t] = sum over the k experts e that `routing` picks from router_logits[t], with weight w:
                 w * (down_e(act(gate_up_e(x[t]))))

    where gate_up_e(v) = w13[e] @ v (+ w13_bias[e]), act is `routing.activation` computed in float32
    and rounded to x's dtype once, down_e(h) = w2[e] @ h (+ w2_bias[e]); products accumulate in
    float32 and the weighted sum is rounded to x's dtype once. Row t depends on row t alone: rows
    past the step's tokens (a CUDA graph's padding, any values, NaN included) change no other row.

    It must not sync (routing, grouping tokens by expert and sizing work happen on the device),
    may allocate only within the call, and must be recordable in a CUDA graph and replayable for
    any routing of the same shapes; it must be a torch operator that `torch.compile` keeps opaque
    (a `torch.library.custom_op`) or torch code that dynamo traces."""

    name: str  # for logs, e.g. "triton fused MoE (device top-k, sorted grouped GEMMs)"
    op: MoEOp
    weight_dtypes: frozenset[torch.dtype]  # expert dtypes `op` takes besides the activation's (FP8)
    activations: frozenset[str] = frozenset({"silu"})  # the `MoEActivation`s it computes
    # API 1.15. True: `op` takes `router_logits` in x's dtype (the router's output) and routes on
    # their float32 values itself; False: the engine casts them to float32 first, one more
    # launch a layer.
    logits_in_model_dtype: bool = False


@dataclass(frozen=True, slots=True)
class PackedIntWeight:
    """One linear layer's integer weight (API 1.14), N outputs and K inputs:

        w[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]

    with q the signed `bits`-bit code (zeros 0 when `zeros` is None)."""

    packed: torch.Tensor  # [N, ceil(K * bits / 32)] int32: code i in bits [i*bits, (i+1)*bits), + 2**(bits-1)
    scales: torch.Tensor  # [N, ceil(K / group_size)] float32
    zeros: torch.Tensor | None  # [N, ceil(K / group_size)] int8, signed like q; None: symmetric
    bits: int  # 4 or 8
    group_size: int  # inputs per scale (K for one scale per output channel)
    in_features: int  # K


# (x [M, K], weight, bias [N] or None) -> [M, N] in x's dtype
IntLinearOp = Callable[[torch.Tensor, PackedIntWeight, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class IntLinearKernel:
    """The products of linear layers with integer weights (API 1.14).

    `op(x, weight, bias)` returns `x @ W.T + bias` for any number of rows M, where W is `weight`
    dequantized exactly (`PackedIntWeight`'s formula in float32) and rounded once to x's dtype;
    products accumulate in float32 and the result is rounded to x's dtype once. Row m depends on
    row m of x alone (a CUDA graph's padding rows change no other row). It must not sync, may
    allocate only within the call, must be recordable in CUDA graphs, and must be a torch operator
    `torch.compile` keeps opaque (a `torch.library.custom_op`) or torch code dynamo traces. The
    engine passes it only weights whose `bits` it lists and whose `group_size` is K or a multiple
    of `group_multiple`."""

    name: str  # for logs, e.g. "triton int4/int8 weight GEMM"
    op: IntLinearOp
    bits: frozenset[int]  # code widths it takes (of 4, 8)
    group_multiple: int = 1  # group sizes it takes besides K: the multiples of this

    def takes(self, weight: PackedIntWeight) -> bool:
        """Whether `op` computes `weight` (its width and group size). Pure."""
        size = weight.group_size
        return weight.bits in self.bits and (size == weight.in_features or size % self.group_multiple == 0)


@dataclass(frozen=True, slots=True)
class AttentionLayerShape:
    """What an attention backend sees of one layer besides the batch and tensor addresses: the
    shapes and dtypes of its query and KV cache, its device and its options (API 1.2). A model
    has one per distinct (sliding window, softcap) of its layers."""

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype  # the queries' (the model's compute dtype)
    kv_cache_dtype: torch.dtype  # `dtype`, or the FP8 dtype of a quantized cache
    device: torch.device
    sliding_window: int | None = None  # None: the layer attends to the whole context
    logit_softcap: float | None = None  # None: no softcap
    attention_sinks: bool = False  # API 1.13: the layer passes `sinks=` (one logit per query head)


class UnsupportedCase(ValueError):
    """Raised by a backend asked for something outside its declared capabilities."""


class AttentionBackend(ABC):
    """A paged attention implementation for V1 batches.

    One call computes attention for a flattened batch of requests: request `i` owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`, which are the *last* `query_len` of its `seq_len`
    tokens (chunked prefill and decode are the same case: cached context plus new tokens). The new
    tokens' keys and values are already in the cache (the caller runs `reshape_and_cache` first).
    Attention is causal: query row `j` of request `i` (absolute position `seq_len - query_len + j`)
    sees key positions `<= ` its own, and with a sliding window `W` only the last `W` of those
    (keys in `[p - W + 1, p]` for a query at position `p`).

    The host constructs a backend with no arguments, once per engine, and calls it from one thread
    (a backend that declares `concurrent_batches` excepted, during the start-up sweep); a backend
    reads its launch parameters (tuned configs) and grid order itself at construction.
    """

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]
    # API 1.1. True promises that `forward` can be recorded whole in a CUDA graph and replayed for
    # other batches of the same padded size (full decode graphs, `pagedserve.worker.graphs.full_cuda_graphs`):
    # its kernels, grids and scalar arguments depend only on the metadata's host fields
    # (`num_reqs`, `num_actual_tokens`, `max_query_len`, `max_seq_len`) and on tensor layouts,
    # never on values it would read back from the device; it does not sync; every device tensor
    # it allocates is used within the call; and it stays correct when `max_seq_len` is only an
    # upper bound of the real sequence lengths. Padding requests (query length 0, `seq_len` 0, at
    # the end of the batch) attend to nothing and write no real token's output row.
    supports_full_cuda_graph: ClassVar[bool] = False
    # API 1.10. True promises, on top of `supports_full_cuda_graph`, that `max_query_len` too may be
    # only an upper bound: the launches recorded for `num_actual_tokens` tokens, `num_reqs`
    # requests and a `max_query_len` bound serve any batch with at most that many tokens and
    # requests and queries no longer than the bound (padding tokens past the last request's query
    # belong to no request, and no kernel writes their output rows with anything a real row reads).
    # Full graphs of mixed steps (`pagedserve.worker.graphs.full_mixed_graphs`) need it.
    supports_full_cuda_graph_mixed: ClassVar[bool] = False
    # API 1.11. True promises that `forward` may run on several host threads at once for calls of
    # different batches (distinct metadata objects), each thread's current CUDA device being the
    # tensors'; calls that share a metadata object (the layers of one step) still come from one
    # thread, in order. The engine's start-up sweep (`pagedserve.worker.startup.attention_sweep`)
    # then runs its calls on a thread pool beside the forward's compilation, so their JIT compiles
    # (Triton, NVRTC: native code that leaves Python's lock) run in parallel.
    concurrent_batches: ClassVar[bool] = False

    def full_graph_key(self, metadata: AttentionMetadata, layer: AttentionLayerShape) -> Hashable | None:
        """API 1.2. What this backend's launches for `metadata` on a layer of shape `layer` depend
        on besides tensor addresses (its plan: kernels, grids, split counts), as a hashable value:
        two batches with equal keys get the same launches. Only the metadata's host fields are
        read; they are those a full decode graph is captured with (`num_reqs` the padded size,
        `max_seq_len` an upper bound of the real sequences). The engine captures one graph per
        padded size and distinct key over a ladder of `max_seq_len` bounds, each at the largest
        bound of its key, and replays the one planned for the smallest bound that holds the
        step (`pagedserve.worker.graphs.full_cuda_graphs`).

        The default, None, means the launches do not change with `max_seq_len`: one graph per
        padded size, planned for `max_model_len`. Host-only (no device sync); may fill the
        backend's caches. Meaningful only with `supports_full_cuda_graph`."""
        return None

    def enable_programmatic_launch(self, max_tokens: int) -> bool:
        """API 1.6. Launch the kernels of steps of at most `max_tokens` tokens as programmatic
        dependent launches where the device has them (NVIDIA sm_90+), as `LinearKernel.dependent_op`
        does: each waits on the device for the previous kernel before its first memory access and
        lets the next one launch only after that wait. Called at most once, before the first step,
        when `EngineArgs.programmatic_launch` is on. Returns whether the backend will; the default
        returns False and changes nothing."""
        return False

    def enable_new_kv_reads(self) -> bool:
        """API 1.7. Take this step's new keys and values as `forward`'s `new_key` and `new_value`
        from now on (the module docstring says when they are passed). Called at most once, before
        the first step, when `EngineArgs.attention_reads_new_kv` is on. Returns whether the backend
        wants them; the default returns False and changes nothing."""
        return False

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
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32; API 1.13, only when declared
    ) -> frozenset[Hashable] | None:
        """API 1.9. The compiled kernel variants `forward` would launch for exactly this call (the
        same arguments), one hashable value per variant: whatever the backend's JIT compiles
        separately (a Triton kernel's constexprs, integer and pointer specialisations and launch
        options; an NVRTC module's source and defines). The promise: once calls launching a
        variant have run, a call whose variants are all among them compiles and loads nothing.
        An empty set: `forward` launches nothing. The engine's start-up warm-up
        (`pagedserve.worker.startup.attention_sweep`) runs only the calls of its sweep that need a variant no
        earlier call did.

        Host-only: reads the metadata's host fields and the tensors' layouts (shapes, strides,
        dtypes, devices, address alignment), never their contents; launches, allocates on the
        device and syncs nothing. May raise what `forward` would raise for the call. The default,
        None, means "not known": the warm-up then runs every call of its sweep."""
        return None

    def prefix_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,  # with `cascade` set
        *,
        scale: float,
        sliding_window: int | None = None,  # never computed: a backend raises UnsupportedCase
        logit_softcap: float | None = None,
    ) -> AttentionState:
        """API 1.16. Every query row of the step (the first `num_actual_tokens`) attended to the
        shared prefix `[0, metadata.cascade.prefix_len)` alone, with no mask (every query sits past
        it): each row's softmax-weighted prefix values and the log-sum-exp of its prefix scores
        (`attention_states.AttentionState`, float32; rows past `num_actual_tokens` unspecified).
        Raises `UnsupportedCase` when the backend does not declare `cascade_attention`, and for a
        sliding window (the window may cut into the prefix, which the split cannot express). Does
        not mutate `kv_cache`."""
        raise UnsupportedCase(f"{self.name}: cascade attention is not supported")

    def suffix_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,  # with `cascade` set
        *,
        scale: float,
        sliding_window: int | None = None,  # never computed: a backend raises UnsupportedCase
        logit_softcap: float | None = None,
    ) -> AttentionState:
        """API 1.16. Each request's query rows attended, causally, to its own keys past the prefix,
        positions `[metadata.cascade.prefix_len, seq_len)` read through its block table, as
        `forward` would over those keys alone (every query has at least its own key there). Same
        output form, refusals and promises as `prefix_attention`."""
        raise UnsupportedCase(f"{self.name}: cascade attention is not supported")

    def merge_attention_states(
        self,
        prefix: AttentionState,
        suffix: AttentionState,
        out: torch.Tensor,  # [num_tokens, num_q_heads, head_size] in the query's dtype
    ) -> torch.Tensor:
        """API 1.16. The attention over both parts' keys: `attention_states.merge_states_reference`
        for every row of the states (a row whose parts both have `lse = -inf` merges to zero),
        rounded once to `out`'s dtype, written into `out` and returned. Raises `UnsupportedCase`
        when the backend does not declare `cascade_attention`. Mutates `out` only."""
        raise UnsupportedCase(f"{self.name}: cascade attention is not supported")

    def check_cascade_call(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> int:
        """The checks every `prefix_attention` and `suffix_attention` starts with: the capability,
        no sliding window, an unquantized cache (`UnsupportedCase`), `check_call`'s, and cascade
        metadata whose prefix every request has cached (`ValueError`, from its host fields).
        Returns the prefix length. Does not mutate."""
        if not self.capabilities.cascade_attention:
            raise UnsupportedCase(
                f"{self.name}: cascade attention is not supported (the backend does not declare "
                "AttentionCapabilities.cascade_attention)"
            )
        if sliding_window is not None:
            raise UnsupportedCase(
                f"{self.name}: cascade attention with a sliding window is not defined (the window may "
                "cut into the shared prefix); run the step through forward"
            )
        if kv_cache.dtype != query.dtype:
            raise UnsupportedCase(
                f"{self.name}: cascade attention reads caches in the query's dtype, got a {kv_cache.dtype} "
                f"cache for {query.dtype} queries"
            )
        self.check_call(query, kv_cache, scale=scale, sliding_window=None, logit_softcap=logit_softcap)
        cascade = metadata.cascade
        if cascade is None:
            raise ValueError(f"{self.name}: a cascade call needs metadata.cascade (the shared prefix)")
        n = metadata.num_reqs
        query_lens = metadata.query_start_loc_cpu[: n + 1].diff()
        # Requests with no query are padding (a CUDA graph's capture batch holds only those).
        context = (metadata.seq_lens_cpu[:n] - query_lens)[query_lens > 0]
        shortest = int(context.min()) if context.numel() else cascade.prefix_len
        if cascade.prefix_len < 1 or cascade.prefix_len > shortest:
            raise ValueError(
                f"{self.name}: the cascade prefix of {cascade.prefix_len} tokens must be >= 1 and within "
                f"every request's cached context (the shortest is {shortest})"
            )
        return cascade.prefix_len

    def check_supported(
        self,
        *,
        head_size: int,
        dtype: torch.dtype,
        block_size: int,
        sliding_window: int | None,
        logit_softcap: float | None,
        kv_cache_dtype: torch.dtype | None = None,  # None: the cache has `dtype`
        attention_sinks: bool = False,  # API 1.13: the layer has a sink logit per query head
    ) -> None:
        """Raise `UnsupportedCase` naming the first undeclared property. Does not mutate."""
        caps = self.capabilities
        if head_size not in caps.head_sizes:
            raise UnsupportedCase(
                f"{self.name}: head_size={head_size} is not supported; supported: {sorted(caps.head_sizes)}"
            )
        if dtype not in caps.dtypes:
            raise UnsupportedCase(
                f"{self.name}: dtype={dtype} is not supported; supported: {sorted(map(str, caps.dtypes))}"
            )
        if block_size not in caps.block_sizes:
            supported = sorted(caps.block_sizes)
            raise UnsupportedCase(
                f"{self.name}: block_size={block_size} is not supported; supported: {supported}"
            )
        if sliding_window is not None and not caps.sliding_window:
            raise UnsupportedCase(f"{self.name}: sliding window attention is not supported")
        if logit_softcap is not None and not caps.logit_softcap:
            raise UnsupportedCase(f"{self.name}: logit softcap is not supported")
        if (
            kv_cache_dtype is not None
            and kv_cache_dtype != dtype
            and kv_cache_dtype not in caps.kv_cache_dtypes
        ):
            readable = sorted(map(str, caps.kv_cache_dtypes)) or "none"
            raise UnsupportedCase(
                f"{self.name}: kv_cache dtype {kv_cache_dtype} is not supported with {dtype} queries; "
                f"quantized KV-cache dtypes it reads: {readable}"
            )
        if attention_sinks and not caps.attention_sinks:
            raise UnsupportedCase(
                f"{self.name}: attention sinks are not supported (the backend does not declare "
                "AttentionCapabilities.attention_sinks)"
            )

    def check_call(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        *,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        kv_scales: KVCacheScales | None = None,
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32; API 1.13
    ) -> None:
        """The checks every `forward` starts with, whatever the hardware: tensor ranks (`ValueError`),
        the declared capabilities (`UnsupportedCase`), the options' values, the presence of
        `kv_scales` exactly for a quantized cache and the layout of `sinks` (`ValueError`). Reads
        only tensor metadata (no device sync). Does not mutate."""
        if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(
                f"{self.name}: query must be [num_tokens, num_q_heads, head_size] (got shape "
                f"{tuple(query.shape)}) and kv_cache [2, num_blocks, block_size, num_kv_heads, head_size] "
                f"(got {tuple(kv_cache.shape)})"
            )
        quantized = kv_cache.dtype != query.dtype
        # The keywords only when they matter: backends of API 1.0 may override check_supported
        # without them, and they never see a quantized cache or sinks.
        extra: dict[str, Any] = {"kv_cache_dtype": kv_cache.dtype} if quantized else {}
        if sinks is not None:
            extra["attention_sinks"] = True
        self.check_supported(
            head_size=query.shape[2],
            dtype=query.dtype,
            block_size=kv_cache.shape[2],
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            **extra,
        )
        if quantized and kv_scales is None:
            raise ValueError(
                f"{self.name}: the KV cache is {kv_cache.dtype} but the query {query.dtype}: a quantized "
                "cache needs kv_scales=KVCacheScales(k_scale, v_scale)"
            )
        if not quantized and kv_scales is not None:
            raise ValueError(
                f"{self.name}: kv_scales given for a {kv_cache.dtype} cache that is not quantized "
                "(it has the query's dtype): pass kv_scales only with an FP8 cache"
            )
        if not math.isfinite(scale):
            raise ValueError(f"{self.name}: scale must be finite, got scale={scale}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(
                f"{self.name}: sliding_window must be >= 1 (tokens seen, own included), "
                f"got sliding_window={sliding_window}"
            )
        if logit_softcap is not None and not (logit_softcap > 0 and math.isfinite(logit_softcap)):
            raise ValueError(
                f"{self.name}: logit_softcap must be positive and finite, got logit_softcap={logit_softcap}"
            )
        if sinks is not None and (
            tuple(sinks.shape) != (query.shape[1],)
            or sinks.dtype != torch.float32
            or sinks.device != query.device
            or sinks.stride(0) != 1
        ):
            raise ValueError(
                f"{self.name}: sinks must be a contiguous float32 tensor [num_q_heads={query.shape[1]}] on "
                f"{query.device}, got {sinks.dtype} {tuple(sinks.shape)} with strides {sinks.stride()} "
                f"on {sinks.device}"
            )

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,  # None: attend to the whole context
        logit_softcap: float | None = None,  # None: no softcap; else scores = c * tanh(scores / c)
        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]; written if given
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
        new_key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]; API 1.7
        new_value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]; API 1.7
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32; API 1.13, only when declared
    ) -> torch.Tensor:
        """Return attention output [num_tokens, num_q_heads, head_size] in query's dtype.

        `new_key`/`new_value`, passed only after `enable_new_kv_reads` answered True, hold the
        same values the cache holds for this step's new tokens (row `t` is query row `t`'s token).
        `sinks`, passed only to a backend declaring `attention_sinks` and only for a layer that has
        them, adds head h's sink logit `sinks[h]` to each of its rows' softmax denominators (module
        docstring).
        Rows past `metadata.num_actual_tokens` (padding for CUDA graphs) are left unspecified.
        Does not mutate `kv_cache`; writes only `out`."""


class CacheOps(ABC):
    """The three KV-cache data movements a platform provides. All of them mutate their destination."""

    # API 1.1. True promises that `reshape_and_cache` leaves the rows whose slot is negative
    # unwritten (the padding tokens of full CUDA graphs), without a device sync.
    skips_negative_slots: ClassVar[bool] = False

    def enable_programmatic_launch(self, max_tokens: int) -> bool:
        """API 1.6. `reshape_and_cache` of steps of at most `max_tokens` tokens launched as
        programmatic dependent launches, as `AttentionBackend.enable_programmatic_launch` says.
        Returns whether the cache ops will; the default returns False and changes nothing."""
        return False

    @abstractmethod
    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64; slot = block_id * block_size + offset
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
    ) -> None:
        """Write each token's key and value into its slot. Only the first `len(slot_mapping)` rows
        of key/value are written; slots must be distinct. `key` and `value` may be strided views
        (e.g. slices of a fused qkv projection): only their last dimension is unit-stride. Into an
        FP8 cache (the platform's backends declare it in `kv_cache_dtypes`) each element is stored
        quantized, as the module docstring says. Mutates `kv_cache`."""

    @abstractmethod
    def copy_blocks(
        self,
        kv_caches: list[torch.Tensor],  # one per layer, same layout and device
        block_mapping: torch.Tensor,  # [num_copies, 2] int64: (src_block, dst_block)
    ) -> None:
        """Copy whole blocks (keys and values) within each layer's cache, for copy-on-write.
        Destinations are distinct and never also a source. Mutates `kv_caches`."""

    @abstractmethod
    def swap_blocks(
        self,
        src: torch.Tensor,  # [2, num_src_blocks, block_size, num_kv_heads, head_size]
        dst: torch.Tensor,  # [2, num_dst_blocks, block_size, num_kv_heads, head_size]
        block_mapping: torch.Tensor,  # [num_swaps, 2] int64, on the CPU: (src_block, dst_block)
    ) -> None:
        """Copy blocks between two caches of one layer that may live on different devices (device
        pool <-> CPU swap pool). Mutates `dst`."""


@dataclass(frozen=True, slots=True)
class GridOrder:
    """How a kernel maps its launch-order program id to the tile it computes.

    GPUs that split one chip into several dies with their own L2 (AMD's XCDs) hand consecutive
    program ids to different dies round-robin. Remapping so that tiles sharing KV data land on one
    die keeps that data in one L2. `num_groups == 1` is the identity.
    """

    name: str
    num_groups: int = 1  # dies the hardware deals program ids across (8 XCDs on MI300X)

    def remap(self, pid: int, num_programs: int) -> int:
        """The reference mapping, in plain Python; kernels implement the same arithmetic.

        Program `pid` runs on group `pid % num_groups`. Groups are given contiguous ranges of
        tiles: group g owns tiles [start_g, start_g + size_g), where the first
        `num_programs % num_groups` groups hold one extra tile. Does not mutate."""
        if self.num_groups == 1:
            return pid
        group = pid % self.num_groups
        local = pid // self.num_groups
        per_group, extra = divmod(num_programs, self.num_groups)
        start = group * per_group + min(group, extra)
        return start + local


IDENTITY_GRID_ORDER = GridOrder(name="identity")
