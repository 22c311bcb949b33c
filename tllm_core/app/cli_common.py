"""Helpers shared by ``tllm`` commands, built-in or contributed by plugins through the
``tllm_commands`` hook (docs/hooks.md lists them, with an example)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

if TYPE_CHECKING:
    from tllm_core.app.engine import ConsumersArg

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from tllm_core.api.request_settings import RESULTS_KEY, allowed, error_words
from tllm_core.api.results import json_safe
from tllm_core.app import default_model
from tllm_core.app.defaults import DEFAULT_DTYPE, KV_ENV, kv_cache_gib
from tllm_core.app.progress import RunProgress, say
from tllm_core.app.report_html import check_out_dir, write_report
from tllm_core.app.stop import exit_code
from tllm_core.app.summary import count_text, error_text, run_line, summarize, text_so_far
from tllm_core.runtime.model_config import read_model_config
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.vllm_bridge.errors import vllm_value_errors
from tllm_core.vllm_bridge.quiet import install_if_quiet, quiet_env

EXIT_ENGINE_DIED = 3  # a process of the engine died during the command (engine_watch)
# Engine start times of the embedded model on an idle 2-core machine (docs/getting-started.md).
START_COMPILE_S, START_CACHED_S, START_EAGER_S = 95, 40, 30
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# prompts x n x max_tokens at or below which a command runs eager unless told otherwise:
# compiling costs more start time than such a job gains (docs/getting-started.md).
EAGER_MAX_TOKENS = 2048


class CliError(ValueError):
    """Bad command-line input; reported as ``tllm: ...`` with exit status 2."""


def local_model(model: str | None) -> str | None:
    """``--model`` checked: a local Hugging Face folder (None: the embedded model)."""
    if model is None:
        return None
    if not Path(model).is_dir():
        raise CliError(f"--model must be a local model folder; {model!r} is not a directory")
    read_model_config(model, "--model")  # readable JSON with the sizes tllm needs, or exit 2
    return model


def checked_arg(
    field: str | Any, unit: int = 1, model: type[BaseModel] = RuntimeSettings
) -> Callable[[str], Any]:
    """An argparse ``type`` checked by settings field ``field`` itself, as ``TllmLLM`` and a
    server's JSON are (in ``unit``s of it: the message in those units, as typed), or by a type
    (:data:`COUNT`; its description: a note)."""
    named = isinstance(field, str)
    info = model.model_fields[field] if named else FieldInfo.from_annotation(field)
    finite = ConfigDict(allow_inf_nan=False)  # as the settings: every wait bounded
    number, what = TypeAdapter(info.annotation, config=finite), f"{field} " if named else ""
    if unit != 1:  # the field's bounds in the flag's unit (whole units within them)
        bounds = (_scaled(m, unit) for m in info.metadata)
        info = FieldInfo.from_annotation(Annotated[(info.annotation, *bounds)])
        what += f"in {({1024: 'KiB', 1024 * 1024: 'MiB'}).get(unit, f'units of {unit}')} "
    check = TypeAdapter(Annotated[(info.annotation, *info.metadata)])
    note = f" ({info.description})" if info.description and not named else ""

    def parse(text: str) -> Any:
        got = repr(text)
        try:
            value = number.validate_strings(text)
            got = str(value)
            check.validate_python(value)
        except ValidationError as e:
            words = f"{what}{error_words(e.errors()[0])}, got {got}"
            raise argparse.ArgumentTypeError(f"{words}; allowed: {allowed(info)}{note}") from None
        return value

    return parse


def _scaled(bound: Any, unit: int) -> Any:
    """Bound ``bound`` (``Ge(1024)``) of a whole-number setting in units of ``unit``
    (``Ge(1)`` in KiB)."""
    attr = next((a for a in ("ge", "gt", "le", "lt") if getattr(bound, a, None) is not None), "")
    if not attr:
        return bound
    b = getattr(bound, attr)
    # x * unit >= b  <=>  x >= ceil(b / unit), for whole x; x * unit > b  <=>  x > floor(...)
    return Field(**{attr: -(-b // unit) if attr in ("ge", "lt") else b // unit})


HOST_LOOKUP_S = 10.0  # --host: a name the resolver does not answer for is refused after this


def _host_problem(text: str) -> str | None:
    """Why vLLM could not listen on ``text`` (None: it can), as it will bind it (port 0 here)."""
    try:
        socket.getaddrinfo(text or None, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # UnicodeError: an empty label (``not..a..host``)
        return f"is not a host name or IP address ({getattr(e, 'strerror', None) or e})"
    try:  # as vLLM binds: IPv6 for an IPv6 address (resolved, with ':'), else IPv4
        with socket.socket(socket.AF_INET6 if ":" in text else socket.AF_INET) as s:
            s.bind((text, 0))
        return None
    except (OSError, UnicodeError) as e:
        return f"is not an address of this machine ({getattr(e, 'strerror', None) or e})"


def checked_host(text: str) -> str:
    """An address to serve on (``--host``), checked at parsing, not after the engine loaded;
    the name's lookup within :data:`HOST_LOOKUP_S` (a daemon thread: a resolver that never
    answers holds neither the command nor its exit)."""
    done, found = threading.Event(), []

    def look() -> None:
        try:
            found.append(_host_problem(text))
        except Exception as e:  # noqa: BLE001 - said as the problem, not as a silent resolver
            found.append(f"could not be looked up ({type(e).__name__}: {e})")
        finally:
            done.set()

    threading.Thread(target=look, name="tllm-host-lookup", daemon=True).start()
    if not done.wait(HOST_LOOKUP_S):
        why = f"was not resolved within {HOST_LOOKUP_S:g} s (the resolver did not answer)"
    elif found[0] is None:
        return text
    else:
        why = found[0]
    raise argparse.ArgumentTypeError(
        f"{text!r} {why}; allowed: an IP address or name of this machine: 127.0.0.1 (this "
        "machine only), 0.0.0.0 (every IPv4 interface), :: (every IPv6 interface), or the "
        "address of one of its interfaces"
    )


# Options counting something, and other whole numbers (vLLM would replace some silently).
COUNT, WHOLE = checked_arg(Annotated[int, Field(ge=1)]), checked_arg(Annotated[int, Field(ge=0)])
PORT = checked_arg(Annotated[int, Field(ge=1, le=65535)])  # else a traceback when vLLM binds


def add_consumer_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """``--consumer NAME[:JSON]`` (repeatable): the consumer option every command shares."""
    parser.add_argument("--consumer", action="append", metavar="NAME[:JSON]", help=help)


def add_model_args(g: Any) -> None:
    """The model options ``tllm run`` and ``tllm serve`` share."""
    g.add_argument(
        "--model", help="local Hugging Face model folder (default: embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=("auto", "bfloat16", "float32", "float", "float16", "half"),  # vLLM's own
        help="model dtype: float32 (float), bfloat16, float16 (half), auto (the model's own; "
        f"default {DEFAULT_DTYPE})",
    )
    for opt, help in (
        ("--max-model-len", "context length (default: the model's own, as vLLM derives it)"),
        (
            "--kv-cache-gib",
            "CPU KV cache size in whole GiB (sets VLLM_CPU_KVCACHE_SPACE; default 2)",
        ),
    ):
        g.add_argument(opt, type=COUNT, help=help)
    g.add_argument(
        "--callback-deadline",
        type=checked_arg("callback_deadline_s"),
        metavar="S",
        help="longest run of one consumer callback on the engine thread before the watchdog "
        "names it and stops the engine (default 120 s)",
    )


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """Model, engine, prompt and sampling options, ``--json`` and ``-v`` (as ``tllm run``)."""
    g = p.add_argument_group("model and engine")
    add_model_args(g)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no compilation (faster start, slower generation); default for a small job",
    )
    mode.add_argument(
        "--compile",
        action="store_true",
        help="compile with torch.compile even for a small job (default above "
        "prompts x n x max-tokens = 2048)",
    )
    g.add_argument("--max-num-seqs", type=COUNT, help="vLLM max_num_seqs")
    g.add_argument("--max-num-batched-tokens", type=COUNT, help="vLLM token budget per step")
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="disable prefix caching (every prompt row is computed and captured)",
    )
    for opt in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        g.add_argument(opt, type=COUNT, default=1, help="vLLM's option (docs/scaling.md)")
    g = p.add_argument_group("prompts and sampling")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts", type=Path, help="file with one prompt per line")
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        help="apply the model's chat template (default: when the model has one); --no-chat "
        "sends prompts as raw text",
    )
    g.add_argument(
        "-n",
        type=COUNT,
        default=4,
        help="samples per prompt (default 4; ESamp spreads the samples of a prompt apart)",
    )
    g.add_argument(
        "--max-tokens", type=COUNT, default=64, help="new tokens per sample (default 64)"
    )
    g.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, (0, 1] (default 1.0)")
    g.add_argument(
        "--top-k",
        type=checked_arg(Annotated[int, Field(ge=0, description="0 disables top-k")]),
        default=0,
        help="0 disables top-k",
    )
    g.add_argument("--min-p", type=float, default=0.0, help="0 disables min-p (default 0.0)")
    # vLLM's own bound on --seed (a larger seed fails in the engine, after its start)
    g.add_argument(
        "--seed",
        type=checked_arg(Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]),
        help="per-request sampling seed (default: none, unseeded)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument(
        "--results",
        metavar="NAMES",
        help="comma-separated consumers whose per-request results (e.g. export's rows, "
        "stats' figures) go into the --json output as request_results[prompt][sample] "
        "(the request key tllm_results; docs/serving.md#results-with-the-completion)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (outputs, counters)")
    p.add_argument("--counters", action="store_true", help="print every counter after the outputs")
    p.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write an HTML report (outputs side by side, summary, plots; one PNG per plot) "
        "and run.json to DIR",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="show vLLM's and torch's logs and warnings"
    )


def read_prompt_file(path: Path, what: str = "prompt file") -> list[str]:
    """The prompts in ``path``, one a line; a ValueError naming the file if missing or empty."""
    if not path.is_file():
        raise ValueError(f"{what} not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    prompts = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise ValueError(f"{what} {path} holds no prompt")
    return prompts


def sampling(args: argparse.Namespace):
    """``SamplingParams`` from the sampling options (vLLM's checks; ours ran before)."""
    from vllm import SamplingParams

    # The options of add_generation_args that are SamplingParams fields of the same name.
    names = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos")
    try:
        return SamplingParams(**{k: getattr(args, k) for k in names})
    except vllm_value_errors() as e:
        raise CliError(f"bad sampling option: {e}") from None


def quiet(args: argparse.Namespace) -> None:
    """Quiet logs and warnings unless ``-v``; call it first, before vLLM loads."""
    for k, v in quiet_env(bool(getattr(args, "verbose", False))).items():
        if k in ("PYTHONWARNINGS", "TLLM_QUIET"):
            os.environ[k] = v
        else:  # the user's own logging settings win
            os.environ.setdefault(k, v)
    install_if_quiet()


def set_cpu_kv_cache(gib: int | None) -> None:
    """``--kv-cache-gib``, else the user's ``VLLM_CPU_KVCACHE_SPACE``, else the default."""
    value = kv_cache_gib(gib)
    if value is not None:
        os.environ[KV_ENV] = value


def preload_libraries(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Prepend to ``LD_PRELOAD`` (``os.environ``'s: the engine processes') the libraries vLLM's
    CPU backend asks to have preloaded, tcmalloc and Intel OpenMP, of kinds it lacks
    (``TLLM_NO_PRELOAD=1``: off); returns what was added."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get("TLLM_NO_PRELOAD", "") not in ("", "0"):
        return []
    prefixes = dict.fromkeys([sys.prefix, sys.base_prefix, sys.exec_prefix])
    system = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/aarch64-linux-gnu")
    dirs = [*(Path(p) / "lib" for p in prefixes), *map(Path, system), Path("/usr/local/lib")]

    def find(*files: str) -> str | None:  # the first in the first folder holding one
        return next((str(d / f) for d in dirs for f in files if (d / f).is_file()), None)

    current = env.get("LD_PRELOAD", "")
    added = []
    tcmalloc = find("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
    if tcmalloc and "libtcmalloc" not in current:
        added.append(tcmalloc)
    iomp = find("libiomp5.so")
    # One OpenMP runtime only: vLLM refuses an LD_PRELOAD naming both libiomp and libgomp
    # (e.g. inherited from a process where vLLM preloaded PyTorch's libgomp itself).
    if iomp and not any(k in current for k in ("libiomp", "libomp", "libgomp")):
        added.append(iomp)
    if added:
        env["LD_PRELOAD"] = ":".join([*added, *([current] if current else [])])
    return added


def prepare_engine_processes(args: argparse.Namespace) -> None:
    """The environment the command's engine processes inherit; call it before they start."""
    from tllm_core.vllm_bridge.plugin import CLI_PID_ENV, command_process

    # The engine processes leave Ctrl-C to the command (it aborts, flushes, stops them).
    os.environ[CLI_PID_ENV] = str(os.getpid())
    # A forked one (vLLM's default on GPUs) does not load vLLM's plugins again: it runs this.
    os.register_at_fork(after_in_child=command_process)
    # vLLM's 5 s for a worker to exit is too short on a busy 2-core machine.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")
    set_cpu_kv_cache(getattr(args, "kv_cache_gib", None))
    preload_libraries()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from the model and engine options."""
    # vLLM's weight-loading bar: the command shows its own lines (all of vLLM's with -v).
    kw: dict[str, Any] = dict(
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        use_tqdm_on_load=bool(getattr(args, "verbose", False)),
    )
    for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, k, None) is not None:
            kw[k] = getattr(args, k)
    for k in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, k, 1) != 1:
            kw[k] = getattr(args, k)
    if getattr(args, "no_prefix_caching", False):
        kw["enable_prefix_caching"] = False
    return kw


def choose_eager(args: argparse.Namespace, new_tokens: int) -> str | None:
    """Eager mode for a small job unless ``--compile``/``--enforce-eager``; returns why."""
    told = getattr(args, "compile", False) or getattr(args, "enforce_eager", False)
    if told or new_tokens > EAGER_MAX_TOKENS:
        return None
    args.enforce_eager = True
    return f"a small job of {new_tokens} new tokens at most, --compile to compile"


def engine_note(args: argparse.Namespace) -> str:
    """What starting the engine involves and about how long it takes (2-core machine)."""
    if getattr(args, "enforce_eager", False):
        return f"eager mode, no compilation: about {START_EAGER_S} s"
    return (
        f"the first start of a model compiles it with torch.compile: about {START_COMPILE_S} s "
        f"on 2 cores; later starts reuse vLLM's compile cache: about {START_CACHED_S} s "
        f"(--enforce-eager skips compiling and generates slower)"
    )


def prompts(args: argparse.Namespace) -> list[str]:
    """The ``--prompts`` file's prompts, else the ``--prompt``'s, else the built-in prompt."""
    if args.prompts is not None:
        return read_prompt_file(args.prompts, "--prompts file")
    return args.prompt or [DEFAULT_PROMPT]


def has_chat_template(model: str) -> bool:
    """Whether the model folder ships a chat template (``--chat``'s default)."""
    cfg = Path(model) / "tokenizer_config.json"
    return (Path(model) / "chat_template.jinja").is_file() or (
        cfg.is_file() and "chat_template" in json.loads(cfg.read_text())
    )


def check_results_arg(asked: str, checked: Any) -> None:
    """``--results`` checked as a request's ``tllm_results`` is, against the consumers."""
    from tllm_core.serving.keys import EngineConsumers, validate_extra_args

    engine = EngineConsumers.of(checked.specs, checked.configs, checked.registry)
    try:
        validate_extra_args({RESULTS_KEY: asked}, engine, where="--results")
    except ValueError as e:
        raise CliError(str(e).replace("--results['tllm_results']", "--results")) from None


def _outputs(
    done: list[Any], first: int, num_prompts: int, n: int
) -> tuple[list[list[str | None]], list[list[Any]], int]:
    """(texts, encoded results, tokens) per prompt and sample from the finished outputs of
    this run's requests (request ids from ``first``); an unfinished sample stays None."""
    from tllm_core.api.results import encode

    texts: list[list[str | None]] = [[None] * n for _ in range(num_prompts)]
    results: list[list[Any]] = [[None] * n for _ in range(num_prompts)]
    tokens = 0
    for o in done:
        i = int(o.request_id) - first
        if 0 <= i < num_prompts:
            for c in o.outputs:
                texts[i][c.index] = c.text
                tokens += len(c.token_ids)
                results[i][c.index] = encode(getattr(c, "tllm", None))
    return texts, results, tokens


def _cut_short(
    cut: dict[str, dict[int, tuple[str, bool]]], first: int, texts: list[list[str | None]]
) -> list[list[str | None]]:
    """From ``TllmLLM.cut_short`` (request ids from ``first``): each sample of a request cut
    short that had finished goes into ``texts``; returned, the text each unfinished sample
    had (None for a finished one)."""
    partial: list[list[str | None]] = [[None] * len(ts) for ts in texts]
    for rid, samples in cut.items():
        i = int(rid) - first
        for j, (text, finished) in samples.items():
            if 0 <= i < len(texts) and 0 <= j < len(texts[i]) and texts[i][j] is None:
                (texts[i] if finished else partial[i])[j] = text
    return partial


def generate_with(
    args: argparse.Namespace,
    consumers: ConsumersArg,
    extra_engine: dict | None = None,
    status: Callable[[], str] | None = None,
) -> tuple[list[str], list[list[str | None]], dict[str, Any]]:
    """Start the engine with ``consumers``, generate for the prompts of ``args``, close;
    return (prompts, texts per prompt and sample, report). Ctrl-C makes the report partial
    (``report["run"]["interrupted"]``, unfinished samples None); ``extra_engine``: more
    ``TllmLLM`` keyword arguments than the flags give."""
    from tllm_core.app.engine import TllmLLM, validate_consumers
    from tllm_core.vllm_bridge.engine_watch import EngineDiedError
    from tllm_core.vllm_bridge.lifecycle import finished_outputs, next_request_index

    if getattr(args, "report", None) is not None:  # before the engine starts, not after
        check_out_dir(args.report)
    model = local_model(args.model)
    texts_in = prompts(args)
    # Names, configs and (with --model) the dry build fail before vLLM is imported.
    checked = validate_consumers(consumers, model)
    asked = getattr(args, "results", None)
    if asked:
        check_results_arg(asked, checked)
    # The default model converts while vLLM is imported; before the engine processes' preload.
    converting = default_model.convert_in_background() if model is None else None
    if model is None and converting is None:  # cached: the dry build now, before vLLM's import
        model = str(default_model.default_model_path())
        checked = validate_consumers(checked, model)
    prepare_engine_processes(args)
    params = sampling(args)  # vLLM's own checks of the sampling options (imports vLLM)
    if asked:
        params.extra_args = {RESULTS_KEY: asked}
    eager_note = choose_eager(args, len(texts_in) * params.n * params.max_tokens)
    if converting is not None:  # the first run: the converted model, then its dry build
        default_model.wait_for_conversion(converting)
        model = str(default_model.default_model_path())
        checked = validate_consumers(checked, model)  # before vLLM starts
    if args.chat is None:
        args.chat = has_chat_template(model)
    names = [s.name for s in checked.specs]
    say(f"loading {Path(model).name} with consumers {', '.join(names) or '(none)'}")
    # With eager_note: the one line that says why, and how to override.
    note = f"eager mode for {eager_note}: about {START_EAGER_S} s" if eager_note else None
    say(f"starting vLLM ({note or engine_note(args)})")
    t0 = time.perf_counter()
    # The command reports a disabled consumer itself (ERROR lines, exit status 1).
    llm = TllmLLM(
        model,
        checked,
        raise_on_disabled=False,
        callback_deadline_s=getattr(args, "callback_deadline", None),
        **engine_kwargs(args),
        **(extra_engine or {}),
    )
    say(f"engine ready in {time.perf_counter() - t0:.0f} s on vLLM's {llm.status['runner']}")
    # A bar on a terminal only: in a file or a pipe its redraws pile up on one line.
    progress = RunProgress(extra=status) if sys.stderr.isatty() else None
    items = [[{"role": "user", "content": p}] for p in texts_in] if args.chat else texts_in
    interrupted = False
    died: EngineDiedError | None = None
    try:
        first = next_request_index(llm.llm)
        t1 = time.perf_counter()
        with finished_outputs(llm.llm) as done:
            try:
                (llm.chat if args.chat else llm.generate)(items, params, use_tqdm=progress or False)
            except KeyboardInterrupt:
                interrupted = True
            except EngineDiedError as e:  # no report to collect: the finished outputs only
                died = e
            finally:
                if progress is not None:
                    progress.close()
        seconds = time.perf_counter() - t1
        if interrupted:
            say("interrupted: requests aborted; flushing consumers, stopping the engine")
        report = llm.close() if died is None else {"runtime": {}, "consumers": {}, "errors": []}
    finally:
        llm.shutdown()
    args.engine_stopped = True  # the command may exit without the interpreter's teardown
    texts, results, tokens = _outputs(done, first, len(texts_in), params.n)
    if asked:
        report["request_results"] = results
    proofs = {n: getattr(checked.registry.get(n), "proof_counter", "") for n in report["consumers"]}
    line = run_line(tokens, seconds, report["consumers"], proofs)
    interrupted = interrupted or died is not None
    if interrupted:
        report["partial_outputs"] = _cut_short(llm.cut_short, first, texts)
        finished = sum(t is not None for ts in texts for t in ts)
        cut = "the engine died" if died is not None else "interrupted"
        line = f"{cut} after {finished}/{len(texts_in) * params.n} samples; {line}"
    report["run"] = {
        "runner": llm.status["runner"],
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "interrupted": interrupted,
        "summary": line,
    }
    if died is not None:
        died.outputs = (texts_in, texts, report)
        raise died
    return texts_in, texts, report


def json_report(texts: list[list[str | None]], report: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` object: outputs, counters, results, errors, run."""
    return {
        "outputs": texts,
        "counters": {"runtime": report["runtime"], **report["consumers"]},
        "results": report.get("results", {}),
        **{k: report[k] for k in ("request_results", "partial_outputs") if k in report},
        "errors": report.get("errors", []),
        "run": report.get("run", {}),
    }


def print_report(
    prompts: list[str],
    texts: list[list[str]],
    report: dict[str, Any],
    as_json: bool,
    counters: bool = False,
) -> None:
    """Completions as text (or one JSON), then errors and the run's summary on stderr."""
    for e in report.get("errors", []):  # with --json too: stdout is then the JSON only
        print(f"ERROR: {error_text(e)}", file=sys.stderr)
    if as_json:
        # Strict JSON: a NaN or infinite figure is written as a string, not as bare NaN.
        text = json.dumps(json_safe(json_report(texts, report)), default=str, allow_nan=False)
        print(text, flush=True)
        if report.get("run", {}).get("summary"):
            say(report["run"]["summary"])
        for warning in summarize(report).warnings:  # stderr: stdout is the one JSON
            say(f"warning: {warning}")
        return
    partial = report.get("partial_outputs")
    for i, (p, samples) in enumerate(zip(prompts, texts, strict=False)):
        print(f"=== prompt {i}: {p[:70]}")
        for j, t in enumerate(samples):
            if t is None:  # cut short: the text it had, if any
                print(f"--- sample {j} (not finished)\n{text_so_far(partial, i, j).strip()}")
            else:
                print(f"--- sample {j}\n{t.strip()}")
    if counters:
        print("\n=== counters")
        for group, values in json_report(texts, report)["counters"].items():
            print(f"[{group}]")
            for k, v in sorted(values.items()):
                print(f"  {k:<40} {count_text(v)}")
    sys.stdout.flush()
    for line in summarize(report).text():
        say(line)


def show(
    args: argparse.Namespace,
    prompts: list[str],
    texts: list[list[str | None]],
    report: dict[str, Any],
) -> int:
    """Print and write what :func:`generate_with` returned; returns the exit status."""
    print_report(prompts, texts, report, args.json, counters=getattr(args, "counters", False))
    if getattr(args, "report", None) is not None:
        run = {"prompts": prompts, **json_report(texts, report)}
        try:
            say(f"report: {write_report(run, args.report)}")
        except (OSError, RuntimeError, ValueError) as e:  # the run's outputs are printed
            say(f"warning: the report was not written: {e}")
    return exit_status(report)


def exit_status(report: dict[str, Any]) -> int:
    """128 + the signal when interrupted (130: Ctrl-C), 1 when a consumer failed, else 0."""
    if report.get("run", {}).get("interrupted"):
        return exit_code(130)
    return 1 if report.get("errors") else 0
