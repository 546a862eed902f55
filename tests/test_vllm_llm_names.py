"""What a vLLM script passes to `LLM` and its methods, with only the import changed: constructor
arguments (`trust_remote_code`, dtype aliases and torch dtypes, a tokenizer-only folder, `runner`
/ `task`), `priority`, `spaces_between_special_tokens`, OpenAI content parts in `chat` and its
rendered `prompt`, `reset_prefix_cache`'s bool, mutable `SamplingParams` checked when used,
`RequestOutputKind.DELTA`, and `score` (a cross-encoder checked against transformers, and
embedding similarity)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from server_support import build_tiny_model

from pagedserve import LLM
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SMALL = dict(max_model_len=128, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(str(folder), trust_remote_code=False, dtype=torch.float32, **SMALL)


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_dtype_aliases_and_torch_dtypes() -> None:
    from pagedserve.config import EngineArgs

    assert EngineArgs(dtype="half").dtype == "float16"
    assert EngineArgs(dtype="float").dtype == "float32"
    assert EngineArgs(dtype=torch.bfloat16).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(dtype="int8")


def test_a_tokenizer_only_folder(folder: Path, tmp_path: Path, llm: LLM) -> None:
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith((".jinja", "vocab.json")):
            shutil.copy(f, tokenizer_dir / f.name)
    assert not (tokenizer_dir / "config.json").exists()
    other = LLM(str(folder), tokenizer=str(tokenizer_dir), **SMALL)
    assert _tokens(other.generate("Hello", GREEDY, use_tqdm=False)) == _tokens(
        llm.generate("Hello", GREEDY, use_tqdm=False)
    )


def test_priority_zero_applies_and_others_are_refused(llm: LLM) -> None:
    assert len(llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 0])) == 2
    with pytest.raises(ValueError, match="priority 3 given, but this engine has no priority scheduling"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 3])
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])


def test_spaces_between_special_tokens_reaches_a_slow_tokenizer() -> None:
    from pagedserve.detokenizer import token_decoder

    class Slow:
        def decode(
            self,
            ids: list[int],
            skip_special_tokens: bool = False,
            spaces_between_special_tokens: bool = True,
        ) -> str:
            return (" " if spaces_between_special_tokens else "").join(f"<{i}>" for i in ids)

    assert token_decoder(Slow(), skip_special_tokens=False)([1, 2]) == "<1> <2>"
    joined = token_decoder(Slow(), skip_special_tokens=False, spaces_between_special_tokens=False)
    assert joined([1, 2]) == "<1><2>"
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")  # type: ignore[arg-type]


def test_chat_takes_content_parts_and_returns_the_rendered_prompt(llm: LLM) -> None:
    text = [{"role": "user", "content": "Hi there"}]
    halves = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    parts = [{"role": "user", "content": halves}]
    plain, with_parts = llm.chat(text, GREEDY, use_tqdm=False)[0], llm.chat(parts, GREEDY, use_tqdm=False)[0]
    assert with_parts.prompt_token_ids == plain.prompt_token_ids
    assert with_parts.outputs[0].token_ids == plain.outputs[0].token_ids
    rendered = llm.get_tokenizer().apply_chat_template(text, tokenize=False, add_generation_prompt=True)
    assert plain.prompt == rendered and "Hi there" in rendered
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: only text content parts"):
        llm.chat(image, GREEDY, use_tqdm=False)


def test_reset_prefix_cache_returns_a_bool(llm: LLM) -> None:
    llm.generate("a prompt long enough to fill one block of sixteen tokens or so", GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    llm.llm_engine.add_request("running", "still running", SamplingParams(max_tokens=8))
    assert llm.reset_prefix_cache() is False  # its blocks keep their prefixes
    llm.llm_engine.abort_request("running")
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def test_sampling_params_are_mutable_and_checked_when_used(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    params.max_tokens = 2
    assert [len(t) for t in _tokens(llm.generate("Hello", params, use_tqdm=False))] == [2]
    params.top_p = 0.0
    with pytest.raises(ValueError, match=r"prompt 0: top_p"):
        llm.generate("Hello", params, use_tqdm=False)
    # The engine keeps a checked copy: changing the caller's object later changes nothing running.
    engine = llm.llm_engine
    mine = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("copied", "Hello", mine)
    mine.max_tokens = 1
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if isinstance(o, RequestOutput) and o.finished]
    assert len(finals[0].outputs[0].token_ids) == 3


def test_delta_outputs_hold_only_what_is_new(llm: LLM) -> None:
    engine = llm.llm_engine
    delta = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta", "Hello", delta)
    pieces: list[list[int]] = []
    while engine.has_unfinished_requests():
        pieces += [list(o.outputs[0].token_ids) for o in engine.step() if isinstance(o, RequestOutput)]
    assert len(pieces) == 4 and all(len(p) == 1 for p in pieces)
    assert [t for p in pieces for t in p] == _tokens(llm.generate("Hello", GREEDY, use_tqdm=False))[0]
    assert RequestOutputKind("delta") is RequestOutputKind.DELTA


def test_runner_and_task_select_the_requests_served(folder: Path) -> None:
    pooling = LLM(str(folder), runner="pooling", **SMALL)
    with pytest.raises(ValueError, match=r"LLM\.generate is for generative models"):
        pooling.generate("Hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"LLM\.chat is for generative models"):
        pooling.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert len(pooling.embed("Hello", use_tqdm=False)[0].outputs.embedding) == 32
    embed_task = LLM(str(folder), task="embed", **SMALL)
    assert (
        embed_task.embed("Hello", use_tqdm=False)[0].outputs.embedding
        == pooling.embed("Hello", use_tqdm=False)[0].outputs.embedding
    )
    generate = LLM(str(folder), runner="generate", **SMALL)
    with pytest.raises(ValueError, match=r"LLM\.encode.* is for pooling.*runner='generate'"):
        generate.embed("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="task='embed' means runner='pooling'"):
        LLM(str(folder), runner="generate", task="embed", **SMALL)


def test_score_by_embedding_similarity(llm: LLM) -> None:
    embedded = llm.embed(["a cat", "a dog", "a car"], use_tqdm=False)
    vectors = [torch.tensor(o.outputs.embedding) for o in embedded]
    scores = llm.score("a cat", ["a dog", "a car"], use_tqdm=False)
    for out, v in zip(scores, vectors[1:], strict=True):
        expected = float(torch.nn.functional.cosine_similarity(vectors[0], v, dim=0))
        assert out.outputs.score == pytest.approx(expected, abs=1e-6)
    pairs = llm.score(["a cat", "a dog"], ["a dog", "a cat"], use_tqdm=False)
    assert pairs[0].outputs.score == pytest.approx(pairs[1].outputs.score, abs=1e-6)  # cosine is symmetric
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"LLM\.classify needs a \*ForSequenceClassification checkpoint"):
        llm.classify("a cat", use_tqdm=False)


def test_score_as_a_cross_encoder_matches_transformers(folder: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig.from_pretrained(folder)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = 1
    torch.manual_seed(1)
    hf = LlamaForSequenceClassification(config).eval()
    target = tmp_path / "reranker"
    hf.save_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(target)
    reranker = LLM(str(target), dtype="float32", **SMALL)
    query, documents = "what is a cat", ["a cat is an animal", "cars have wheels"]
    scores = reranker.score(query, documents, use_tqdm=False)
    for out, document in zip(scores, documents, strict=True):
        ids = tokenizer(text=query, text_pair=document)["input_ids"]
        with torch.no_grad():
            expected = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]).item()
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(expected, abs=1e-6)
