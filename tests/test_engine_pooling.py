"""Pooling (`LLM.embed` / `LLM.encode`) on cpu_reference: a tiny random Llama's embeddings equal
transformers' final hidden states (after the final norm), pooled LAST / MEAN / CLS and normalized
or not, whatever the batch, the chunking of prompts, the prefix cache, asynchronous scheduling or
generation requests running beside them; misuse is refused naming the problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import AutoModel, LlamaConfig

from pagedserve import LLM, EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput, SamplingParams
from pagedserve.outputs import RequestOutput

VOCAB = 96
PROMPTS = random_prompts(VOCAB, [5, 17, 40, 1, 9, 23], seed=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=3,
    )
    return save_checkpoint(tiny_hf_model(config, seed=5), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def hidden(checkpoint: Path) -> list[torch.Tensor]:
    """transformers' last_hidden_state (after the final norm) of each prompt, [len, hidden]."""
    model: Any = AutoModel.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def _expected(states: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    vector = {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[params.pooling_type]
    return torch.nn.functional.normalize(vector, dim=0) if params.normalize else vector


def _llm(path: Path, **engine: Any) -> LLM:
    options: dict[str, Any] = {"max_model_len": 64, "block_size": 4, **engine}
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", **options)


def _check(outputs: list[EmbeddingRequestOutput], hidden: list[torch.Tensor], params: PoolingParams) -> None:
    assert len(outputs) == len(PROMPTS)
    for out, prompt, states in zip(outputs, PROMPTS, hidden, strict=True):
        assert out.finished and out.prompt_token_ids == prompt
        got = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == 64
        torch.testing.assert_close(got, _expected(states, params), rtol=1e-4, atol=1e-5)


ALL_PARAMS = [
    PoolingParams(),
    PoolingParams(pooling_type="MEAN"),
    PoolingParams(pooling_type="CLS"),
    PoolingParams(pooling_type="LAST", normalize=False),
    PoolingParams(pooling_type="MEAN", normalize=False),
]


@pytest.mark.parametrize("params", ALL_PARAMS, ids=lambda p: f"{p.pooling_type}-{p.normalize}")
@pytest.mark.parametrize(
    "engine",
    [
        {},
        # Chunks of 8 tokens: prompts longer than a step's budget are pooled across steps.
        {"max_num_batched_tokens": 8, "max_num_seqs": 3},
        {"max_num_batched_tokens": 8, "max_num_seqs": 4, "async_scheduling": True},
    ],
    ids=["one-step", "chunked", "chunked-async"],
)
def test_embeddings_equal_transformers_hidden_states(
    checkpoint: Path, hidden: list[torch.Tensor], params: PoolingParams, engine: dict[str, Any]
) -> None:
    llm = _llm(checkpoint, **engine)
    _check(llm.embed(PROMPTS, params, use_tqdm=False), hidden, params)
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.stats().num_blocks_in_use == 0


def test_defaults_are_last_token_normalized_and_encode_returns_tensors(
    checkpoint: Path, hidden: list[torch.Tensor]
) -> None:
    llm = _llm(checkpoint)
    (single,) = llm.embed(PROMPTS[2], use_tqdm=False)  # one prompt, not a list
    expected = _expected(hidden[2], PoolingParams(pooling_type="LAST", normalize=True))
    torch.testing.assert_close(torch.tensor(single.outputs.embedding), expected, rtol=1e-4, atol=1e-5)
    encoded = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False, pooling_task="embed")
    assert all(isinstance(o, PoolingRequestOutput) for o in encoded)
    for out, states in zip(encoded, hidden, strict=True):
        assert out.outputs.data.dtype == torch.float32
        torch.testing.assert_close(out.outputs.data, _expected(states, PoolingParams()), rtol=1e-4, atol=1e-5)
    # One PoolingParams per prompt, each its own pooling.
    mixed = [ALL_PARAMS[i % len(ALL_PARAMS)] for i in range(len(PROMPTS))]
    for out, states, p in zip(llm.embed(PROMPTS, mixed, use_tqdm=False), hidden, mixed, strict=True):
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding), _expected(states, p), rtol=1e-4, atol=1e-5
        )


def test_prefix_cache_hits_and_a_prompt_of_max_model_len(
    checkpoint: Path, hidden: list[torch.Tensor]
) -> None:
    llm = _llm(checkpoint, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=4)
    for params in (PoolingParams(), PoolingParams(pooling_type="MEAN")):
        for _ in range(2):  # the second pass finds the prompts' blocks cached
            _check(llm.embed(PROMPTS, params, use_tqdm=False), hidden, params)
    # A pooling prompt generates nothing: it may fill max_model_len exactly.
    full = random_prompts(VOCAB, [64], seed=1)[0]
    (out,) = llm.embed([full], use_tqdm=False)
    assert out.outputs.hidden_size == 64


