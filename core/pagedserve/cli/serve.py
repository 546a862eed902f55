"""`pagedserve serve [MODEL]`: the OpenAI-compatible HTTP server.

The engine core starts first (in its own process) and the port is bound only once the model is
loaded, so "serving on" in the log means requests will be answered. `--port 0` picks a free port;
the log line says which. SIGTERM or Ctrl-C stop accepting connections, let requests in flight
finish for up to `--shutdown-timeout` seconds, then answer the rest with OpenAI's 503 error (an
error event and `data: [DONE]` on a stream), abort them and stop the engine core.
`--api-server-count N` runs N such servers on the port, each over its share of the
data-parallel replicas (`processes.api_servers`). `--enable-lora --lora-modules name=path ...` serves
PEFT adapters beside the model, each under its own model name (`server.lora_modules`); every
adapter is read and checked in the engine core before the port opens.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import logging
import socket
import sys
import threading
from collections.abc import Callable, Coroutine
from multiprocessing.synchronize import Barrier
from types import FrameType
from typing import TYPE_CHECKING, Any

from pagedserve.cli.engine_options import add_engine_options, engine_args_from
from pagedserve.config import EngineArgs
from pagedserve.server.lora_modules import LoRAModule, parse_lora_modules
from pagedserve.server.tool_parsers import PARSERS

if TYPE_CHECKING:
    import uvicorn

    from pagedserve.processes.api_servers import ApiServerPlan

logger = logging.getLogger("pagedserve.serve")

RESPONSE_FLUSH_S = 2.0
"""Seconds between failing the requests left at the shutdown timeout and closing connections."""

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
        help="the tool-call format tool_choice='auto' parses in the model's free text (default: the "
        "format the model's chat template writes, else hermes)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let tool_choice='auto' (OpenAI's default with tools) run; on by default, as if vLLM's "
        "flag were given; --no-enable-auto-tool-choice makes it a 400",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds requests in flight may take to finish after SIGTERM",
    )
    parser.add_argument(
        "--max-request-body-mb",
        type=float,
        default=8.0,
        help="the largest request body accepted, in MiB (larger ones get 413 before they are read)",
    )
    parser.add_argument("--max-n", type=int, default=128, help="the most samples (n) one request may ask for")
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run chat templates sent in requests (a template is a program; refused by default)",
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=float,
        default=5.0,
        help="seconds a chat template may take to render a conversation before the request gets 400",
    )
    parser.add_argument(
        "--max-stored-responses",
        type=int,
        default=1024,
        help="responses of POST /v1/responses kept in memory for GET and previous_response_id "
        "(least recently used dropped first)",
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API-server processes sharing the port, each serving data-parallel-size / N replicas "
        "(one Python process streams about 10,000 tokens/s on a GPU host)",
    )
    parser.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="the event loop: auto takes uvloop when it is installed (the `serve` extra installs it)",
    )
    parser.add_argument(
        "--http",
        choices=("auto", "h11", "httptools"),
        default="auto",
        help="uvicorn's HTTP implementation: auto takes httptools when it is installed",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="with --enable-lora: PEFT adapters served under their own model names, as name=path or "
        'vLLM\'s JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; requests select one by '
        "sending its name as model",
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
    try:
        lora_modules = _lora_modules(args, engine_args)
    except ValueError as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"pagedserve serve: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    for flag, value in (
        ("--max-request-body-mb", args.max_request_body_mb),
        ("--max-n", args.max_n),
        ("--chat-template-timeout", args.chat_template_timeout),
        ("--max-stored-responses", args.max_stored_responses),
    ):
        if value <= 0:
            print(f"pagedserve serve: {flag} must be positive, got {value}", file=sys.stderr)
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
    if args.api_server_count != 1:
        return _serve_many(args, engine_args, lora_modules)
    try:
        return _run(_serve(args, engine_args, lora_modules), args.loop)
    except KeyboardInterrupt:
        return 0


def _lora_modules(args: argparse.Namespace, engine_args: EngineArgs) -> tuple[LoRAModule, ...]:
    """The adapters of `--lora-modules` (lora_int_id 1..n in order). Raises ValueError (one line)
    for entries given without --enable-lora, a malformed entry, a duplicate name or the served
    model's name."""
    entries: list[str] = args.lora_modules or []
    if entries and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine must be built with LoRA layers)")
    served = args.served_model_name or default_served_name(engine_args.model)
    return parse_lora_modules(entries, served)


