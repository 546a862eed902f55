"""No cold start: compile the forward, JIT the attention kernels and capture the graphs before serving.

Why. Triton and NVRTC compile a kernel the first time a launch needs a new variant (another
split count, another tile configuration, another integer specialisation of the batch geometry),
and `torch.compile` compiles on the first call. Left to the first requests, that work lands inside
the first timed steps: a fresh machine ran its first benchmark at half the speed of a warm one.

What. `build_step_forward` runs, with the time of each in the log, before the runner exists:

1. compile the GPU forward (`gpu_compile`), when the plan says so;
2. run the attention backend (and the cache write) over a sweep of synthetic batches
   (`attention_sweep`): with several threads (`attention_warmup_threads`, for a backend that
   declares `concurrent_batches`), on a thread of its own beside the compile, which never calls
   the backend (its attention is answered by zeros); with one, after the compile, as it was;
3. capture the full decode graphs, then the full mixed-step graphs (`cudagraph_mode="full"`),
   then the piecewise graphs (their capture runs the compiled forward once per graph, which
   compiles anything the sweep missed);

and returns them as the runner's `StepForward`, with what each phase cost (`StartupTimes`).
"""

from __future__ import annotations

import contextlib
import logging
import time

from pagedserve.worker.compile.gpu_compile import GpuCompiledForward
from pagedserve.worker.graphs.cuda_graphs import PiecewiseCudaGraphs
from pagedserve.worker.graphs.full_cuda_graphs import (
    Forward,
    FullDecodeGraphs,
    attention_layer_shapes,
    forward_graph_key,
    seq_len_buckets,
)
from pagedserve.worker.graphs.full_mixed_graphs import FullMixedGraphs, mixed_graph_sizes
from pagedserve.worker.graphs.graph_modes import GraphPlan, StepLimits
from pagedserve.worker.kv_caches import KVCaches
from pagedserve.worker.startup.attention_sweep import (
    AttentionWarmup,
    SweepInBackground,
    attention_warmup_batches,
    warm_up_attention,
)
from pagedserve.worker.startup.device_model import DeviceModel
from pagedserve.worker.startup_times import StartupTimes
from pagedserve.worker.step_forward import StepForward

logger = logging.getLogger(__name__)


def build_step_forward(
    dm: DeviceModel,
    kv: KVCaches,
    plan: GraphPlan,
    limits: StepLimits,
    *,
    attention_warmup_threads: int = 1,  # `attention_sweep.attention_warmup_threads`
    cascade_min_reqs: int | None = None,  # decode sizes >= this get cascade graphs too; None: none
) -> tuple[StepForward, StartupTimes]:
    """Compile, warm up and capture what `plan` asks for over `kv` (module docstring). Call once,
    after the KV cache exists and before the engine takes requests; hand the result to the
    runner. Runs the attention backend on `kv` but leaves its contents alone; slow."""
    compile_s = kernels_s = beside_s = capture_s = 0.0
    model = dm.loaded.model
    device = kv.layers[0].device
    # Compiles at `warm_up`; made first, since every graph below is captured from it.
    compiled = (
        GpuCompiledForward(model, programmatic_launch=plan.programmatic_launch, scope=plan.compile_scope)
        if plan.compile
        else None
    )
    # Before the sweep: which full graphs will be captured decides which plans it must compile.
    full = _full_decode_graphs(dm, kv, compiled, limits, cascade_min_reqs) if plan.full_decode else None
    batches = (
        attention_warmup_batches(
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=limits.max_model_len,
            decode_graphs=full.graphs if full is not None else (),
        )
        if plan.warm_up_kernels
        else []
    )
    sweep = None
    if batches:
        scales = None if kv.scales is None else kv.scales[0]

        def run_sweep() -> AttentionWarmup:
            return warm_up_attention(
                dm.backend,
                dm.cache_ops,
                kv.layers[0],
                dm.loaded.spec,
                batches,
                scales,
                new_kv_reads=dm.new_kv_reads,
                # The runner's block table: its row stride is a kernel argument Triton specialises on.
                block_table_width=_blocks_per_request(kv, limits),
                threads=attention_warmup_threads,
            )

        sweep = SweepInBackground(run_sweep, device)
        if attention_warmup_threads > 1 and compiled is not None:
            sweep.start()
    if compiled is not None:
        try:
            compile_s = compiled.warm_up(kv.layers, dm.backend, dm.cache_ops)
        except BaseException:
            if sweep is not None:
                with contextlib.suppress(Exception):  # the compile's failure is the one to report
                    sweep.finish()
            raise
    swept: AttentionWarmup | None = None
    if sweep is not None:
        swept, kernels_s, beside_s = sweep.finish()
        _log_sweep(swept, len(batches), kernels_s, beside_s, attention_warmup_threads)
    mixed = piecewise = None
    if plan.full_decode or plan.piecewise:
        start = time.perf_counter()
        mixed, piecewise = _capture_graphs(dm, kv, plan, full, compiled, limits)
        capture_s = time.perf_counter() - start
    logger.info(
        "ready to serve (%s): compile %.1f s, attention kernels %.1f s%s, graph capture %.1f s",
        plan.describe(),
        compile_s,
        kernels_s,
        f" (+{beside_s:.1f} s beside the compile)" if beside_s else "",
        capture_s,
    )
    times = StartupTimes(
        compile_s,
        kernels_s,
        capture_s,
        len(batches),
        num_attention_variants=None if swept is None else swept.num_variants,
        num_warmup_calls=0 if swept is None else swept.num_launched,
        kernels_beside_compile_s=beside_s,
    )
    paths = StepForward(model, compiled=compiled, full_decode=full, full_mixed=mixed, piecewise=piecewise)
    return paths, times


