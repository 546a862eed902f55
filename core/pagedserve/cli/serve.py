"""`pagedserve serve [MODEL]`: the OpenAI-compatible HTTP server.

The engine core starts first (in its own process) and the port is bound only once the model is
loaded, so "serving on" in the log means requests will be answered. `--port 0` picks a free port;
the log line says which. SIGTERM or Ctrl-C stop accepting connections, let requests in flight
finish for up to `--shutdown-timeout` seconds, then abort the rest and stop the engine core.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING

from pagedserve.cli.engine_options import add_engine_options, engine_args_from
from pagedserve.config import EngineArgs
from pagedserve.server.tool_parsers import PARSERS

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("pagedserve.serve")

_SERVER_MODULES = ("fastapi", "uvicorn", "zmq", "msgspec", "prometheus_client")
"""Import names of the `serve` extra's packages."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over OpenAI's HTTP API")
    parser.add_argument(
        "model", nargs="?", default=None, help="checkpoint directory or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port, logged)")
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: from MODEL)"
    )
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="the tool-call format of the model's free text (needed for tool_choice='auto')",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds requests in flight may take to finish after SIGTERM",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level")
    add_engine_options(parser)
    parser.set_defaults(handler=run)


def default_served_name(model: str | None) -> str:
    """The name clients use when --served-model-name is not given: the model path's last part."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf") or model


def run(args: argparse.Namespace) -> int:
    engine_args = engine_args_from(args, args.model)
    if not 0 <= args.port <= 65535:
        print(f"pagedserve serve: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    missing = [m for m in _SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"pagedserve serve: {', '.join(missing)} not installed; install the server's dependencies "
            "with: pip install 'pagedserve[serve]'",
            file=sys.stderr,
        )
        return 1
    logging.getLogger("pagedserve").setLevel(logging.INFO)
    try:
        return asyncio.run(_serve(args, engine_args))
    except KeyboardInterrupt:
        return 0


async def _serve(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    # Heavy imports here: `pagedserve --help` must stay fast.
    import uvicorn

    from pagedserve.server.api_server import ServerConfig, build_app
    from pagedserve.server.async_engine import AsyncLLMEngine, EngineDeadError

    try:
        engine = await AsyncLLMEngine.launch(engine_args)
    except (EngineDeadError, ValueError) as exc:  # ValueError: too few GPUs for the replicas
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 1
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as exc:
            print(f"pagedserve serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1
        config = ServerConfig(
            served_model_name=args.served_model_name or default_served_name(engine_args.model),
            api_key=args.api_key,
            tool_call_parser=args.tool_call_parser,
        )
        app = build_app(engine, config)
        server = _graceful_server(
            uvicorn.Config(
                app,
                log_level=args.log_level,
                timeout_graceful_shutdown=max(args.shutdown_timeout, 0.1),
            )
        )
        host, port = sock.getsockname()[:2]
        print(
            f"pagedserve: serving {config.served_model_name!r} on http://{host}:{port} "
            f"(engine core pid {engine.core_pid})"
            + (f", data-parallel replicas' pids {engine.core_pids}" if len(engine.core_pids) > 1 else ""),
            file=sys.stderr,
            flush=True,
        )
        await server.serve(sockets=[sock])
    finally:
        await engine.shutdown()
    return 0


def _graceful_server(config: uvicorn.Config) -> uvicorn.Server:
    """uvicorn's server, except that SIGTERM/SIGINT are not raised again after its graceful
    shutdown (uvicorn does, which would kill this process before the engine core is stopped).
    A second signal forces the exit. uvicorn is imported lazily: `pagedserve --help` stays fast."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:
                self.force_exit = True
            else:
                self.should_exit = True

    return GracefulServer(config)