def _run(main: Coroutine[Any, Any, int], loop: str) -> int:
    """Run the server's coroutine on the event loop `--loop` names. uvloop (libuv, in C) spends
    less of the API process on each streamed chunk than asyncio's selector loop: on a 2-CPU host
    under 512 streams, httptools took the process's CPU time per streamed token from 182 to 158
    us, and uvloop beside it to 147 us."""
    if loop == "asyncio" or (loop == "auto" and importlib.util.find_spec("uvloop") is None):
        logger.info("event loop: asyncio's")
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:
        main.close()
        raise SystemExit("pagedserve serve: --loop uvloop needs uvloop: pip install uvloop") from None
    logger.info("event loop: uvloop %s", uvloop.__version__)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _serve_many(
    args: argparse.Namespace, engine_args: EngineArgs, lora_modules: tuple[LoRAModule, ...]
) -> int:
    """`--api-server-count N`: N API-server processes on one port (`processes.api_servers`)."""
    from pagedserve.processes.api_servers import plan_api_servers, run_api_servers

    try:
        plans = plan_api_servers(engine_args, args.api_server_count)
    except ValueError as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        print(f"pagedserve serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    with sock:
        return run_api_servers(
            functools.partial(_serve_one, args, lora_modules), plans, sock, max(args.shutdown_timeout, 0.1)
        )


def _serve_one(
    args: argparse.Namespace,
    lora_modules: tuple[LoRAModule, ...],
    plan: ApiServerPlan,
    sock: socket.socket,
    barrier: Barrier,
) -> int:
    """One API-server process of `--api-server-count` (spawned: a fresh interpreter)."""
    from pagedserve.processes.api_servers import enter_process

    enter_process(plan)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [api server {plan.index}] %(message)s")
    logging.getLogger("pagedserve").setLevel(logging.INFO)
    try:
        status = _run(_serve(args, plan.engine_args, lora_modules, sock=sock, barrier=barrier), args.loop)
    except KeyboardInterrupt:
        status = 0
    sys.exit(status)


async def _serve(
    args: argparse.Namespace,
    engine_args: EngineArgs,
    lora_modules: tuple[LoRAModule, ...],
    *,
    sock: socket.socket | None = None,  # bound already (`--api-server-count`); None: bind here
    barrier: Barrier | None = None,  # the API-server processes start serving together
) -> int:
    # A one-replica server's engine core starts first: its imports and CUDA start overlap this
    # process's (`processes.engine_core.early_core`).
    from pagedserve.processes.engine_core.early_core import spawn_early_core

    early = None
    if engine_args.data_parallel_size == 1:
        early = spawn_early_core(
            engine_args.model_dump_json(), tensor_parallel_size=engine_args.tensor_parallel_size
        )
    try:
        # Heavy imports here: `pagedserve --help` must stay fast.
        import uvicorn

        from pagedserve.server.api_server import ServerConfig, build_app
        from pagedserve.server.async_engine import AsyncLLMEngine, EngineDeadError
        from pagedserve.server.warm_start import warm_up_streaming
    except BaseException:
        if early is not None:
            early.stop()
        raise

    try:
        engine = await AsyncLLMEngine.launch(engine_args, early=early)
    except (EngineDeadError, ValueError) as exc:  # ValueError: too few GPUs for the replicas
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 1
    try:
        # Every adapter is read and checked by the engine core now: a bad one stops the start,
        # naming it, instead of failing the first request that names it.
        for module in lora_modules:
            try:
                await engine.add_lora(module.lora_request)
            except (EngineDeadError, ValueError) as exc:
                print(f"pagedserve serve: --lora-modules {module.name}={module.path}: {exc}", file=sys.stderr)
                return 1
            logger.info(
                "LoRA adapter %r (lora_int_id %d) loaded from %s",
                module.name,
                module.lora_int_id,
                module.path,
            )
        try:
            sock = sock if sock is not None else listening_socket(args.host, args.port)
        except OSError as exc:
            print(f"pagedserve serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1
        if barrier is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
            except threading.BrokenBarrierError:
                print("pagedserve serve: another API-server process failed to start", file=sys.stderr)
                return 1
        config = ServerConfig(
            served_model_name=args.served_model_name or default_served_name(engine_args.model),
            api_key=args.api_key,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            max_request_body_bytes=int(args.max_request_body_mb * 2**20),
            max_n=args.max_n,
            trust_request_chat_template=args.trust_request_chat_template,
            chat_template_timeout_s=args.chat_template_timeout,
            lora_modules=lora_modules,
            max_stored_responses=args.max_stored_responses,
        )
        app = build_app(engine, config)
        # Not in the first streamed response's time to first token (`server.warm_start`).
        await warm_up_streaming()
        drain_s = max(args.shutdown_timeout, 0.1)
        server = _graceful_server(
            uvicorn.Config(
                app,
                log_level=args.log_level,
                http=args.http,
                # Past drain_s the requests still running are failed with a 503, which then needs a
                # moment to reach the clients before uvicorn cuts the connections.
                timeout_graceful_shutdown=drain_s + RESPONSE_FLUSH_S,
            ),
            on_first_signal=lambda: asyncio.get_running_loop().call_later(
                drain_s,
                engine.fail_in_flight,
                f"the server is shutting down: the request was still running after the {drain_s:g} s "
                "shutdown timeout",
            ),
        )
        host, port = sock.getsockname()[:2]
        line = (
            f"pagedserve: serving {config.served_model_name!r} on http://{host}:{port} "
            f"(engine core pid {engine.core_pid})"
            + (f", data-parallel replicas' pids {engine.core_pids}" if len(engine.core_pids) > 1 else "")
        )
        # One write with its newline: several API-server processes share stderr, and print's
        # separate write of the newline let two of these lines run together.
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        await server.serve(sockets=[sock])
    finally:
        await engine.shutdown()
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: any free port), for uvicorn to listen on.

    Made with proto=IPPROTO_TCP, which its accepted connections inherit: asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on sockets whose proto says TCP. With it on, a response whose
    head and body go out in two writes (every response here) waits for the client's delayed ACK,
    about 40 ms, on a kept-alive connection: a /health probe or each streamed chunk."""
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _graceful_server(config: uvicorn.Config, on_first_signal: Callable[[], object]) -> uvicorn.Server:
    """uvicorn's server, except that SIGTERM/SIGINT are not raised again after its graceful
    shutdown (uvicorn does, which would kill this process before the engine core is stopped), and
    the first signal also calls `on_first_signal` (on the event loop's thread). A second signal
    forces the exit. uvicorn is imported lazily: `pagedserve --help` stays fast."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:
                self.force_exit = True
            else:
                self.should_exit = True
                logger.info("stopping: no new connections; requests in flight may finish")
                on_first_signal()

    return GracefulServer(config)
