"""Saved compiled forwards (`cpu_compile=True`, `compile_cache=True`): a second engine in a fresh
process loads every graph instead of compiling it and gives the same greedy tokens as the first
and as the eager engine; the key follows the model; a file that cannot be used is compiled again;
`compile_cache=False` saves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import TINY_DECODER, random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.models.packed_int4 import MAX_PACKED_ROWS
from pagedserve.worker.compile.cpu_compile import (
    MAX_COMPILED_TOKENS,
    WARM_UP_SIZES,
    CompiledForward,
    size_class,
)
from pagedserve.worker.compile.saved_compiles import (
    compile_cache_root,
    graph_key,
    load_or_compile,
    saved_compiles_dir,
)

MAX_NEW = 8
PROMPTS = random_prompts(128, [9], seed=1) + random_prompts(128, [20, 5, 13], seed=2)

# Builds an engine, generates greedily and prints how each graph became ready and the tokens.
_BUILD = """
import json, sys
from pagedserve import LLM, SamplingParams
path, compile_cache = sys.argv[1], sys.argv[2] == "1"
max_new, prompts = int(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(path, platform="cpu_reference", skip_tokenizer_init=True, dtype="float32", block_size=4,
          max_model_len=64, cpu_compile=True, compile_cache=compile_cache)
params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, detokenize=False)
compiled = llm.engine.setup.core.runner.compiled
outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps({"origins": [o.how for o in compiled.origins], "tokens": outs}))
"""


def _build(checkpoint: Path, cache: Path, compile_cache: bool = True) -> tuple[dict[str, Any], str]:
    """Engine build and generation in a fresh process (so dynamo's in-memory state is empty):
    (its report, its stderr)."""
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _BUILD,
            str(checkpoint),
            "1" if compile_cache else "0",
            str(MAX_NEW),
            json.dumps(PROMPTS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report, done.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_hf_model(LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": 1}), seed=5)
    return save_checkpoint(hf, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def two_builds(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The cache folder, then the reports of a first build (empty cache) and of a second one."""
    cache = tmp_path_factory.mktemp("cache")
    first, _ = _build(checkpoint, cache)
    second, _ = _build(checkpoint, cache)
    return cache, first, second


def test_second_build_loads_saved_graphs_with_the_same_tokens(
    checkpoint: Path,
    two_builds: tuple[Path, dict[str, Any], dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, first, second = two_builds
    assert first["origins"] == ["compiled"] * len(WARM_UP_SIZES)
    assert second["origins"] == ["loaded"] * len(WARM_UP_SIZES)
    assert len(list((cache / "aot").glob("*.pt2"))) == len(WARM_UP_SIZES)
    assert not list((cache / "aot").glob("*.tmp"))  # atomic writes leave nothing behind
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    eager = LLM(
        str(checkpoint),
        platform="cpu_reference",
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=4,
        max_model_len=64,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    assert first["tokens"] == expected and second["tokens"] == expected


def test_unusable_saved_graph_is_compiled_again(
    checkpoint: Path, two_builds: tuple[Path, dict[str, Any], dict[str, Any]]
) -> None:
    cache, first, _ = two_builds
    victim = sorted((cache / "aot").glob("*.pt2"))[0]
    victim.write_bytes(b"not a compiled function")
    third, stderr = _build(checkpoint, cache)
    assert third["origins"].count("compiled") == 1 and third["origins"].count("loaded") == 2
    assert "not used" in stderr and third["tokens"] == first["tokens"]
    assert victim.read_bytes() != b"not a compiled function"  # rewritten


def test_switch_off_saves_nothing(checkpoint: Path, tmp_path: Path) -> None:
    report, _stderr = _build(checkpoint, tmp_path, compile_cache=False)
    assert report["origins"] == ["compiled"] * len(WARM_UP_SIZES)
    assert not (tmp_path / "aot").exists()


def test_guard_failure_at_first_call_compiles_again(tmp_path: Path) -> None:
    """A graph whose guards reject the warm-up input (here: saved for a one-element input, first
    called with two) is replaced, not run."""

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def compile_for(n: int) -> Any:
        return torch.compile(double, fullgraph=True, dynamic=True).aot_compile(((torch.ones(n),), {}))

    path = tmp_path / "g.pt2"
    _one, origin = load_or_compile(path, 1, lambda: compile_for(1), lambda fn: fn(torch.ones(1)))
    assert origin.how == "compiled" and path.exists()
    _again, origin = load_or_compile(path, 1, lambda: compile_for(1), lambda fn: fn(torch.ones(1)))
    assert origin.how == "loaded"
    two, origin = load_or_compile(path, 2, lambda: compile_for(2), lambda fn: fn(torch.ones(2)))
    assert origin.how == "compiled" and torch.equal(two(torch.ones(3)), torch.full((3,), 2.0))


def test_key_follows_the_model() -> None:
    def model(width: int) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.Linear(4, 4))

    base = graph_key(model(8), "spec-a", "cpu", "1")
    assert graph_key(model(8), "spec-a", "cpu", "1") == base  # weights' values are not in it
    assert graph_key(model(16), "spec-a", "cpu", "1") != base
    assert graph_key(model(8).to(torch.bfloat16), "spec-a", "cpu", "1") != base
    assert graph_key(model(8), "spec-b", "cpu", "1") != base
    assert graph_key(model(8), "spec-a", "cuda", "1") != base
    assert graph_key(model(8), "spec-a", "cpu", "2") != base


def test_size_classes_and_cache_root() -> None:
    assert [size_class(n) for n in (1, 2, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, MAX_COMPILED_TOKENS)] == [
        0,
        1,
        1,
        2,
        2,
    ]
    assert [size_class(n) for n in WARM_UP_SIZES] == [0, 1, 2]
    assert compile_cache_root({"PAGEDSERVE_CACHE_DIR": "/x"}) == Path("/x")
    assert saved_compiles_dir({"XDG_CACHE_HOME": "/y"}) == Path("/y/pagedserve/aot")


class _RefusingGraph:
    """A loaded graph whose guards refuse every input it was not warmed up on."""

    def __init__(self) -> None:
        self.calls = 0

    def guard_check(self, *args: object) -> bool:
        return False

    def __call__(self, *args: object) -> torch.Tensor:
        self.calls += 1
        raise AssertionError("a refused graph must not run")


def test_a_token_count_the_guards_refuse_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    class Model(torch.nn.Module):
        def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return (ids + positions).float()[:, None]

    compiled = CompiledForward(Model(), saved_dir=Path("unused"))  # type: ignore[arg-type]
    graph = _RefusingGraph()
    compiled._graphs = [graph, graph, graph]
    ids = torch.arange(3)
    with caplog.at_level("WARNING"):
        out = compiled(ids, ids)
        again = compiled(ids, ids)
    assert torch.equal(out, again) and out[:, 0].tolist() == [0.0, 2.0, 4.0] and graph.calls == 0
    assert sum("run eagerly" in r.getMessage() for r in caplog.records) == 1  # warned once