def _blocks_per_request(kv: KVCaches, limits: StepLimits) -> int:
    """The width of the runner's block table (`InputBatch`): the blocks of the longest sequence."""
    return -(-limits.max_model_len // kv.block_size)


def _log_sweep(
    swept: AttentionWarmup, num_batches: int, waited_s: float, beside_s: float, threads: int
) -> None:
    where = f"{threads} thread(s)" + (f", {beside_s:.1f} s of it beside the compile" if beside_s else "")
    if swept.num_variants is not None:
        logger.info(
            "attention kernels warmed up: %d variants from %d batch shapes (%d of %d calls run) "
            "in %.1f s (%s)",
            swept.num_variants,
            num_batches,
            swept.num_launched,
            swept.num_calls,
            waited_s + beside_s,
            where,
        )
    else:
        logger.info(
            "attention kernels warmed up on %d batch shapes (the backend names no compile keys: "
            "all %d calls run) in %.1f s",
            num_batches,
            swept.num_launched,
            waited_s + beside_s,
        )


def _full_decode_graphs(
    dm: DeviceModel,
    kv: KVCaches,
    compiled: GpuCompiledForward | None,
    limits: StepLimits,
    cascade_min_reqs: int | None,
) -> FullDecodeGraphs:
    """The full decode graphs the runner will replay, not yet captured: one per padded size of the
    request ladder and per distinct plan of the backend over the sequence-length buckets, run
    from the compiled forward where there is one."""
    device = kv.layers[0].device
    layers = attention_layer_shapes(
        dm.loaded.spec, block_size=kv.block_size, kv_cache_dtype=kv.layers[0].dtype, device=device
    )
    return FullDecodeGraphs(
        compiled if compiled is not None else dm.loaded.model,
        device,
        limits.request_ladder,
        max_blocks_per_req=_blocks_per_request(kv, limits),
        max_seq_len=limits.max_model_len,
        buckets=seq_len_buckets(limits.max_model_len, kv.block_size),
        graph_key=forward_graph_key(dm.backend, layers),
        kv_scales=kv.scales,
        cascade_min_reqs=cascade_min_reqs,
    )


def _capture_graphs(
    dm: DeviceModel,
    kv: KVCaches,
    plan: GraphPlan,
    full: FullDecodeGraphs | None,  # exactly when plan.full_decode
    compiled: GpuCompiledForward | None,
    limits: StepLimits,
) -> tuple[FullMixedGraphs | None, PiecewiseCudaGraphs | None]:
    """Capture `full`, then the mixed-step and piecewise graphs as `plan` asks, from the compiled
    forward where there is one; returns the last two (None: not captured). Slow."""
    caches, backend, cache_ops = kv.layers, dm.backend, dm.cache_ops
    model, device = dm.loaded.model, caches[0].device
    forward: Forward = compiled if compiled is not None else model
    if full is not None:
        full.capture(caches, backend, cache_ops)
    mixed = None
    mixed_sizes = mixed_graph_sizes(limits.token_ladder)
    if plan.full_mixed and mixed_sizes:
        layers = attention_layer_shapes(
            dm.loaded.spec, block_size=kv.block_size, kv_cache_dtype=caches[0].dtype, device=device
        )
        mixed = FullMixedGraphs(
            forward,
            device,
            mixed_sizes,
            max_num_seqs=limits.max_num_seqs,
            max_blocks_per_req=_blocks_per_request(kv, limits),
            max_seq_len=limits.max_model_len,
            graph_key=forward_graph_key(backend, layers),
            prompt_steps_elsewhere=dm.new_kv_reads,
            kv_scales=kv.scales,
        )
        mixed.capture(caches, backend, cache_ops)
    piecewise = None
    if plan.piecewise:
        piecewise = PiecewiseCudaGraphs(model, device, limits.token_ladder, forward=forward)
        piecewise.capture(caches, backend, cache_ops)
    return mixed, piecewise
