"""``tllm serve``: vLLM's OpenAI-compatible server, in this process, with tllm switched on
(docs/serving.md); the consumers travel as ``--additional-config '{"tllm": ...}'``."""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tllm_core.app import cli_common, stop
from tllm_core.app.progress import say
from tllm_core.app.summary import summarize
from tllm_core.runtime.settings import ADDITIONAL_CONFIG_KEY, MIB, RuntimeSettings, ServerSettings

EPILOG = """examples:
  tllm serve --consumer esamp --per-request
  tllm serve --consumer 'esamp:{"beta": 0.5}' --consumer stats --port 8001
  tllm serve --model ./my-hf-model --consumer esamp -- --max-num-seqs 64 --enforce-eager
  tllm serve --data-parallel-size 2 --consumer esamp --per-request   # two engines
  tllm serve --model M --tensor-parallel-size 2 --consumer stats -- --nnodes 2 \
      --node-rank 0 --master-addr 10.0.0.1 --master-port 29501          # leader node
  tllm serve --model M --tensor-parallel-size 2 --consumer stats --headless -- \
      --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29501  # follower

Arguments after `--` go to vLLM's server unchanged (`python -m
vllm.entrypoints.openai.api_server --help` lists them). Without --model the embedded
SmolLM2-135M-Instruct is served, under its folder name and as `default`."""


def server_argv(args: argparse.Namespace, model: str, settings: RuntimeSettings) -> list[str]:
    """vLLM server arguments: ours first, then the user's (after ``--``), which win."""
    extra = list(args.vllm_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    argv = ["--model", model, "--host", args.host, "--port", str(args.port)]
    if not any(a.startswith("--served-model-name") for a in extra):
        argv += ["--served-model-name", Path(model).name, "default"]
    argv += ["--dtype", args.dtype]
    if args.max_model_len is not None:  # else vLLM derives it from the model's config
        argv += ["--max-model-len", str(args.max_model_len)]
    for size in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, size) != 1:
            argv += ["--" + size.replace("_", "-"), str(getattr(args, size))]
    if headless(args) and "--headless" not in extra:
        argv += ["--headless"]
    # vLLM's default --shutdown-timeout, 0, kills the engine processes at once; a worker alone
    # may take 30 s (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS).
    argv += ["--shutdown-timeout", "60"]
    if not args.verbose:
        argv += ["--uvicorn-log-level", "warning", "--no-use-tqdm-on-load"]
    tllm = {ADDITIONAL_CONFIG_KEY: settings.model_dump()}
    return [*argv, "--additional-config", json.dumps(tllm), *extra]


# Seconds a server goes on after a consumer callback passed its deadline before its engine
# stops itself: /health fails meanwhile, so that a load balancer drains it first.
HUNG_STOP_S = 60.0


def _flag(
    extra: list[str],
    flags: tuple[str, ...],
    convert: Callable[[str], Any] = cli_common.WHOLE,
    default: Any = None,
) -> Any:
    """The last of ``flags``'s value among vLLM's arguments, checked (``default``: not given)."""
    found = default
    for i, a in enumerate(extra):
        flag, eq, value = a.partition("=")
        if flag in flags:
            if not eq and (i + 1 == len(extra) or extra[i + 1].startswith("--")):
                raise cli_common.CliError(f"{flag} (after --) expects a value, got none")
            value = value if eq else extra[i + 1]
            try:
                found = convert(value)
            except argparse.ArgumentTypeError as e:
                raise cli_common.CliError(f"{flag}: {e}") from None
    return found


def followers_store(extra: list[str]) -> tuple[str, int] | None:
    """Where a multi-node leader's engine store listens; None for one node or a follower."""
    from tllm_core.vllm_bridge.nodes import leader_store

    return leader_store(
        _flag(extra, ("--nnodes",)),
        _flag(extra, ("--node-rank",)),
        _flag(extra, ("--master-addr", "--master_addr"), str),
        _flag(extra, ("--master-port", "--master_port"), cli_common.PORT),
    )


