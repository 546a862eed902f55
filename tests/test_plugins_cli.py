"""The `pagedserve` CLI frame (one module per subcommand, broken ones isolated) and the
`platforms` report: platforms whose hooks fail, and every capability field of a backend."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import pytest
from plugins_support import platform_info, platform_plugin, unique_module_name

import pagedserve.cli
import pagedserve_cpu_reference.plugin as cpu_reference_plugin
from pagedserve.cli import main as cli_main
from pagedserve.cli.platforms import describe, format_text
from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry, forget_platforms
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend


@pytest.fixture
def extra_subcommands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """Three extra subcommand names: one that works, one whose module raises on import, one missing."""
    good, broken, missing = (unique_module_name(p) for p in ("good", "broken", "missing"))
    (tmp_path / f"{good}.py").write_text(
        "def add_parser(subparsers):\n"
        f"    p = subparsers.add_parser({good!r}, help='says hello')\n"
        "    p.add_argument('--who', default='world')\n"
        "    p.set_defaults(handler=lambda args: print('hello', args.who) or 0)\n"
    )
    (tmp_path / f"{broken}.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.setattr(pagedserve.cli, "__path__", [*pagedserve.cli.__path__, str(tmp_path)])
    monkeypatch.setattr(cli_main, "SUBCOMMANDS", (*cli_main.SUBCOMMANDS, broken, good, missing))
    monkeypatch.delenv("PAGEDSERVE_STRICT_PLUGINS", raising=False)
    forget_platforms()
    return good, broken, missing


def test_a_broken_subcommand_does_not_break_the_others(
    extra_subcommands: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    good, broken, missing = extra_subcommands
    assert cli_main.main([good, "--who", "plugins"]) == 0
    assert capsys.readouterr().out.strip() == "hello plugins"
    assert cli_main.main(["platforms"]) == 0
    capsys.readouterr()

    assert cli_main.main([broken, "--any", "args"]) == 1
    err = capsys.readouterr().err
    assert f"the {broken!r} command is unavailable" in err
    assert "ModuleNotFoundError: No module named 'not_a_real_dependency_xyz'" in err

    with pytest.raises(SystemExit):
        cli_main.main(["--help"])
    help_text = capsys.readouterr().out
    assert "platforms" in help_text and good in help_text
    assert f"{broken}" in help_text and "(unavailable: ModuleNotFoundError" in help_text
    assert missing not in help_text  # a subcommand not in this build is simply absent


def test_unknown_subcommand_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main.main(["frobnicate"])
    assert e.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_report_shows_hook_failures_per_platform() -> None:
    registry = PlatformRegistry.from_plugins(
        [("bare", platform_plugin(platform_info("bare", available=False, reason="no accelerator")))]
    )
    report = describe(registry)
    [entry] = report["platforms"]
    assert entry["available"] is False and entry["cache_ops"] is None
    assert "has no cache ops" in entry["cache_ops_error"]
    text = format_text(report)
    assert "bare  [NOT available: no accelerator]" in text
    assert "cache ops: ERROR: platform 'bare'" in text
    assert "attention backends: ERROR: platform 'bare'" in text


def _backend_block(text: str, name: str) -> list[str]:
    """The text report's lines for attention backend `name`: its header and indented lines."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  attention backend {name} ("))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        block.append(line)
    return block


def _cpu_reference_entry(report: dict[str, Any]) -> dict[str, Any]:
    [platform] = [p for p in report["platforms"] if p["name"] == "cpu_reference"]
    [backend] = [b for b in platform["attention_backends"] if b["name"] == "cpu_reference"]
    return backend


def test_report_shows_every_capability_of_cpu_reference() -> None:
    """The in-tree reference declares both API 1.8 promises; the report shows them, and every
    other field of its capabilities, in JSON and in text."""
    report = describe(PlatformRegistry.from_plugins([("cpu_reference", cpu_reference_plugin)]))
    backend = _cpu_reference_entry(json.loads(json.dumps(report)))
    caps = ReferenceAttentionBackend.capabilities
    assert [k for k in backend if k not in ("name", "class", "features")] == [f.name for f in fields(caps)]
    assert backend["deterministic"] is True and caps.deterministic
    assert backend["exact_float32"] is True and caps.exact_float32
    assert backend["sliding_window"] is True and backend["logit_softcap"] is True
    assert backend["max_query_len"] is None and backend["kv_cache_layout"] == "NHD"
    assert backend["head_sizes"] == list(range(1, 513))
    assert backend["block_sizes"] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert backend["dtypes"] == ["bfloat16", "float16", "float32", "float64"]
    assert backend["kv_cache_dtypes"] == [
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    ]
    assert backend["features"] == [
        "sliding_window",
        "logit_softcap",
        "deterministic",
        "exact_float32",
        "attention_sinks",
        "cascade_attention",
    ]

    assert _backend_block(format_text(report), "cpu_reference")[1:] == [
        "    head sizes: 1-512",
        "    dtypes: bfloat16, float16, float32, float64",
        "    block sizes: 1, 2, 4, 8, 16, 32, 64, 128",
        "    quantized KV caches: float8_e4m3fn, float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz",
        "    layout: NHD   max query len: any",
        "    features: sliding_window, logit_softcap, deterministic, exact_float32, attention_sinks, "
        "cascade_attention",
    ]


def test_cli_json_shows_the_api_1_8_flags(capsys: pytest.CaptureFixture[str]) -> None:
    forget_platforms()
    assert cli_main.main(["platforms", "--json"]) == 0
    backend = _cpu_reference_entry(json.loads(capsys.readouterr().out))
    assert backend["deterministic"] is True and backend["exact_float32"] is True


@dataclass(frozen=True, slots=True)
class _LaterCapabilities(AttentionCapabilities):
    """Capabilities with fields a later plugin API might add, which the CLI does not know."""

    fused_rope: bool = False
    max_batch_tokens: int | None = None


class _LaterBackend(ReferenceAttentionBackend):
    name: ClassVar[str] = "later"
    capabilities: ClassVar[AttentionCapabilities] = _LaterCapabilities(
        head_sizes=frozenset({64}),
        dtypes=frozenset(ReferenceAttentionBackend.capabilities.dtypes),
        block_sizes=frozenset({16}),
        fused_rope=True,
        max_batch_tokens=4096,
    )


def test_a_capability_field_the_cli_does_not_know_is_shown() -> None:
    @hookimpl
    def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
        return [_LaterBackend] if platform == "later" else None

    plugin = platform_plugin(
        platform_info("later"), pagedserve_attention_backends=pagedserve_attention_backends
    )
    report = describe(PlatformRegistry.from_plugins([("later", plugin)]))
    [backend] = report["platforms"][0]["attention_backends"]
    assert backend["fused_rope"] is True and backend["max_batch_tokens"] == 4096
    assert backend["features"] == ["fused_rope"]
    block = _backend_block(format_text(report), "later")
    assert "    layout: NHD   max query len: any   max batch tokens: 4096" in block
    assert (
        "    features: fused_rope (not declared: sliding_window, logit_softcap, deterministic, "
        "exact_float32, attention_sinks, cascade_attention)" in block
    )
