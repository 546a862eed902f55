"""`LLMEngine`: the offline engine front end, over one replica in this process or
`data_parallel_size` replicas as processes. Tokenizes, feeds the engine core(s), detokenizes.

The offline `LLM` API drives it step by step. The replicas sit behind a `CoreClient`
(`engine.core_client`): the engine core itself for one, the data-parallel client for several
(`processes.data_parallel.offline_client`), so everything a user calls here behaves the same
whatever the replica count. The data-parallel client, like the tensor-parallel ranks, belongs to
the process layer and reaches this class as an argument (`engine.process_layer`). The server runs
the same core in its own process and this front end's pieces (tokenizer, `OutputProcessor`) in the
API process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.engine.core import EngineCore
from pagedserve.engine.core_client import CoreClient, InProcessCore, Rejection
from pagedserve.engine.input_processor import InputProcessor, detokenizer_eos_token_id
from pagedserve.engine.output_processor import OutputProcessor, take_pooled
from pagedserve.engine.process_layer import ProcessLayer
from pagedserve.engine.process_layer_missing import missing
from pagedserve.engine.protocol import POOLING_ROW, EngineCoreRequest
from pagedserve.engine.setup import EngineSetup, build_engine
from pagedserve.inputs import to_engine_prompt
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.types import RequestId

# A prompt as `add_request` takes it: text, token ids, or vLLM's dict forms (`TextPrompt`,
# `TokensPrompt`).
RequestPrompt = str | Sequence[int] | Mapping[str, object]


def open_core_client(args: EngineArgs, processes: ProcessLayer | None = None) -> CoreClient:
    """The core(s) `args` asks for: the engine core in this process for one replica, one engine-core
    process (or Ray actor) per replica for `data_parallel_size` > 1, started by `processes` (as are
    the ranks of `tensor_parallel_size` > 1). Without `processes` such args raise
    `ProcessLayerMissing` (see `engine.process_layer`)."""
    if args.data_parallel_size == 1:
        launcher = processes.start_executor if processes is not None else None
        return InProcessCore(build_engine(args, offline=True, start_executor=launcher))
    if processes is None:
        raise missing("data_parallel_size", args.data_parallel_size, "one engine-core process per replica")
    return processes.open_data_parallel(args)


class LLMEngine:
    """One model on one platform, over any number of data-parallel replicas. Not thread-safe;
    every method but the getters mutates. `shutdown` stops the replicas' processes (garbage
    collection and interpreter exit do too).

    `processes` starts the ranks and replicas of `tensor_parallel_size` / `data_parallel_size` > 1
    (`engine.process_layer`); `pagedserve.LLMEngine` supplies it, this class alone does not."""

    def __init__(self, args: EngineArgs, *, processes: ProcessLayer | None = None) -> None:
        self.args = args
        self.client = open_core_client(args, processes)
        self.tokenizer = self.client.tokenizer
        self.vocab_size = self.client.vocab_size
        self.eos_token_ids = self.client.eos_token_ids
        self.max_model_len = self.client.max_model_len
        self.inputs = InputProcessor(
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_logprobs=args.max_logprobs,
            max_model_len=self.max_model_len,
        )
        eos = detokenizer_eos_token_id(self.tokenizer, self.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer, eos_token_id=eos, max_model_len=self.max_model_len)
        self._pooling: dict[RequestId, list[int]] = {}  # pooling request id -> its prompt's token ids

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """The engine `engine_args` describe (vLLM's constructor)."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(
                f"engine_args must be an EngineArgs, got {type(engine_args).__name__}: "
                "from pagedserve import EngineArgs"
            )
        return cls(engine_args)

    # ---- what callers read -----------------------------------------------------------------------
    @property
    def setup(self) -> EngineSetup:
        """What the in-process engine chose (platform, model, backend, KV cache). Raises
        AttributeError with data parallelism, whose replicas each made their own."""
        return self._in_process("setup").setup

    @property
    def core(self) -> EngineCore:
        """The in-process engine core. Raises AttributeError with data parallelism, whose cores
        run in their own processes."""
        return self._in_process("core").core

    @property
    def in_process(self) -> bool:
        """Whether the engine core runs in this process (one replica): `core` and `setup` are
        readable then, and not with data parallelism."""
        return isinstance(self.client, InProcessCore)

    def _in_process(self, name: str) -> InProcessCore:
        client = self.client
        if not isinstance(client, InProcessCore):
            raise AttributeError(
                f"LLMEngine.{name} is the in-process engine's; with data_parallel_size="
                f"{self.args.data_parallel_size} each replica's runs in its own process "
                "(read llm_engine.client for the replicas)"
            )
        return client

    @property
    def platform_name(self) -> str:
        return self.client.platform_name

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (vLLM's name); raises ValueError when built with skip_tokenizer_init."""
        return self.require_tokenizer()

    def require_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer; raises ValueError when the engine was built with skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    def scheduler_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences over every replica, as of its latest step."""
        return self.client.scheduler_counts()

    def shutdown(self) -> None:
        """Stop the replicas' processes (or the tensor-parallel ranks). Idempotent."""
        self.client.shutdown()

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: a string is encoded (with the model's special tokens); a list
        of ids is checked against the vocabulary. Raises ValueError for an empty or bad prompt."""
        return self.inputs.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: RequestPrompt,
        params: SamplingParams | PoolingParams,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request: generation with `SamplingParams`, or pooling (its prompt's embedding;
        `step` returns a `PoolingRequestOutput`) with `PoolingParams`. `prompt`: text, token ids,
        `{"prompt": text}` or `{"prompt_token_ids": ids}`. `lora_request`: the PEFT adapter a
        generation request runs with (enable_lora). Raises ValueError naming the problem when it
        can never run (empty prompt, token ids outside the vocabulary, prompt + max_tokens beyond
        max_model_len, an adapter this engine cannot apply...)."""
        if isinstance(prompt, Mapping):  # a TextPrompt or TokensPrompt; str and ids are checked below
            prompt = to_engine_prompt(prompt, "prompt")
        if lora_request is not None:
            self._check_lora(lora_request, params)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, cache_salt)
            return
        params = self.inputs.checked_params(params)  # the engine keeps this checked copy
        ids = self.inputs.prompt_ids(prompt, params)
        text = prompt if isinstance(prompt, str) and params.truncate_prompt_tokens is None else None
        seq_ids = self.processor.add_request(request_id, text, ids, params)
        samples = [
            EngineCoreRequest(
                req_id=seq_id,
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                fork_of=seq_ids[0] if i else None,
                cache_salt=cache_salt,
                lora_request=lora_request,
            )
            for i, seq_id in enumerate(seq_ids)
        ]
        try:
            self.client.add_request(samples)
        except ValueError:
            self.processor.abort(request_id)
            raise

    def _check_lora(self, lora_request: LoRARequest, params: SamplingParams | PoolingParams) -> None:
        """Raise ValueError unless `lora_request`'s adapter can run in this engine: LoRA is
        enabled, the request generates, and the adapter fits the model (read once per id)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not isinstance(self.client, InProcessCore):  # EngineArgs refuses enable_lora with it
            raise ValueError(f"lora_request needs data_parallel_size=1, got {self.args.data_parallel_size}")
        lora = self.client.setup.lora
        if lora is None:
            raise ValueError(
                f"lora_request={lora_request.lora_name!r} given but this engine was built without LoRA: "
                "build it with enable_lora=True (--enable-lora)"
            )
        if isinstance(params, PoolingParams):
            raise ValueError("lora_request is for generation; pooling requests run the base model only")
        lora.check(lora_request)

    def _add_pooling_request(
        self, request_id: str, prompt: str | Sequence[int], params: PoolingParams, cache_salt: str | None
    ) -> None:
        seq_id = RequestId(request_id)
        if seq_id in self._pooling or self.processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.inputs.tokenize(prompt)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})"
            )
        self.client.add_request(
            [
                EngineCoreRequest(
                    req_id=seq_id,
                    prompt_token_ids=ids,
                    sampling_params=POOLING_ROW,
                    eos_token_ids=self.eos_token_ids,
                    cache_salt=cache_salt,
                    pooling_params=params,
                )
            ]
        )
        self._pooling[seq_id] = ids

    def abort_request(self, request_id: str | Sequence[str]) -> RequestOutput | None:
        """Abort every sample of one request, or of each of a list of them (vLLM's form); unknown
        ids are ignored. Returns the final output of a single generation request (None for a
        list, an unknown id, or a pooling request, which has no partial output). The aborted
        requests no longer count as unfinished."""
        final = None
        for one in [request_id] if isinstance(request_id, str) else request_id:
            final = self._abort_one(one)
        if not self.has_unfinished_requests():
            self.client.drain()
        return final if isinstance(request_id, str) else None

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        if self._pooling.pop(RequestId(request_id), None) is not None:
            self.client.abort([RequestId(request_id)])
            return None
        self.client.abort(self.processor.sequence_ids(request_id))
        return self.processor.abort(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether a request added here is still unfinished (not aborted either)."""
        return RequestId(request_id) in self._pooling or self.processor.has_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether a request added here has not finished (or been aborted) yet."""
        return bool(self._pooling) or self.processor.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes of the blocks no request holds, so that the next
        requests compute their prompts in full (a benchmark's repeated run, say). Returns how
        many blocks were forgotten, over every replica."""
        return self.client.reset_prefix_cache()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one engine step (with data parallelism: wait until any replica reports); return
        the requests it advanced (cumulative outputs), and the pooling requests it finished.
        Raises ValueError when a replica rejected a request (after dropping it)."""
        result = self.client.step()
        core_outputs = result.outputs
        pooled: list[PoolingRequestOutput] = []
        if self._pooling:
            core_outputs = take_pooled(core_outputs, self._pooling, pooled)
        outputs, to_stop = self.processor.process(core_outputs)
        if to_stop:
            self.client.finish(to_stop)
        if result.rejected:
            raise ValueError("; ".join(self._drop_rejected(result.rejected)))
        if not self._pooling and not self.processor.has_unfinished_requests():
            self.client.drain()  # the last request finished: leave the core idle, as it was
        if pooled:
            return [*outputs, *pooled]
        # The generation-only step returns the processor's list itself (no copy per step).
        return cast("list[RequestOutput | PoolingRequestOutput]", outputs)

    def _drop_rejected(self, rejected: Sequence[Rejection]) -> list[str]:
        """Forget the requests of sequences a replica refused (aborting their other samples);
        returns what to raise."""
        messages = []
        for rejection in rejected:
            seq_id = rejection.req_id
            if self._pooling.pop(seq_id, None) is not None:
                messages.append(f"request {seq_id!r} was {rejection.reason}")
                continue
            request_id = self.processor.request_of(seq_id)
            if request_id is None:
                continue  # a sibling of a request already dropped
            others = [s for s in self.processor.sequence_ids(request_id) if s != seq_id]
            if others:  # admitted (or waiting on the refused one): drop them too
                self.client.abort(others)
            self.processor.abort(request_id)
            messages.append(f"request {request_id!r} was {rejection.reason}")
        return messages
