"""`LLMEngine`: the in-process engine. Tokenizes, feeds the engine core, detokenizes.

The offline `LLM` API drives it step by step; the server runs the same core in its own process
and this front end's pieces (tokenizer, `OutputProcessor`) in the API process.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.engine.input_processor import InputProcessor, detokenizer_eos_token_id
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineCoreRequest
from pagedserve.engine.setup import EngineSetup, build_engine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.admission import RequestRejected


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
            max_logprobs=args.max_logprobs,
            max_model_len=self.max_model_len,
        )
        eos = detokenizer_eos_token_id(self.tokenizer, self.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer, eos_token_id=eos, max_model_len=self.max_model_len)

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
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError naming the problem when it can never run (empty
        prompt, token ids outside the vocabulary, prompt + max_tokens beyond max_model_len...)."""
        self.inputs.check_params(params)
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
                    )
                )
        except RequestRejected:
            self.core.abort(seq_ids)
            self.processor.abort(request_id)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every sample of a request; returns its final output (None if unknown)."""
        self.core.abort(self.processor.sequence_ids(request_id))
        return self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes of the blocks no request holds, so that the next
        requests compute their prompts in full (a benchmark's repeated run, say). Returns how
        many blocks were forgotten."""
        return self.core.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests it advanced (cumulative outputs)."""
        outputs, to_stop = self.processor.process(self.core.step())
        if to_stop:
            self.core.finish(to_stop)
        return outputs