def listen_host(args: argparse.Namespace) -> str:
    """The address the server listens on: ``--host``, or one given after ``--`` (vLLM's, which
    wins), checked as ``--host`` is (:func:`~tllm_core.app.cli_common.checked_host`)."""
    return _flag(args.vllm_args or [], ("--host",), cli_common.checked_host, args.host)


def listen_port(args: argparse.Namespace) -> int:
    """The port the server listens on, found and checked as :func:`listen_host` does the address."""
    return _flag(args.vllm_args or [], ("--port",), cli_common.PORT, args.port)


def server_url(host: str, port: int) -> str:
    """Where this machine reaches a server listening on ``host`` (a wildcard: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def parallel_ranks(args: argparse.Namespace) -> int:
    """Model ranks on this machine (a size given after ``--`` wins); one API server only."""
    extra = args.vllm_args or []
    servers = _flag(extra, ("--api-server-count", "-asc"), str)
    if servers is not None and servers != "1":
        raise cli_common.CliError(
            f"--api-server-count {servers}: tllm serve runs one API server (its request "
            "checks and /tllm routes live in that process); allowed: 1. Several engines "
            "behind it: --data-parallel-size N"
        )
    dp = _flag(extra, ("--data-parallel-size", "-dp"), cli_common.COUNT, args.data_parallel_size)
    tp = args.tensor_parallel_size
    # This node's share: --data-parallel-size-local engines, else tp * dp / nodes.
    dp_local = _flag(extra, ("--data-parallel-size-local", "-dpl"))
    if dp_local is not None:
        return tp * max(dp_local, 1)
    return max(1, tp * dp // _flag(extra, ("--nnodes",), cli_common.COUNT, 1))


def headless(args: argparse.Namespace) -> bool:
    """``--headless`` (ours, or vLLM's after ``--``): this node runs engine ranks only."""
    return bool(args.headless) or "--headless" in (args.vllm_args or [])


# Seconds between reads of /tllm/counters: the engine is gone when the server stops, so its
# summary comes from the last answer (a server with an API key answers none: no summary).
COUNTERS_INTERVAL_S = 5.0
READY_WAIT_S = 3600.0  # the longest wait for the server to answer /health (a first compile)


class LastCounters:
    """The last report read from ``{url}/tllm/counters``."""

    def __init__(self, url: str, ready: Callable[[], None] = lambda: None):
        self.url, self.ready = url, ready
        self.report: dict[str, Any] | None = None
        self.read_at = 0.0
        self._stop = threading.Event()

    def read_once(self) -> bool:
        with contextlib.suppress(OSError, ValueError):
            report = _get_json(f"{self.url}/tllm/counters")
            if isinstance(report, dict) and "consumers" in report:
                self.report, self.read_at = report, time.monotonic()
                return True
        return False

    def start(self) -> None:
        """Say when the server answers /health, then read its counters now and then."""
        threading.Thread(target=self._follow, daemon=True, name="tllm-serve-counters").start()

    def _follow(self) -> None:
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline and not self._stop.wait(1):
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as r,
            ):
                if r.status == 200:
                    say(f"ready: {self.url}/v1{_runner_note(self.url)} (Ctrl-C stops the server)")
                    self.ready()
                    break
        while not self._stop.wait(COUNTERS_INTERVAL_S):
            self.read_once()

    def stop(self) -> None:
        self._stop.set()

    def lines(self) -> list[str]:
        """Summary lines (no ``tllm: `` prefix), empty before any read."""
        if self.report is None:
            return []
        runtime = self.report.get("runtime", {})
        age = time.monotonic() - self.read_at
        head = (
            f"served {runtime.get('requests_finished', 0)} request(s), "
            f"{runtime.get('rows_seen', 0)} token rows (counters read {age:.0f} s before the "
            "server stopped)"
        )
        return [head, *summarize({**self.report, "run": {}}).text()[1:]]


