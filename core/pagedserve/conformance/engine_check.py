"""The engine smoke check: a tiny random model generating a few greedy tokens with a platform's
attention backend and cache ops, against the same model on cpu_reference.

The kernel cases call `forward` directly; this check runs it the way the engine does, through the
model's attention layers (`attention.layer.attend`, which continues with what `forward` returns),
chunked prefill and decodes in one batch, in each dtype the engine would serve. A backend that
passes every kernel case but returns float32 in a bfloat16 model, or a tensor the next layer
cannot take, fails here with the exception the engine would raise.

The model is a 2-layer Llama built from a transformers config in code (random weights from
`fill_dummy_weights`, no checkpoint, no download). Both runs are fed the reference's greedy tokens
(teacher forcing), so one close call does not derail the rest; a step passes when the platform's
argmax is a token whose reference logit is within the dtype's tolerance of the reference's best.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import LlamaConfig

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.conformance.cases import BASE_HEADS, EngineCase, dtype_name
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import CaseResult, Status
from pagedserve.conformance.tolerances import tolerance_for
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.weights import fill_dummy_weights
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata

PROMPT_LENS = (11, 5, 17)  # chunked over several steps, so steps mix prefill chunks and decodes
NEW_TOKENS = 4
VOCAB_SIZE = 128
# Random tiny models have flat logits; scaling the LM head makes greedy choices clear-cut, so a
# step's pass or fail does not hang on rounding.
LM_HEAD_GAIN = 20.0
LOGIT_SLACK = 4.0  # allowed logit shortfall of the chosen token, in units of the dtype's tolerance


@dataclass(frozen=True, slots=True)
class _Step:
    """One scheduled batch: per request, its new token ids and their positions."""

    requests: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    ids: list[int]
    positions: list[int]


def tiny_config(case: EngineCase) -> LlamaConfig:
    """A 2-layer Llama with the case's head size and the suite's base head counts."""
    hq, hkv = BASE_HEADS
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=case.head_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _model(case: EngineCase) -> LlamaForCausalLM:
    # Built in float32 on the CPU, then cast, as the loader does (`native.to(dtype)`).
    model = LlamaForCausalLM(tiny_config(case), case.dtype).to(case.dtype)
    fill_dummy_weights(model, case.seed)
    with torch.no_grad():
        head = model.get_parameter("lm_head.weight")
        head.mul_(LM_HEAD_GAIN)
    return model.eval()


def _place(model: LlamaForCausalLM, device: torch.device) -> LlamaForCausalLM:
    """A copy of `model` on `device`, rotary frequencies included."""
    placed = copy.deepcopy(model).to(device)
    for module in placed.modules():
        place = getattr(module, "place", None)
        if callable(place):
            place(device)
    return placed


class _Run:
    """One model on one backend: its KV caches and forward context per step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        cache_ops: CacheOps,
        device: torch.device,
        block_table: torch.Tensor,
        case: EngineCase,
    ) -> None:
        spec = model.spec
        num_blocks = int(block_table.numel()) + 1
        self.model, self.backend, self.cache_ops, self.device = model, backend, cache_ops, device
        self.block_table = block_table
        self.case = case
        # NaN-filled: a read of a slot nobody wrote poisons the output instead of passing silently.
        self.kv_caches = [
            torch.full(
                spec.kv_cache_shape(num_blocks, case.block_size),
                float("nan"),
                dtype=case.dtype,
                device=device,
            )
            for _ in range(spec.num_layers)
        ]
        # The engine asks once, before the first step (EngineArgs.attention_reads_new_kv is on by default).
        self.new_kv_reads = backend.enable_new_kv_reads()

    @torch.no_grad()
    def logits(self, step: _Step) -> torch.Tensor:
        """The last row's logits of every request of `step`, float32 on the CPU."""
        table = self.block_table[step.requests]
        metadata = AttentionMetadata.build(
            step.query_lens, step.seq_lens, table, self.case.block_size, self.device
        )
        ctx = ForwardContext(
            metadata=metadata,
            kv_caches=self.kv_caches,
            backend=self.backend,
            cache_ops=self.cache_ops,
            new_kv_reads=self.new_kv_reads,
        )
        with forward_context(ctx):
            hidden = self.model(
                torch.tensor(step.ids, device=self.device), torch.tensor(step.positions, device=self.device)
            )
        if hidden.dtype != self.case.dtype:
            raise TypeError(f"the model's hidden states came out {hidden.dtype}, expected {self.case.dtype}")
        last = metadata.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last]).float().cpu()


