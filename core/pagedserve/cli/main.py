"""`pagedserve` entry point: collects one subcommand per module and dispatches to it.

A subcommand is a module `pagedserve.cli.<name>` listed in `SUBCOMMANDS` that defines

    def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None

which adds its parser and sets `handler=<function(args: argparse.Namespace) -> int>` on it with
`parser.set_defaults(handler=...)`. Modules are imported one at a time: a module that is not there
is left out, and one that fails to import becomes a subcommand that reports the error, so the
other subcommands keep working. Every module is imported for every invocation (to build `--help`),
so keep their top-level imports light: import torch, transformers or the engine inside the handler.

Errors a user can fix (a platform that is not here, a bad option, a missing model file) end the
command with one line, `pagedserve <command>: <problem>`, and exit status 2; `--debug` shows their
traceback instead. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

SUBCOMMANDS = ("platforms", "generate", "serve", "bench", "conformance")

Handler = Callable[[argparse.Namespace], int]
Subparsers = argparse._SubParsersAction  # argparse exposes no public name for this type

USAGE_ERROR_STATUS = 2  # as argparse exits for a bad command line


def _expected_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that describe a problem with the request or the host, not a bug: their
    message is the whole story. Imported late: the platform package is not light."""
    from pagedserve.platforms.errors import PlatformError

    # ValueError covers pydantic's ValidationError; OSError covers a missing or unreadable model file.
    return (PlatformError, ValueError, OSError)


def _one_line(message: str) -> str:
    """`message` on one line: its lines joined, so a multi-line explanation stays a single line."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _run_handler(handler: Handler, args: argparse.Namespace) -> int:
    """Run a subcommand, turning expected errors into one line on stderr and a non-zero status.
    With `--debug` they propagate, traceback and all."""
    command = args.command
    try:
        return handler(args)
    except SystemExit as exc:
        # Subcommand code ends with SystemExit("pagedserve: <problem>") for invalid options.
        if args.debug or not isinstance(exc.code, str):
            raise
        problem = exc.code.removeprefix("pagedserve: ")
        print(f"pagedserve {command}: {_one_line(problem)}", file=sys.stderr)
        return USAGE_ERROR_STATUS
    except _expected_errors() as exc:
        if args.debug:
            raise
        problem = _one_line(str(exc)) or type(exc).__name__
        # OSError's text alone can be as short as "[Errno 2] No such file or directory: 'x'";
        # ValueError and PlatformError messages are written to be read on their own.
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            problem = f"{type(exc).__name__}: {problem}"
        print(f"pagedserve {command}: {problem}", file=sys.stderr)
        return USAGE_ERROR_STATUS


def _broken_handler(module: str, error: BaseException) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        print(
            f"pagedserve: the {args.command!r} command is unavailable: importing {module} failed with "
            f"{type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 1

    return handler


def _add_subcommand(subparsers: Subparsers[argparse.ArgumentParser], name: str) -> None:
    """Import `pagedserve.cli.<name>` and let it add its parser. Mutates `subparsers`."""
    module_name = f"{__package__}.{name}"
    try:
        module = importlib.import_module(module_name)
        module.add_parser(subparsers)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            _add_broken(subparsers, name, module_name, e)
        else:
            logger.debug("subcommand %s is not part of this build", name)
    except Exception as e:
        _add_broken(subparsers, name, module_name, e)


def _add_broken(
    subparsers: Subparsers[argparse.ArgumentParser], name: str, module: str, error: Exception
) -> None:
    logger.warning("subcommand %s is unavailable: %s: %s", name, type(error).__name__, error)
    if name in subparsers.choices:  # add_parser ran before failing; replace it with the error report
        del subparsers.choices[name]
    parser = subparsers.add_parser(
        name, help=f"(unavailable: {type(error).__name__} while importing {module})"
    )
    # Whatever arguments follow are accepted, so the user sees the import error, not a usage error.
    parser.set_defaults(handler=_broken_handler(module, error), accepts_any_arguments=True)


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every subcommand that imports. Does not parse anything."""
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: a hardware-portable LLM inference engine"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of errors that are otherwise reported in one line",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        _add_subcommand(subparsers, name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pagedserve` with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    handler: Handler = args.handler
    return _run_handler(handler, args)


if __name__ == "__main__":
    sys.exit(main())
