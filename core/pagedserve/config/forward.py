"""How each device runs the model's forward: CUDA graphs and compilation, the platform's own kernels,
and the warm-up before serving.

These options say what is asked for; what a device then builds also depends on the device, the
model and the attention backend, which `worker.graphs.graph_modes.plan_graphs` decides on each device.
`cudagraph_mode` is parsed here once, into `CudaGraphMode`: what each mode asks for is a property of
the mode, so no later reader compares strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

# Steps of 513-2,048 tokens (an offline batch's admission phase) are not large enough for their
# GPU work to hide a layer-by-layer eager launch: on an H200 (8B, 1,000 ShareGPT-like requests)
# they took 42 ms per launch eagerly and 14 ms replayed; output tok/s rose 13% at one GPU, and two
# GPUs gave 1.44x one where they had given 1.11-1.23x (`benchmarks/tp_gpu.py
# --cuda-graph-max-tokens`), for ~1 s more capture. Past 2,048 a step is bound by its matmuls.
DEFAULT_CUDA_GRAPH_MAX_TOKENS = 2048
"""`cuda_graph_max_tokens` when none is given: the largest step replayed as CUDA graphs."""

CudaGraphModeName = Literal["none", "piecewise", "full_decode_only", "full_and_piecewise", "full"]
CompileScope = Literal["layer", "model"]


class CudaGraphMode(enum.Enum):
    """`cudagraph_mode`, with vLLM's names (`worker.graphs.graph_modes` says what each builds)."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"
    FULL = "full"

    @classmethod
    def parse(cls, name: str) -> CudaGraphMode:
        """The mode of that name. Raises ValueError naming every mode for an unknown one."""
        try:
            return cls(name)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"cudagraph_mode={name!r} is not one of {names}") from None

    @property
    def piecewise(self) -> bool:
        """Asks for piecewise graphs (for every step no full graph serves)."""
        return self in (CudaGraphMode.PIECEWISE, CudaGraphMode.FULL_AND_PIECEWISE, CudaGraphMode.FULL)

    @property
    def full_decode(self) -> bool:
        """Asks for full graphs of decode batches."""
        return self in (CudaGraphMode.FULL_DECODE_ONLY, CudaGraphMode.FULL_AND_PIECEWISE, CudaGraphMode.FULL)

    @property
    def full_mixed(self) -> bool:
        """Asks for full graphs of mixed steps too."""
        return self is CudaGraphMode.FULL


@dataclass(frozen=True, slots=True)
class ForwardConfig:
    """The forward's options, as `EngineArgs` gave them (`resolve_engine_config` copies them)."""

    enforce_eager: bool  # no CUDA graphs, no compilation, no kernel warm-up
    cudagraph_mode: CudaGraphMode  # which steps replay CUDA graphs (`worker.graphs.graph_modes`)
    cuda_graph_max_tokens: int  # largest step (tokens) replayed as CUDA graphs
    gpu_compile: bool  # GPUs: the forward's dense parts through torch.compile
    gpu_compile_scope: CompileScope  # one compilation per decoder stretch, or of the whole forward
    cpu_compile: bool  # CPUs: steps of up to 32 tokens through torch.compile
    compile_cache: bool  # with cpu_compile: compiled graphs saved whole and loaded at later starts
    attention_warmup_threads: int | None  # threads of the attention-kernel sweep; None: chosen
    platform_linear: bool  # GPUs: the platform's GEMM for linear layers, where it has one
    programmatic_launch: bool  # NVIDIA sm_90+: kernels set up while the previous one drains
    attention_reads_new_kv: bool  # the backend may read a step's new keys and values directly
    cascade_attention: bool  # steps sharing a long prefix may cascade (`attention.cascade_plan`)

    @property
    def compiles_gpu_forward(self) -> bool:
        """Whether a GPU's forward is compiled, as far as the options go (the device and the model
        may still say no: `worker.graphs.graph_modes.plan_graphs`)."""
        return self.gpu_compile and not self.enforce_eager
