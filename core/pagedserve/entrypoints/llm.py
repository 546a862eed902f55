"""`LLM`: offline batch generation with vLLM's names, so users switch with one import.

from pagedserve import LLM, SamplingParams
llm = LLM()  # the embedded SmolLM2-135M-Instruct on the best available platform
outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
vectors = llm.embed(["Hello, my name is"])  # outputs.embedding: the last token's, normalized

`LLM` holds one engine front end (`LLMEngine`) whatever the replica count: with
`data_parallel_size=N > 1` its cores are N engine-core processes, each on its own GPU (see
`pagedserve.processes.data_parallel`); a script that builds one must do so under `if __name__ ==
"__main__":`, since the processes are spawned.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, get_args

import pydantic
import torch
from tqdm.auto import tqdm

from pagedserve.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from pagedserve.config import EngineArgs
from pagedserve.config.runner import check_serves, runner_of, served_requests
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints import scoring, worker_calls
from pagedserve.entrypoints.chat import conversations_of, render_chats
from pagedserve.entrypoints.metrics import Metric, OfflineMetrics
from pagedserve.entrypoints.scoring import require_classifier
from pagedserve.entrypoints.sleep import SleepMode
from pagedserve.inputs import PromptType, is_single_prompt, to_engine_prompt
from pagedserve.lora.request import LoRARequest
from pagedserve.models.loader import load_config, resolve_model_source
from pagedserve.models.registry import architecture_of
from pagedserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from pagedserve.pooling_params import PoolingParams, PoolingTask
from pagedserve.processes.layer import PROCESSES
from pagedserve.sampling.sampling_params import SAMPLING_PARAMS, RequestOutputKind, SamplingParams

PromptInput = str | Sequence[int]
Message = dict[str, Any]  # {"role": ..., "content": ...}


class LLM:
    """An engine for offline generation. Keyword arguments are `EngineArgs` fields."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        try:
            args = EngineArgs(model=model, **kwargs)
        except pydantic.ValidationError as exc:
            raise ValueError(_describe_validation_error(exc)) from None
        # In-process for one replica, processes for several (and for tensor-parallel ranks).
        self.engine = LLMEngine(args, processes=PROCESSES)
        self._ids = itertools.count()
        self._default_params: SamplingParams | None = None
        # What this engine serves: generation, pooling or both (`runner`, `task`; vLLM's checks).
        self._architecture = _architecture(self.engine)
        self._served = served_requests(runner_of(args.runner, args.task), self._architecture)
        self._sleep = SleepMode(self.engine, args.enable_sleep_mode)
        self._metrics = OfflineMetrics()

    @property
    def platform(self) -> str:
        return self.engine.platform_name

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine behind this `LLM` (vLLM's attribute name): `add_request`, `step`, ..."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters `generate` and `chat` use when given none: the model's
        `generation_config.json` values (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens), as vLLM reads them, or SamplingParams() without one."""
        if self._default_params is None:
            self._default_params = generation_defaults(self.engine.args.model)
        return self._default_params

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt prefixes of finished requests: the next `generate` computes
        every prompt in full. Returns True when the whole cache was reset (vLLM's answer), False
        when requests added through `llm_engine` are still running: their blocks keep their
        prefixes (every other block's are forgotten)."""
        busy = self.engine.has_unfinished_requests()
        self.engine.reset_prefix_cache()
        return not busy

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics as vLLM's metric objects (`Counter`, `Gauge`, `Histogram`, from
        `pagedserve.entrypoints.metrics`), under vLLM's `vllm:` names: tokens and finished
        requests of this LLM's calls, latencies, and the scheduler's and KV cache's state now."""
        return self._metrics.read(self.engine)

    def sleep(self, level: int = 1) -> None:
        """Free the device's memory while idle (vLLM's sleep mode; needs enable_sleep_mode=True):
        level 1 offloads the weights to host memory, level 2 frees them (waking reads the
        checkpoint again); both free the KV cache and forget the cached prefixes. CUDA graphs are
        dropped: after waking, steps run the compiled or eager forward."""
        self._sleep.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`: `tags` names the parts to wake, "weights" and / or "kv_cache" (None:
        both); generation and pooling wait until both are awake."""
        self._sleep.wake_up(tags)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run `method` on every device's model runner, one answer per device in rank order
        (`entrypoints.worker_calls`): a public `ModelRunner` method's name, or a function called
        with the runner first. `timeout` is not offered: a tensor-parallel call waits at most
        distributed_timeout_s, as every call to the ranks does."""
        if timeout is not None:
            raise ValueError("collective_rpc(timeout=...) is not supported: calls wait distributed_timeout_s")
        return worker_calls.collective_rpc(self.engine, method, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """`func(model)` on every device's model (a rank's shard under tensor parallelism), one
        answer per device."""
        return worker_calls.apply_model(self.engine, func)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt: one prompt or a list of them, each a string, a list of token
        ids, a `TextPrompt` (`{"prompt": text}`) or a `TokensPrompt` (`{"prompt_token_ids": ids}`);
        returns one finished `RequestOutput` per prompt, in input order. `lora_request`: one
        `LoRARequest` for every prompt, or one per prompt (None: the base model); needs an engine
        built with enable_lora=True. `priority`: one per prompt, as vLLM's; only 0 applies, since
        no scheduling policy here orders by priority (vLLM refuses others without one too)."""
        check_serves(self._served, "generate", "LLM.generate")
        prompt_list = _as_prompt_list(prompts)
        _check_priority(priority, len(prompt_list))
        params_list = _as_params_list(self._or_default(sampling_params), len(prompt_list))
        lora_list = _as_lora_list(lora_request, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm, lora_list)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (the forms `generate` takes), as vLLM's `LLM.beam_search`:
        one `BeamSearchOutput` per prompt, in input order, each with `params.beam_width` sequences
        best first (fewer when the vocabulary offers fewer). Each step runs every live beam of
        every prompt as one `generate` batch; the prefix cache shares the beams' KV blocks."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        check_serves(self._served, "generate", "LLM.beam_search")
        engine = self.engine
        wanted = 2 * params.beam_width
        if wanted > engine.args.max_logprobs:
            raise ValueError(
                f"beam_width={params.beam_width} reads {wanted} logprobs per step, more than this "
                f"engine's max_logprobs={engine.args.max_logprobs}: build the LLM with "
                f"max_logprobs>={wanted} or lower beam_width"
            )
        token_prompts: list[list[int]] = []
        for index, prompt in enumerate(_as_prompt_list(prompts)):
            try:
                ids = engine.tokenize(prompt)
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
            if len(ids) + params.max_tokens > engine.max_model_len:
                raise ValueError(
                    f"prompt {index}: its {len(ids)} tokens plus max_tokens={params.max_tokens} exceed "
                    f"max_model_len={engine.max_model_len}"
                )
            token_prompts.append(ids)
        tokenizer = engine.tokenizer
        decode: Callable[[list[int]], str] | None = None
        if tokenizer is not None:

            def decode(ids: list[int]) -> str:
                return str(tokenizer.decode(ids))

        steps = tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm)

        def run_batch(batch: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
            beams: list[PromptInput] = list(batch)
            outputs = self._run(beams, [step] * len(beams), use_tqdm=False)
            steps.update(1)
            return outputs

        try:
            return run_beam_search(
                token_prompts,
                params,
                run_batch,
                engine.eos_token_ids,
                decode,
            )
        finally:
            steps.close()

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        Message content is a string or a list of OpenAI text parts (`[{"type": "text", "text":
        ...}]`). `continue_final_message` continues the last (assistant) message instead of
        opening a new turn; `tools` (JSON-schema function definitions) and `chat_template_kwargs`
        reach the template as variables, as with vLLM. `lora_request`: as in `generate`, one per
        conversation. Each output's `prompt` is its rendered conversation."""
        check_serves(self._served, "generate", "LLM.chat")
        rendered = render_chats(
            self.engine.require_tokenizer(),
            conversations_of(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        prompts: list[PromptInput] = [r.token_ids for r in rendered]
        params_list = _as_params_list(self._or_default(sampling_params), len(prompts))
        outputs = self._run(prompts, params_list, use_tqdm, _as_lora_list(lora_request, len(prompts)))
        return [dataclasses.replace(o, prompt=r.text) for o, r in zip(outputs, rendered, strict=True)]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        pooling_task: str = "embed",
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt's final hidden states (after the model's final norm) into one vector
        (`PoolingParams`: LAST token by default, L2-normalized); returns one `PoolingRequestOutput`
        per prompt, in input order. Prompts take `generate`'s forms. Pooling requests generate
        nothing and may share the engine with generation requests; with data parallelism they are
        spread over the replicas as generation requests are. `pooling_task="classify"`: the
        classification head's probabilities instead (see `classify`)."""
        check_serves(self._served, "pooling", f"LLM.encode(pooling_task={pooling_task!r})")
        if pooling_task not in get_args(PoolingTask):
            raise ValueError(
                f"pooling_task {pooling_task!r} is not supported: 'embed' (a decoder's pooled hidden "
                "states) or 'classify' (a classification head's probabilities); token-level tasks are absent"
            )
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_pooling_list(pooling_params, len(prompt_list))
        if pooling_task == "classify":
            outputs = self.classify(prompt_list, use_tqdm=use_tqdm, pooling_params=params_list)
            return [
                PoolingRequestOutput(
                    o.request_id, PoolingOutput(torch.tensor(o.outputs.probs)), list(o.prompt_token_ids)
                )
                for o in outputs
            ]
        return self._pool(prompt_list, params_list, use_tqdm)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of every prompt from a `*ForSequenceClassification` checkpoint's
        head (softmax over its labels; sigmoid for one label), one `ClassificationRequestOutput`
        per prompt in input order: `output.outputs.probs`."""
        check_serves(self._served, "pooling", "LLM.classify")
        require_classifier(self._architecture, "LLM.classify")
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_pooling_list(pooling_params, len(prompt_list))
        return scoring.classify(self._pooling_run(use_tqdm), prompt_list, params_list)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """How well each pair of texts matches, one `ScoringRequestOutput` per pair
        (`output.outputs.score`): one data_1 text against every data_2 text, or pairs one to one.
        A one-label `*ForSequenceClassification` checkpoint scores each pair as a cross-encoder
        (the sigmoid of its logit over the tokenizer's pair encoding); any other model by the
        cosine similarity of the two texts' embeddings."""
        check_serves(self._served, "pooling", "LLM.score")
        tokenizer = self.engine.require_tokenizer()
        run = self._pooling_run(use_tqdm)
        return scoring.score(run, tokenizer, self._architecture, data_1, data_2, pooling_params)

    def _pooling_run(self, use_tqdm: bool) -> scoring.PoolingRun:
        def run(prompts: list[PromptInput], params: list[PoolingParams]) -> list[PoolingRequestOutput]:
            return self._pool(prompts, params, use_tqdm)

        return run

    def _pool(
        self, prompt_list: list[PromptInput], params_list: list[PoolingParams], use_tqdm: bool
    ) -> list[PoolingRequestOutput]:
        self._sleep.check_awake("LLM.encode")
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for index, (prompt, p) in enumerate(zip(prompt_list, params_list, strict=True)):
                request_id = f"pool-{next(self._ids)}"
                try:
                    engine.add_request(request_id, prompt, p)
                except ValueError as exc:
                    raise ValueError(f"prompt {index}: {exc}") from None
                order[request_id] = index
            results: list[PoolingRequestOutput | None] = [None] * len(order)
            with tqdm(
                total=len(order), desc="Pooling", unit="req", disable=not use_tqdm, dynamic_ncols=True
            ) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if isinstance(output, PoolingRequestOutput) and output.request_id in order:
                            results[order[output.request_id]] = output
                            self._metrics.record_pooled(len(output.prompt_token_ids))
                            bar.update(1)
        except BaseException:
            for request_id in order:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        missing = [rid for rid, i in order.items() if results[i] is None]
        if missing:
            raise RuntimeError(f"the engine went idle without finishing requests {missing[:5]}")
        return [r for r in results if r is not None]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (`encode` with pooling_task="embed"):
        `output.outputs.embedding` is a list of hidden_size floats."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def _or_default(
        self, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> SamplingParams | Sequence[SamplingParams]:
        return self.get_default_sampling_params() if params is None else params

    def _run(
        self,
        prompts: list[PromptInput],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        self._sleep.check_awake("LLM.generate")
        engine = self.engine
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = f"gen-{next(self._ids)}"
                lora = loras[index] if loras is not None else None
                try:
                    # generate() returns finished requests only: skip building per-step partial
                    # outputs. The copy checks every field again (a field may have been set since).
                    final_only = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                    engine.add_request(request_id, prompt, final_only, lora_request=lora)
                except ValueError as exc:
                    raise ValueError(f"prompt {index}: {exc}") from None
                order[request_id] = index
                added.append(request_id)
            return self._drain(order, use_tqdm)
        except BaseException:
            for request_id in added:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()
            raise

    def _drain(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not isinstance(output, RequestOutput):
                        continue  # a pooling request added beside this call's (llm_engine)
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        self._metrics.record(output)
                        out_tokens += sum(len(o.token_ids) for o in output.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"{out_tokens / max(elapsed, 1e-9):.1f} tok/s out")
        finally:
            bar.close()
        missing = [rid for rid, i in order.items() if results[i] is None]
        if missing:
            raise RuntimeError(f"the engine went idle without finishing requests {missing[:5]}")
        return [r for r in results if r is not None]


def _as_prompt_list(prompts: object) -> list[PromptInput]:
    """Every prompt in the engine's form (`inputs.to_engine_prompt`). Raises ValueError naming the
    prompt and what is wrong with it."""
    if is_single_prompt(prompts):
        return [to_engine_prompt(prompts, "prompt")]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        return [to_engine_prompt(prompts, "prompts")]  # refuses it, naming its type
    items = list(prompts)
    if not items:
        raise ValueError("prompts is empty: give a string, a list of strings or lists of token ids")
    return [to_engine_prompt(p, f"prompt {i}") for i, p in enumerate(items)]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts: give one, or one per prompt")
    for i, p in enumerate(plist):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return plist


def _as_lora_list(
    loras: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None] | None:
    """One LoRARequest (or None) per prompt; None when no prompt has one. Raises ValueError."""
    if loras is None:
        return None
    if isinstance(loras, LoRARequest):
        return [loras] * n
    if isinstance(loras, str | bytes) or not isinstance(loras, Sequence):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(loras).__name__}")
    llist = list(loras)
    if len(llist) != n:
        raise ValueError(f"got {len(llist)} lora_requests for {n} prompts: give one, or one per prompt")
    for i, lora in enumerate(llist):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request[{i}] must be a LoRARequest or None, got {type(lora).__name__}")
    return llist


def _as_pooling_list(params: PoolingParams | Sequence[PoolingParams] | None, n: int) -> list[PoolingParams]:
    if params is None:
        return [PoolingParams()] * n
    if isinstance(params, PoolingParams):
        return [params] * n
    if isinstance(params, SamplingParams):
        raise ValueError("pooling_params must be a PoolingParams, got SamplingParams: use generate()")
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} PoolingParams for {n} prompts: give one, or one per prompt")
    for i, p in enumerate(plist):
        if not isinstance(p, PoolingParams):
            raise ValueError(f"pooling_params[{i}] must be a PoolingParams, got {type(p).__name__}")
    return plist


def _architecture(engine: LLMEngine) -> str:
    """The checkpoint's architecture (its transformers class name). A data-parallel front end
    holds no model, so it reads the checkpoint's config."""
    if engine.in_process:
        return engine.setup.spec.architecture
    source = resolve_model_source(engine.args.model, engine.args.gguf_file)
    return architecture_of(load_config(source, trust_remote_code=engine.args.trust_remote_code))


def _check_priority(priority: Sequence[int] | None, n: int) -> None:
    """Raise ValueError unless `priority` is None or one 0 per prompt: no scheduling policy here
    orders requests by priority, so another value would be silently ignored."""
    if priority is None:
        return
    values = list(priority)
    if len(values) != n:
        raise ValueError(f"got {len(values)} priorities for {n} prompts: give one per prompt")
    others = sorted({p for p in values if p != 0})
    if others:
        raise ValueError(
            f"priority {others[0]} given, but this engine has no priority scheduling (scheduling_policy "
            "is fcfs or makespan): leave priority out, or give 0"
        )


def _describe_validation_error(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(x) for x in err["loc"]) or "arguments"
        parts.append(f"{field}: {err['msg']} (got {err.get('input')!r})")
    return "invalid engine arguments: " + "; ".join(parts)


# generation_config.json field -> SamplingParams field (the ones vLLM takes as defaults), from
# the parameters' declarations.
_GENERATION_DEFAULTS = {d.generation_config: d.name for d in SAMPLING_PARAMS if d.generation_config}


def generation_defaults(model: str | None) -> SamplingParams:
    """SamplingParams from the `generation_config.json` beside a checkpoint (SamplingParams()
    for a GGUF file, the embedded model, or a folder without one). Raises ValueError naming the
    file when one of its values is out of range."""
    if model is None or not os.path.isdir(model):
        return SamplingParams()
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return SamplingParams()
    with open(path) as f:
        config = json.load(f)
    values = {
        ours: config[theirs]
        for theirs, ours in _GENERATION_DEFAULTS.items()
        if config.get(theirs) is not None
    }
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