def _schedule(tokens: list[list[int]], computed: list[int], done: list[bool], chunk: int) -> _Step:
    step = _Step([], [], [], [], [])
    for i, seq in enumerate(tokens):
        if done[i]:
            continue
        n = min(len(seq) - computed[i], chunk)
        step.requests.append(i)
        step.query_lens.append(n)
        step.seq_lens.append(computed[i] + n)
        step.ids.extend(seq[computed[i] : computed[i] + n])
        step.positions.extend(range(computed[i], computed[i] + n))
    return step


def check_engine_case(
    backend: AttentionBackend, cache_ops: CacheOps, case: EngineCase, device: torch.device, oracle: Oracle
) -> CaseResult:
    """Generate `NEW_TOKENS` greedy tokens per prompt on the platform (tensors on `device`) and on
    the oracle, and judge every platform step against the oracle's logits. Never raises for a
    failure of the platform."""
    name = backend.name
    gen = torch.Generator().manual_seed(case.seed)
    prompts = [torch.randint(1, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    max_len = max(PROMPT_LENS) + NEW_TOKENS
    blocks_per_req = -(-max_len // case.block_size)
    # Shuffled blocks, as a running engine's are; one spare block stays unused (and NaN).
    order = torch.randperm(len(prompts) * blocks_per_req, generator=gen) + 1
    block_table = order.view(len(prompts), blocks_per_req).to(torch.int32)
    model = _model(case)
    reference = _Run(model, oracle.attention, oracle.cache_ops, torch.device("cpu"), block_table, case)
    try:
        platform = _Run(_place(model, device), backend, cache_ops, device, block_table, case)
    except Exception as e:
        problem = (
            f"building the {dtype_name(case.dtype)} model's run on {device} raised {type(e).__name__}: {e}"
        )
        return CaseResult(name, case, Status.FAILED, (problem,), None)
    tolerance = tolerance_for(case.dtype)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    done = [False] * len(prompts)
    problems: list[str] = []
    step_index = 0
    while not all(done):
        step = _schedule(tokens, computed, done, case.prefill_chunk)
        expected = reference.logits(step)
        try:
            got = platform.logits(step)
        except Exception as e:
            problems.append(
                f"step {step_index} (query_lens {step.query_lens}, seq_lens {step.seq_lens}) raised "
                f"{type(e).__name__} in the {dtype_name(case.dtype)} model: {e} -- the engine would crash "
                "here"
            )
            break
        for row, i in enumerate(step.requests):
            computed[i] += step.query_lens[row]
            if computed[i] < len(tokens[i]):
                continue  # a prompt chunk that samples nothing
            judged = _judge(got[row], expected[row], float(tolerance.bound(expected[row].max())))
            if judged is not None:
                problems.append(f"step {step_index}, request {i} (token {len(tokens[i])}): {judged}")
            tokens[i].append(int(expected[row].argmax()))  # teacher forcing: the reference's token
            done[i] = len(tokens[i]) - len(prompts[i]) >= NEW_TOKENS
        step_index += 1
    status = Status.FAILED if problems else Status.PASSED
    return CaseResult(name, case, status, tuple(problems[:6]), None)


def _judge(got: torch.Tensor, expected: torch.Tensor, bound: float) -> str | None:
    """Why the platform's logits for one sampled token are wrong, or None."""
    if not bool(torch.isfinite(got).all()):
        return f"{int((~torch.isfinite(got)).sum())} non-finite logits"
    choice, best = int(got.argmax()), int(expected.argmax())
    shortfall = float(expected[best] - expected[choice])
    if shortfall > LOGIT_SLACK * bound:
        return (
            f"greedy token {choice}, expected {best} (its reference logit is {shortfall:.3g} below the best, "
            f"allowed {LOGIT_SLACK * bound:.3g})"
        )
    return None
