"""The `pagedserve` CLI frame (one module per subcommand, broken ones isolated) and the
`platforms` report for platforms whose hooks fail."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugins_support import platform_info, platform_plugin, unique_module_name

import pagedserve.cli
from pagedserve.cli import main as cli_main
from pagedserve.cli.platforms import describe, format_text
from pagedserve.platforms.registry import PlatformRegistry, forget_platforms


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
