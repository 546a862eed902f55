"""The `pagedserve` CLI reports problems a user can fix in one line, `pagedserve <command>: ...`,
with a non-zero exit status (`--debug` brings the traceback back), and `platforms --explain` on a
host without a GPU says so instead of describing an assumed one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.cli import main as cli_main

_NO_GPU = torch.cuda.device_count() == 0


def _pagedserve(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter, as a user's shell would."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def _assert_one_line(result: subprocess.CompletedProcess[str], command: str, *needles: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"pagedserve {command}: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


def test_unknown_platform_is_one_line() -> None:
    _assert_one_line(
        _pagedserve("generate", "--platform", "nope", "hi"), "generate", "unknown platform 'nope'"
    )


@pytest.mark.skipif(not _NO_GPU, reason="needs a host where the cuda platform is unavailable")
def test_unavailable_platform_is_one_line() -> None:
    line = _assert_one_line(_pagedserve("generate", "--platform", "cuda", "hi"), "generate", "'cuda'")
    assert "not available" in line


def test_missing_model_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    _assert_one_line(
        _pagedserve("generate", "--model", str(missing), "hi"), "generate", str(missing), "does not exist"
    )


def test_invalid_engine_option_is_one_line() -> None:
    _assert_one_line(
        _pagedserve("generate", "--max-num-seqs", "0", "hi"),
        "generate",
        "invalid engine options",
        "--max-num-seqs",
    )


def test_debug_shows_the_traceback() -> None:
    result = _pagedserve("--debug", "generate", "--platform", "nope", "hi")
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert "PlatformError: unknown platform 'nope'" in result.stderr


def test_an_unexpected_error_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug (here a KeyError from a subcommand) is not disguised as a one-line user error."""

    def broken(args: object) -> int:
        raise KeyError("a bug")

    parser = cli_main.build_parser()
    args = parser.parse_args(["platforms"])
    args.handler = broken
    with pytest.raises(KeyError, match="a bug"):
        cli_main._run_handler(broken, args)


def test_multi_line_messages_become_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def fails(args: object) -> int:
        raise ValueError("first line\n  second line\n")

    args = cli_main.build_parser().parse_args(["platforms"])
    assert cli_main._run_handler(fails, args) == 2
    assert capsys.readouterr().err == "pagedserve platforms: first line second line\n"


@pytest.mark.skipif(not _NO_GPU, reason="describes a host without a GPU")
def test_explain_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main.main(["platforms", "--explain"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[1].startswith("no GPU found: ")
    # every GPU platform is named with its own reason, and none is described on assumed hardware
    for name in ("cuda", "rocm", "triton"):
        assert f"{name}: " in lines[1]
    assert "--device" in lines[1]
    assert "assumed" not in text and "H100" not in text and "MI300X" not in text


@pytest.mark.skipif(not _NO_GPU, reason="describes a host without a GPU")
def test_explain_for_a_named_platform_without_a_gpu_says_the_gpu_is_assumed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main.main(["platforms", "--explain", "--platform", "cuda", "--batch", "1x1x8192"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("no GPU found: cuda is unavailable here because cuda: ")
    assert lines[1].endswith("what follows is for an assumed GPU")
    assert lines[2].startswith("cuda/cuda_paged on NVIDIA H100")