def test_generation_beside_pooling_is_unaffected(checkpoint: Path, hidden: list[torch.Tensor]) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)
    alone = [o.outputs[0].token_ids for o in _llm(checkpoint).generate(PROMPTS, params, use_tqdm=False)]
    for engine in (
        {"max_num_batched_tokens": 8, "max_num_seqs": 4},
        {"max_num_batched_tokens": 8, "max_num_seqs": 4, "async_scheduling": True},
    ):
        llm = _llm(checkpoint, **engine)
        engine_ = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine_.add_request(f"gen-{i}", prompt, params)
            engine_.add_request(f"pool-{i}", prompt, PoolingParams(pooling_type="MEAN"))
        generated: dict[str, list[int]] = {}
        pooled: dict[str, list[float]] = {}
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                if isinstance(out, RequestOutput):
                    if out.finished:
                        generated[out.request_id] = out.outputs[0].token_ids
                else:
                    assert out.request_id not in pooled  # reported once
                    pooled[out.request_id] = out.outputs.data.tolist()
        assert [generated[f"gen-{i}"] for i in range(len(PROMPTS))] == alone
        for i, states in enumerate(hidden):
            expected = _expected(states, PoolingParams(pooling_type="MEAN"))
            torch.testing.assert_close(torch.tensor(pooled[f"pool-{i}"]), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_small_kv_pool(checkpoint: Path, hidden: list[torch.Tensor], mode: str) -> None:
    # Generation keeps growing while MEAN pooling requests prefill in chunks: blocks run out and
    # requests are preempted; a recomputed pooling request restarts its sum, a swapped one
    # continues it.
    llm = _llm(
        checkpoint,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        num_kv_blocks=20,
        preemption_mode=mode,
        swap_space_gib=0.01 if mode == "swap" else 0,
    )
    engine = llm.engine
    gen = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"gen-{i}", prompt, gen)
    out = llm.embed(PROMPTS, PoolingParams(pooling_type="MEAN"), use_tqdm=False)
    _check(out, hidden, PoolingParams(pooling_type="MEAN"))
    assert engine.core.scheduler.num_preemptions > 0


def test_misuse_is_refused_naming_the_problem(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolingParams(pooling_type="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normalize must be a bool"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    llm = _llm(checkpoint)
    with pytest.raises(ValueError, match=r"LLM\.classify needs a \*ForSequenceClassification checkpoint"):
        llm.encode(PROMPTS, pooling_task="classify")
    with pytest.raises(ValueError, match="pooling_task 'token_embed' is not supported"):
        llm.encode(PROMPTS, pooling_task="token_embed")
    with pytest.raises(ValueError, match="got SamplingParams: use generate"):
        llm.embed(PROMPTS, SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 2 PoolingParams for 6 prompts"):
        llm.embed(PROMPTS, [PoolingParams()] * 2)
    with pytest.raises(ValueError, match=r"prompt 1: .*max_model_len"):
        llm.embed([[1, 2], [1] * 65], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.embed([])
    assert not llm.engine.has_unfinished_requests()
    spec = _llm(checkpoint, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative decoding"):
        spec.embed(PROMPTS, use_tqdm=False)
    assert not spec.engine.has_unfinished_requests()


def test_tensor_parallel_pooling_equals_transformers(checkpoint: Path, hidden: list[torch.Tensor]) -> None:
    # Every rank pools its replicated hidden states; rank 0's vectors are the step's.
    llm = _llm(checkpoint, tensor_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=4)
    for params in (PoolingParams(), PoolingParams(pooling_type="MEAN")):
        _check(llm.embed(PROMPTS, params, use_tqdm=False), hidden, params)


def test_data_parallel_pooling_equals_one_engine(checkpoint: Path, hidden: list[torch.Tensor]) -> None:
    """Two replicas (engine-core processes) give the vectors one engine gives, in input order, with
    generation beside them; both replicas get work; an aborted pooling request leaves nothing."""
    from pagedserve.processes.data_parallel.offline_client import DataParallelCores

    params = PoolingParams(pooling_type="MEAN")
    one = _llm(checkpoint).embed(PROMPTS, params, use_tqdm=False)
    llm = _llm(checkpoint, data_parallel_size=2, platform="cpu_reference")
    engine = llm.engine
    assert isinstance(engine.client, DataParallelCores)
    try:
        got = llm.embed(PROMPTS, params, use_tqdm=False)
        _check(got, hidden, params)
        for mine, theirs in zip(got, one, strict=True):
            torch.testing.assert_close(
                torch.tensor(mine.outputs.embedding), torch.tensor(theirs.outputs.embedding)
            )
        assert all(n > 0 for n in engine.client.balancer.placed), engine.client.balancer.placed
        _check(llm.embed(PROMPTS, use_tqdm=False), hidden, PoolingParams())

        # Generation and pooling side by side on the replicas, then an abort of a pooling request.
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
        engine.add_request("gen", PROMPTS[0], greedy)
        engine.add_request("pool", PROMPTS[1], PoolingParams())
        engine.add_request("dropped", PROMPTS[2], PoolingParams())
        assert engine.abort_request("dropped") is None
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert set(finished) == {"gen", "pool"}
        pool = finished["pool"]
        assert isinstance(pool, PoolingRequestOutput) and pool.prompt_token_ids == PROMPTS[1]
        gen = finished["gen"]
        assert isinstance(gen, RequestOutput) and len(gen.outputs[0].token_ids) == 6
        assert engine.scheduler_counts() == (0, 0)

        with pytest.raises(ValueError, match=r"prompt 0: .*more than max_model_len"):
            llm.embed([[1] * 65], use_tqdm=False)
        engine.add_request("twice", PROMPTS[0], PoolingParams())
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("twice", PROMPTS[0], PoolingParams())
        engine.abort_request("twice")
        while engine.has_unfinished_requests():
            assert not [o for o in engine.step() if isinstance(o, PoolingRequestOutput)]
    finally:
        engine.shutdown()
