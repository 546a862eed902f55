"""No cold start: compile the forward, JIT the attention kernels and capture the graphs before serving.

Why. Triton and NVRTC compile a kernel the first time a launch needs a new variant (another
split count, another tile configuration, another integer specialisation of the batch geometry),
and `torch.compile` compiles on the first call. Left to the first requests, that work lands inside
the first timed steps: a fresh machine ran its first benchmark at half the speed of a warm one.

What. `prepare_runner` runs, with the time of each in the log:

1. compile the GPU forward (`gpu_compile`), when the plan says so;
2. run the attention backend (and the cache write) over a sweep of synthetic batches
   (`attention_sweep`): with several threads (`attention_warmup_threads`, for a backend that
   declares `concurrent_batches`), on a thread of its own beside the compile, which never calls
   the backend (its attention is answered by zeros); with one, after the compile, as it was;
3. capture the full decode graphs, then the full mixed-step graphs (`cudagraph_mode="full"`),
   then the piecewise graphs (their capture runs the compiled forward once per graph, which
   compiles anything the sweep missed).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from pagedserve.worker.attention_sweep import (
    AttentionWarmup,
    SweepInBackground,
    attention_warmup_batches,
    warm_up_attention,
)
from pagedserve.worker.cuda_graphs import PiecewiseCudaGraphs, default_graph_sizes
from pagedserve.worker.full_cuda_graphs import (
    FullDecodeGraphs,
    attention_layer_shapes,
    forward_graph_key,
    seq_len_buckets,
)
from pagedserve.worker.full_mixed_graphs import FullMixedGraphs, mixed_graph_sizes
from pagedserve.worker.gpu_compile import GpuCompiledForward
from pagedserve.worker.graph_modes import GraphPlan
from pagedserve.worker.startup_times import StartupTimes

if TYPE_CHECKING:  # annotations only; the runner depends on nothing here
    from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def prepare_runner(
    runner: ModelRunner,
    plan: GraphPlan,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    cuda_graph_max_tokens: int,
    attention_warmup_threads: int = 1,  # `attention_sweep.attention_warmup_threads`
) -> StartupTimes:
    """Compile, warm up and capture what `plan` asks for on `runner` (module docstring). Call once,
    after the KV cache exists and before the engine takes requests. Mutates the runner (its
    `compiled`, `full_graphs` and `cuda_graphs`); slow."""
    compile_s = kernels_s = beside_s = capture_s = 0.0
    compiled = None
    if plan.compile:
        # Compiles at `warm_up`; set first, since the full graphs below replay it.
        compiled = GpuCompiledForward(
            runner.model, programmatic_launch=plan.programmatic_launch, scope=plan.compile_scope
        )
        runner.compiled = compiled
    # Before the sweep: which full graphs will be captured decides which plans it must compile.
    full = (
        _full_decode_graphs(
            runner,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            cuda_graph_max_tokens=cuda_graph_max_tokens,
        )
        if plan.full_decode
        else None
    )
    batches = (
        attention_warmup_batches(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            decode_graphs=full.graphs if full is not None else (),
        )
        if plan.warm_up_kernels
        else []
    )
    sweep = None
    if batches:
        scales = None if runner.kv_scales is None else runner.kv_scales[0]

        def run_sweep() -> AttentionWarmup:
            return warm_up_attention(
                runner.backend,
                runner.cache_ops,
                runner.kv_caches[0],
                runner.spec,
                batches,
                scales,
                new_kv_reads=runner.new_kv_reads,
                # The runner's block table: its row stride is a kernel argument Triton specialises on.
                block_table_width=runner.batch.block_table.np.shape[1],
                threads=attention_warmup_threads,
            )

        sweep = SweepInBackground(run_sweep, runner.device)
        if attention_warmup_threads > 1 and compiled is not None:
            sweep.start()
    if compiled is not None:
        try:
            compile_s = compiled.warm_up(runner.kv_caches, runner.backend, runner.cache_ops)
        except BaseException:
            if sweep is not None:
                with contextlib.suppress(Exception):  # the compile's failure is the one to report
                    sweep.finish()
            raise
    swept: AttentionWarmup | None = None
    if sweep is not None:
        swept, kernels_s, beside_s = sweep.finish()
        _log_sweep(swept, len(batches), kernels_s, beside_s, attention_warmup_threads)
    if plan.full_decode or plan.piecewise:
        start = time.perf_counter()
        _capture_graphs(
            runner,
            plan,
            full,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            cuda_graph_max_tokens=cuda_graph_max_tokens,
        )
        capture_s = time.perf_counter() - start
    logger.info(
        "ready to serve (%s): compile %.1f s, attention kernels %.1f s%s, graph capture %.1f s",
        plan.describe(),
        compile_s,
        kernels_s,
        f" (+{beside_s:.1f} s beside the compile)" if beside_s else "",
        capture_s,
    )
    return StartupTimes(
        compile_s,
        kernels_s,
        capture_s,
        len(batches),
        num_attention_variants=None if swept is None else swept.num_variants,
        num_warmup_calls=0 if swept is None else swept.num_launched,
        kernels_beside_compile_s=beside_s,
    )


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
    runner: ModelRunner, *, max_num_seqs: int, max_model_len: int, cuda_graph_max_tokens: int
) -> FullDecodeGraphs:
    """The full decode graphs `runner` will replay, not yet captured: one per padded size of the
    request ladder and per distinct plan of the backend over the sequence-length buckets, run
    from the compiled forward where there is one."""
    layers = attention_layer_shapes(
        runner.spec,
        block_size=runner.block_size,
        kv_cache_dtype=runner.kv_caches[0].dtype,
        device=runner.device,
    )
    return FullDecodeGraphs(
        runner.compiled if runner.compiled is not None else runner.model,
        runner.device,
        default_graph_sizes(max_num_seqs, cuda_graph_max_tokens),
        max_blocks_per_req=runner.batch.block_table.np.shape[1],
        max_seq_len=max_model_len,
        buckets=seq_len_buckets(max_model_len, runner.block_size),
        graph_key=forward_graph_key(runner.backend, layers),
        kv_scales=runner.kv_scales,
        cascade_min_reqs=runner.cascade.model.min_requests if runner.cascade is not None else None,
    )


def _capture_graphs(
    runner: ModelRunner,
    plan: GraphPlan,
    full: FullDecodeGraphs | None,  # exactly when plan.full_decode
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    cuda_graph_max_tokens: int,
) -> None:
    """Capture `full`, then the mixed-step and piecewise graphs as `plan` asks, from the compiled
    forward where there is one. Mutates the runner (`full_graphs`, `mixed_graphs`,
    `cuda_graphs`)."""
    caches, backend, cache_ops = runner.kv_caches, runner.backend, runner.cache_ops
    forward = runner.compiled if runner.compiled is not None else runner.model
    if full is not None:
        full.capture(caches, backend, cache_ops)
        runner.full_graphs = full
    mixed_sizes = mixed_graph_sizes(default_graph_sizes(max_num_batched_tokens, cuda_graph_max_tokens))
    if plan.full_mixed and mixed_sizes:
        layers = attention_layer_shapes(
            runner.spec, block_size=runner.block_size, kv_cache_dtype=caches[0].dtype, device=runner.device
        )
        mixed = FullMixedGraphs(
            forward,
            runner.device,
            mixed_sizes,
            max_num_seqs=max_num_seqs,
            max_blocks_per_req=runner.batch.block_table.np.shape[1],
            max_seq_len=max_model_len,
            graph_key=forward_graph_key(backend, layers),
            prompt_steps_elsewhere=runner.new_kv_reads,
            kv_scales=runner.kv_scales,
        )
        mixed.capture(caches, backend, cache_ops)
        runner.mixed_graphs = mixed
    if plan.piecewise:
        graphs = PiecewiseCudaGraphs(
            runner.model,
            runner.device,
            default_graph_sizes(max_num_batched_tokens, cuda_graph_max_tokens),
            forward=forward,
        )
        graphs.capture(caches, backend, cache_ops)
        runner.cuda_graphs = graphs
