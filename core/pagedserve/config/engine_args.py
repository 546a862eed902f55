"""`EngineArgs`: everything `LLM(...)`, `pagedserve generate` and `pagedserve serve` accept about the
engine, as one flat set of options with vLLM's names.

This is what users fill, checked field by field when it is built: a bad value raises
`pydantic.ValidationError` naming the field. It is not what the engine reads: the engine resolves it
once, before any worker starts, into one frozen configuration per concern
(`engine_config.resolve_engine_config`), which is where the defaults that depend on the model and
the rules between fields live. The default of every option is written here, once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.config.cache import KVCacheDtypeName
from pagedserve.config.forward import DEFAULT_CUDA_GRAPH_MAX_TOKENS, CompileScope, CudaGraphModeName
from pagedserve.config.model import QuantizationName
from pagedserve.config.parallel import ExecutorBackend
from pagedserve.config.runner import RunnerName, TaskName, dtype_name, runner_of
from pagedserve.config.scheduler import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_BATCHED_TOKENS, PreemptionMode
from pagedserve.config.speculative import parse_speculative_config


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class EngineArgs(_Config):
    """Everything `LLM(...)`, `pagedserve generate` and `pagedserve serve` accept about the engine.

    Names follow vLLM's so users can switch with one import."""

    model: str | None = Field(
        None, description="checkpoint directory, .gguf file; None: the embedded SmolLM2"
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside `model` when it is a directory")
    tokenizer: str | None = Field(None, description="tokenizer directory; None: the model's own")
    skip_tokenizer_init: bool = Field(
        False, description="no tokenizer: prompts must be token ids and SamplingParams(detokenize=False)"
    )
    platform: str | None = Field(None, description="platform name; None: PAGEDSERVE_PLATFORM or automatic")
    trust_remote_code: bool = Field(
        False,
        description="let transformers run the checkpoint's own Python code for its config and "
        "tokenizer (`auto_map`); the model itself is always a native or transformers built-in one",
    )
    dtype: str = Field(
        "auto",
        pattern=r"^(auto|float32|float16|bfloat16|float64)$",
        description="also vLLM's aliases 'half' (float16), 'float' (float32), 'double' (float64) "
        "and a torch.dtype",
    )
    runner: RunnerName = Field(
        "auto",
        description="'generate': generation requests only; 'pooling': pooling requests only (embed, "
        "classify, score); 'auto': a *ForSequenceClassification checkpoint pools, any other serves both",
    )
    task: TaskName | None = Field(
        None,
        description="vLLM's older switch: 'generate' is runner='generate'; 'embed' (or 'embedding'), "
        "'classify' and 'score' are runner='pooling'",
    )
    enable_sleep_mode: bool = Field(
        False, description="allow `LLM.sleep()` / `wake_up()` (weights offloaded or freed, KV cache freed)"
    )
    max_model_len: int | None = Field(
        None, ge=1, description=f"None: the model's trained context length, at most {DEFAULT_MAX_MODEL_LEN}"
    )
    block_size: int = Field(16, ge=1, le=256)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description=f"token budget of one step; None: {DEFAULT_MAX_NUM_BATCHED_TOKENS}, at least "
        "max_num_seqs (and at least max_model_len with chunked prefill off)",
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="None: sized from the platform's memory")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    cpu_kv_cache_gib: float = Field(2.0, gt=0.0, description="KV budget on CPU platforms")
    swap_space_gib: float = Field(0.0, ge=0.0, description="CPU swap pool for preemption_mode='swap'")
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    scheduling_policy: Literal["auto", "fcfs", "makespan"] = Field(
        "auto",
        description="'fcfs': waiting requests start in arrival order and every step may take the "
        "whole token budget; 'makespan' (offline batches): the requests with the most tokens to "
        "generate start first and, while requests decode, prompt work is spread over the steps the "
        "longest one still needs; 'auto': 'makespan' for the offline engine (`LLM`, `LLMEngine`, "
        "`pagedserve generate` and `bench throughput`), 'fcfs' for the server",
    )
    load_format: str = Field("auto", pattern=r"^(auto|safetensors|gguf|dummy)$")
    quantization: QuantizationName | None = Field(
        None,
        description="'gguf': keep a GGUF file's Q4_1/Q8_0 blocks packed (CPU, bfloat16); 'fp8': "
        "linear weights quantized to FP8 at load time, per output channel (GPUs with sm_89+)",
    )
    quantize_lm_head: bool = Field(
        False,
        description="with quantization='fp8': the LM head too, to FP8 per vocabulary row (half the "
        "head's bytes per decode step; the logits take the FP8 error directly, hence off by default)",
    )
    kv_cache_dtype: KVCacheDtypeName = Field(
        "auto", description="'auto': the model's dtype; 'fp8' (= 'fp8_e4m3') or 'fp8_e5m2': an FP8 KV cache"
    )
    seed: int = Field(0, ge=0)
    enforce_eager: bool = Field(False, description="no CUDA graphs / compilation")
    cudagraph_mode: CudaGraphModeName = Field(
        "full",
        description="CUDA graphs on NVIDIA GPUs: 'full' replays decode batches and mixed steps "
        "(prefill chunks beside decodes) as whole graphs (attention inside) and other steps as "
        "piecewise graphs; 'full_and_piecewise' replays only decode batches whole; "
        "'full_decode_only' graphs decode batches only; 'piecewise' cuts every step's graphs at "
        "attention; 'none' runs eagerly",
    )
    gpu_compile: bool = Field(
        True,
        description="GPU platforms: run the dense parts of the forward through torch.compile "
        "(attention stays the platform's kernels); artifacts are cached on disk",
    )
    gpu_compile_scope: CompileScope = Field(
        "layer",
        description="with gpu_compile: 'layer' compiles each stretch of the decoder between two "
        "attention calls once and runs it for every layer (start-up grows with one layer, not with "
        "the depth); 'model' traces the whole forward as one graph (the transformers fallback and "
        "models without per-layer regions always are)",
    )
    attention_warmup_threads: int | None = Field(
        None,
        ge=1,
        description="GPU start-up: threads that run the attention-kernel sweep (each call JITs new "
        "kernel variants), beside the forward's compilation; 1 runs it on one thread after the "
        "compile; None: min(8, CPUs / 2) where the attention backend declares concurrent_batches "
        "(plugin API 1.11), else 1",
    )
    platform_linear: bool = Field(
        True,
        description="GPU platforms that provide their own GEMM for linear layers (triton, cuda: a "
        "weight-streaming kernel for steps of at most 16 tokens, 128 with FP8 weights): use it; "
        "False keeps torch's (cuBLAS / torch._scaled_mm) for every step",
    )
    programmatic_launch: bool = Field(
        True,
        description="NVIDIA sm_90+ GPUs: launch the platform's linear-layer kernels (where it offers "
        "that) and the compiled forward's kernels as programmatic dependent launches, each set up "
        "while the previous one drains; False (or enforce_eager) launches them one after another",
    )
    attention_reads_new_kv: bool = Field(
        True,
        description="let the attention backend read the keys and values of a step's new tokens from "
        "the step's own projections as well as from the paged cache (the triton and cuda platforms "
        "run prompt-only steps on NVIDIA sm_90+ with a prefill kernel that streams them with TMA); "
        "False makes every step read the cache only",
    )
    disable_cascade_attn: bool = Field(
        False,
        description="never run a step as cascade attention (the prefix every request of a step shares "
        "read once for all of them, where the backend declares it and the cost model says it pays); "
        "False lets the engine decide per step",
    )
    freeze_startup_heap: bool = Field(
        True,
        description="after start-up, move the engine's long-lived objects out of Python's full "
        "garbage collections (`gc.freeze`), so a collection during serving does not stall the host "
        "for the time it takes to walk them; False leaves the collector as it is",
    )
    cpu_compile: bool = Field(
        False,
        description="CPU platforms: run steps of up to 32 tokens through torch.compile (needs a C++ "
        "compiler; the first start compiles for about a minute, later starts read inductor's disk cache)",
    )
    compile_cache: bool = Field(
        False,
        description="with cpu_compile: save each compiled forward graph whole under the compile cache "
        "root ($PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve, in aot/) and load it at later starts "
        "instead of tracing the model again (later starts about twice as fast, the first one slower); "
        "False compiles at every start without saving",
    )
    cuda_graph_max_tokens: int = Field(
        DEFAULT_CUDA_GRAPH_MAX_TOKENS,
        ge=1,
        description="largest step (tokens) replayed as CUDA graphs; larger steps run eagerly",
    )
    num_speculative_tokens: int = Field(
        0, ge=0, le=16, description="drafts per step; alone: n-gram (prompt lookup) drafting"
    )
    speculative_config: dict[str, Any] | None = Field(
        None,
        description="vLLM's speculative decoding dict: method (ngram, draft_model, eagle, eagle3), model, "
        "num_speculative_tokens, prompt_lookup_min/max, draft_tensor_parallel_size, dtype",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=512, description="ranks the model is sharded over (one process per rank, one device each)"
    )
    distributed_executor_backend: ExecutorBackend = Field(
        "mp",
        description="how ranks (tensor_parallel_size > 1) and data-parallel replicas (data_parallel_size "
        "> 1) start: 'mp' processes on this host, 'ray' actors anywhere in a Ray cluster",
    )
    distributed_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="a rank that does not answer (or a collective that waits) this long fails the engine",
    )
    disable_custom_all_reduce: bool = Field(
        False,
        description="tensor_parallel_size > 1 on NVIDIA GPUs: all-reduce every message through NCCL; "
        "False sums messages up to a measured size through peer memory (one-shot / two-shot over "
        "NVLink, CUDA-graph capturable) and larger ones through NCCL",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=512,
        description="independent engine replicas (each on its own GPU, or its own group of "
        "tensor_parallel_size GPUs) behind one LLM or server; requests go to the least loaded",
    )
    async_scheduling: bool | None = Field(
        None,
        description="schedule and prepare step N+1 while step N runs on the device; None: on for "
        "accelerator platforms, off on CPU platforms (where nothing runs beside the host)",
    )
    max_logprobs: int = Field(
        20, ge=0, description="most logprobs / prompt_logprobs a request may ask for (larger: refused)"
    )
    enable_lora: bool = Field(
        False,
        description="serve PEFT LoRA adapters per request (`lora_request=`; offline engine, CPU "
        "platforms, native decoders, one device, eager forward)",
    )
    max_loras: int = Field(1, ge=1, description="with enable_lora: most distinct adapters running at once")
    max_lora_rank: int = Field(16, ge=1, le=512, description="with enable_lora: the largest adapter rank")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        return dtype_name(value)

    @model_validator(mode="after")
    def _runner_and_task_agree(self) -> EngineArgs:
        runner_of(self.runner, self.task)  # raises naming both when they disagree
        return self

    @model_validator(mode="after")
    def _speculative_config_parses(self) -> EngineArgs:
        if self.speculative_config is not None:
            parse_speculative_config(self.speculative_config, self.num_speculative_tokens)
        return self

    @model_validator(mode="after")
    def _lora_runs_alone(self) -> EngineArgs:
        if not self.enable_lora:
            return self
        # The adapters' slots live in one process's model; ranks and replicas would need them too.
        for name, value in (
            ("tensor_parallel_size", self.tensor_parallel_size),
            ("data_parallel_size", self.data_parallel_size),
        ):
            if value > 1:
                raise ValueError(f"enable_lora=True needs {name}=1 (got {value}): LoRA runs on one device")
        return self

    @model_validator(mode="after")
    def _lm_head_quantization_needs_fp8_weights(self) -> EngineArgs:
        if not self.quantize_lm_head:
            return self
        if self.quantization != "fp8":
            raise ValueError(
                f"quantize_lm_head=True quantizes the LM head like the FP8 weights of quantization='fp8', "
                f"but quantization is {self.quantization!r}: add quantization='fp8' (--quantization fp8) "
                "or drop quantize_lm_head (--quantize-lm-head)"
            )
        if self.tensor_parallel_size > 1:
            # Checked here so the combination fails before any rank starts: the loader refuses
            # quantization='fp8' under tensor parallelism (`quantize_linear_layers` would swap a
            # shard's row-parallel layers for plain FP8 ones without their all-reduce), so an FP8
            # head sharded by vocabulary rows would have no FP8 decoder to run with.
            raise ValueError(
                f"quantize_lm_head=True with tensor_parallel_size={self.tensor_parallel_size}: FP8 "
                "weights (quantization='fp8'), the LM head's included, are not sharded over "
                "tensor-parallel ranks; use tensor_parallel_size=1, or drop quantization='fp8' and "
                "quantize_lm_head for a sharded bfloat16 model"
            )
        return self
