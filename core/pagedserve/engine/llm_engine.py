"""`LLMEngine`: the in-process engine. Tokenizes, feeds the engine core, detokenizes.

The offline `LLM` API drives it step by step; the server runs the same core in its own process
and this front end's pieces (tokenizer, `OutputProcessor`) in the API process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.engine.input_processor import InputProcessor, detokenizer_eos_token_id
from pagedserve.engine.output_processor import OutputProcessor, take_pooled
from pagedserve.engine.protocol import POOLING_ROW, EngineCoreRequest
from pagedserve.engine.setup import EngineSetup, build_engine
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.admission import RequestRejected
from pagedserve.types import RequestId


class LLMEngine:
    """One model on one platform. Not thread-safe; every method but the getters mutates."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.setup: EngineSetup = build_engine(args, offline=True)
        self.core = self.setup.core
        self.tokenizer = self.setup.tokenizer
        self.vocab_size = self.setup.spec.vocab_size
        self.eos_token_ids = self.setup.eos_token_ids
        self.max_model_len = self.setup.max_model_len
        self.inputs = InputProcessor(
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_logprobs=self.setup.config.model.max_logprobs,
            max_model_len=self.max_model_len,
        )
        eos = detokenizer_eos_token_id(self.tokenizer, self.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer, eos_token_id=eos, max_model_len=self.max_model_len)
        self._pooling: dict[RequestId, list[int]] = {}  # pooling request id -> its prompt's token ids

    def require_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer; raises ValueError when the engine was built with skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: a string is encoded (with the model's special tokens); a list
        of ids is checked against the vocabulary. Raises ValueError for an empty or bad prompt."""
        return self.inputs.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request: generation with `SamplingParams`, or pooling (its prompt's embedding;
        `step` returns a `PoolingRequestOutput`) with `PoolingParams`; `lora_request`: the PEFT
        adapter a generation request runs with (enable_lora). Raises ValueError naming the
        problem when it can never run (empty prompt, token ids outside the vocabulary, prompt
        + max_tokens beyond max_model_len, an adapter this engine cannot apply...)."""
        if lora_request is not None:
            self._check_lora(lora_request, params)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, cache_salt)
            return
        params = self.inputs.checked_params(params)  # the engine keeps this checked copy
        ids = self.inputs.prompt_ids(prompt, params)
        text = prompt if isinstance(prompt, str) and params.truncate_prompt_tokens is None else None
        seq_ids = self.processor.add_request(request_id, text, ids, params)
        try:
            for i, seq_id in enumerate(seq_ids):
                self.core.add_request(
                    EngineCoreRequest(
                        req_id=seq_id,
                        prompt_token_ids=ids,
                        sampling_params=params,
                        eos_token_ids=self.eos_token_ids,
                        fork_of=seq_ids[0] if i else None,
                        cache_salt=cache_salt,
                        lora_request=lora_request,
                    )
                )
        except RequestRejected:
            self.core.abort(seq_ids)
            self.processor.abort(request_id)
            raise

    def _check_lora(self, lora_request: LoRARequest, params: SamplingParams | PoolingParams) -> None:
        """Raise ValueError unless `lora_request`'s adapter can run in this engine: LoRA is
        enabled, the request generates, and the adapter fits the model (read once per id)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        lora = self.setup.lora
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
        if request_id in self._pooling or self.processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.inputs.tokenize(prompt)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})"
            )
        self.core.add_request(
            EngineCoreRequest(
                req_id=RequestId(request_id),
                prompt_token_ids=ids,
                sampling_params=POOLING_ROW,
                eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt,
                pooling_params=params,
            )
        )
        self._pooling[RequestId(request_id)] = ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every sample of a request; returns its final output (None if unknown, and for a
        pooling request, which has no partial output)."""
        if self._pooling.pop(RequestId(request_id), None) is not None:
            self.core.abort([RequestId(request_id)])
            return None
        self.core.abort(self.processor.sequence_ids(request_id))
        return self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes of the blocks no request holds, so that the next
        requests compute their prompts in full (a benchmark's repeated run, say). Returns how
        many blocks were forgotten."""
        return self.core.reset_prefix_cache()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one engine step; return the requests it advanced (cumulative outputs), and the
        pooling requests it finished."""
        core_outputs = self.core.step()
        pooled: list[PoolingRequestOutput] = []
        if self._pooling:
            core_outputs = take_pooled(core_outputs, self._pooling, pooled)
        outputs, to_stop = self.processor.process(core_outputs)
        if to_stop:
            self.core.finish(to_stop)
        if pooled:
            return [*outputs, *pooled]
        # The generation-only step returns the processor's list itself (no copy per step).
        return cast("list[RequestOutput | PoolingRequestOutput]", outputs)