def describe(url: str, engine) -> list[str]:
    """Lines naming the URL, the consumers and their request keys."""
    from tllm_core.serving.keys import KEYS

    info = engine.describe()
    lines = [f"OpenAI API at {url}/v1 (model names: see GET {url}/v1/models)"]
    lines.append(f"counters at GET {url}/tllm/counters, status at GET {url}/tllm/status")
    if not info["consumers"]:
        lines.append("no consumers (the tllm runtime runs without any)")
    for name, c in info["consumers"].items():
        scope = "only on requests naming it in tllm_consumers" if c["per_request"] else "always"
        lines.append(f"consumer {name}: acts {scope}")
        lines += [f"  vllm_xargs {k['key']}: {k['allowed']}" for k in c["request_keys"]]
    lines.append("request keys for all: " + ", ".join(KEYS))
    return lines


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _runner_note(url: str) -> str:
    """ " on vLLM's V2 runner ..." from ``/tllm/status`` (empty: unreadable, e.g. an API key)."""
    try:
        runner = _get_json(f"{url}/tllm/status")["worker"]["runner"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f" on vLLM's {runner}"


def serve_settings(args: argparse.Namespace, checked: Any, fault_file: str) -> RuntimeSettings:
    """The engine's settings from ``tllm serve``'s flags (a flag not given: the default)."""
    return checked.settings(
        server=ServerSettings(max_body_bytes=args.max_body_mib * MIB, show_paths=args.show_paths),
        hung_stop_s=args.hung_stop,
        fault_file=fault_file,
        max_result_bytes=args.max_result_kib * 1024,
        callback_deadline_s=args.callback_deadline,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from tllm_core.app.default_model import default_model_path
    from tllm_core.app.engine import tell_run_failed, validate_consumers
    from tllm_core.runtime.notes import NoteFile
    from tllm_core.runtime.watchdog import read_note
    from tllm_core.serving.keys import EngineConsumers
    from tllm_core.vllm_bridge.families import check_model
    from tllm_core.vllm_bridge.parallel import bind_cpu_threads
    from tllm_core.vllm_bridge.server_entry import CheckedServer, close_http_soon, run_openai_server

    cli_common.quiet(args)
    cli_common.prepare_engine_processes(args)
    ranks = parallel_ranks(args)
    url = server_url(listen_host(args), listen_port(args))
    model = cli_common.local_model(args.model)
    checked = validate_consumers(args.consumer or [], model)
    if args.per_request:
        checked = checked.all_per_request()
    if model is None:
        model = str(default_model_path())
        checked = validate_consumers(checked, model)
    check_model(model, args.dtype)  # known refusals, before the server starts (as TllmLLM)
    fault_note = NoteFile("tllm-fault-")  # a hung callback's report, from the engine (watchdog.py)
    settings = serve_settings(args, checked, fault_note.path)
    engine = EngineConsumers.of(checked.specs, checked.configs, checked.registry)
    follower = headless(args)
    args.enforce_eager = "--enforce-eager" in (args.vllm_args or [])  # for the note
    headless_note = (
        "headless node: engine ranks only, no API server; the leader (node rank 0) serves the "
        "API, runs the consumers and gathers the counters"
    )
    lines = [headless_note] if follower else describe(url, engine)
    starting = "this node's engine ranks" if follower else "vLLM's OpenAI server"
    for line in [*lines, f"starting {starting} ({cli_common.engine_note(args)})"]:
        say(line)
    bind_cpu_threads(ranks)
    # The command's stop (its watchdog bounds the server's); a lost node is recorded there.
    signals = stop.installed() or stop.StopSignals()
    last = None
    if not follower:  # says when it is ready, and what the consumers did when it stops
        last = LastCounters(url, signals.note_children)  # a killed engine's files: at exit
        last.start()
        # A multi-node leader tells its followers when it is asked to stop.
        signals.nodes.followers_store = followers_store(list(args.vllm_args or []))
    wire = json.loads(json.dumps(settings.model_dump()))  # as the server reads it back
    pre = CheckedServer(settings=wire, engine=engine, nodes=signals.nodes)
    started_at = time.time()  # files older than this are not this server's (tllm_run_failed)
    with signals.noting_handlers(close_http_soon):  # vLLM's own stop, bounded by the watchdog
        run_openai_server(server_argv(args, model, settings), pre)
    if last is not None:
        last.stop()
    hung = read_note(fault_note.path)
    fault_note.close()
    if signals.nodes.lost():
        say(f"error: {signals.nodes.lost()}")
        stop.exit_now(1)
    if signals.received() is None and (hung is not None or not follower):
        # Nobody asked it to stop: a hung callback stopped it, or the engine failed.
        cause = (
            f"the server stopped itself: {hung.message()}, at {hung.where()}"
            if hung is not None
            else "the server stopped on its own: its engine failed (errors in its log)"
        )
        tell_run_failed(checked, cause, started_at)
        say(f"error: {cause.replace('(errors in its log)', '(errors above)')}")
        stop.exit_now(1)
    say("headless node stopped" if follower else "server stopped")
    for line in last.lines() if last is not None else []:
        say(line)
    stop.exit_now(0)


def add_command(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser(
        "serve",
        help="start vLLM's OpenAI-compatible server with tllm consumers",
        description="Start vLLM's OpenAI-compatible server with tllm switched on.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli_common.add_consumer_arg(
        s, "consumer to run, with an optional JSON config (repeatable), as for `tllm run`"
    )
    s.add_argument(
        "--per-request",
        action="store_true",
        help="consumers act only on requests naming them in vllm_xargs tllm_consumers",
    )
    cli_common.add_model_args(s)
    s.add_argument(
        "--host",
        type=cli_common.checked_host,
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)",
    )
    s.add_argument("--port", type=cli_common.PORT, default=8000, help="port (default 8000)")
    s.add_argument("--tensor-parallel-size", type=cli_common.COUNT, default=1, help="vLLM's option")
    s.add_argument(
        "--data-parallel-size",
        type=cli_common.COUNT,  # as parallel_ranks checks a size given after `--`
        default=1,
        help="vLLM's option: engines behind this one server, each with its own consumers "
        "(docs/scaling.md)",
    )
    s.add_argument(
        "--headless",
        action="store_true",
        help="a follower node of a multi-node engine: engine ranks only, no API server "
        "(vLLM's --headless; give --nnodes, --node-rank, --master-addr after `--`; "
        "docs/scaling.md)",
    )
    s.add_argument(
        "--max-body-mib",
        type=cli_common.checked_arg("max_body_bytes", MIB, ServerSettings),
        default=32,
        help="largest request body in MiB (HTTP 413 past it; default 32)",
    )
    s.add_argument(
        "--max-result-kib",
        type=cli_common.checked_arg("max_result_bytes", 1024),
        default=16 * 1024,
        help="largest per-request result returned with a completion (vllm_xargs "
        "tllm_results), in KiB: a request whose result a consumer bounds past it gets HTTP "
        "400 before generating; a larger result is replaced by an error (default 16384)",
    )
    s.add_argument(
        "--hung-stop",
        type=cli_common.checked_arg("hung_stop_s"),
        default=HUNG_STOP_S,
        metavar="S",
        help="seconds the server goes on, /health failing, after a consumer callback passed its "
        f"deadline, before its engine stops itself (default {HUNG_STOP_S:g})",
    )
    s.add_argument(
        "--show-paths",
        action="store_true",
        help="show server filesystem paths in /tllm/* responses (hidden by default)",
    )
    s.add_argument(
        "-v", "--verbose", action="store_true", help="show vLLM's logs and request lines"
    )
    s.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="more vLLM server arguments, after `--`",
    )
    s.set_defaults(func=cmd_serve)
