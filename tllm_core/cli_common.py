"""Helpers shared by ``tllm`` commands, built-in or contributed by plugins.

A plugin's ``tllm_commands`` hook (see :mod:`tllm_core.hookspecs`) can reuse them::

    from tllm_core import cli_common, hookimpl

    def run_mine(args):
        cli_common.quiet(args)
        prompts, texts, report = cli_common.generate_with(args, ["mine"])
        cli_common.print_report(prompts, texts, report, args.json)
        return cli_common.exit_status(report)

    @hookimpl
    def tllm_commands(subparsers):
        p = subparsers.add_parser("mine", help="generate with my consumer")
        cli_common.add_generation_args(p)
        p.set_defaults(func=run_mine)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


class CliError(ValueError):
    """Bad command-line input; reported as ``tllm: ...`` with exit status 2."""


DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """Model, engine, prompt and sampling options, ``--json`` and ``-v`` (as ``tllm run``)."""
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model", help="local Hugging Face model folder (default: embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument(
        "--dtype", default="float32", help="model dtype: float32, bfloat16, auto (default float32)"
    )
    g.add_argument("--max-model-len", type=int, default=2048, help="context length (default 2048)")
    g.add_argument(
        "--enforce-eager", action="store_true", help="disable compilation (faster start)"
    )
    g.add_argument("--max-num-seqs", type=int, default=None, help="vLLM max_num_seqs")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="vLLM token budget per step"
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="disable prefix caching (every prompt row is computed and captured)",
    )
    for opt in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        g.add_argument(opt, type=int, default=1, help="vLLM's option (docs/scaling.md)")
    g.add_argument(
        "--kv-cache-gib",
        type=int,
        default=None,
        help="CPU KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE; default 2)",
    )
    g = p.add_argument_group("prompts and sampling")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts", type=Path, help="file with one prompt per line")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="apply the model's chat template (default: when the model has one)",
    )
    chat.add_argument(
        "--no-chat", dest="chat", action="store_false", help="send prompts as raw text"
    )
    g.add_argument(
        "-n",
        type=int,
        default=4,
        help="samples per prompt (default 4; ESamp spreads the samples of a prompt apart)",
    )
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per sample (default 64)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (outputs, counters)")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM's logs")


def prompts(args: argparse.Namespace) -> list[str]:
    """``--prompt``s, the ``--prompts`` file, or the built-in prompt."""
    if args.prompts is not None:
        from tllm_core.prompts import read_prompt_file

        return read_prompt_file(args.prompts, "--prompts file")
    return args.prompt or [DEFAULT_PROMPT]


def sampling(args: argparse.Namespace):
    """``SamplingParams`` from the sampling options."""
    from vllm import SamplingParams

    if args.n < 1:
        raise CliError(f"-n must be >= 1, got {args.n}")
    if args.max_tokens < 1:
        raise CliError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        return SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k if args.top_k > 0 else 0,
            min_p=args.min_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        raise CliError(f"bad sampling option: {e}") from None


def quiet(args: argparse.Namespace) -> None:
    """vLLM logs to stderr (WARNING unless ``-v``) and the CPU KV cache size, before vLLM loads."""
    # stdout is for results (JSON for scripts); vLLM logs to stdout by default.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from the model and engine options."""
    kw: dict[str, Any] = dict(
        dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager
    )
    for k in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, k, 1) != 1:
            kw[k] = getattr(args, k)
    if getattr(args, "no_prefix_caching", False):
        kw["enable_prefix_caching"] = False
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kw


def generate_with(
    args: argparse.Namespace, consumers: list[str], extra_engine: dict | None = None
) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    """Start the engine with ``consumers`` (``NAME[:JSON]``), generate for the prompts of
    ``args`` (options of :func:`add_generation_args`), close; return (prompts, texts per
    prompt and sample, report)."""
    from tllm_core.engine import TllmLLM, validate_consumers

    texts_in = prompts(args)
    params = sampling(args)
    model = args.model
    if model is not None and not Path(model).is_dir():
        raise CliError(f"--model must be a local model folder; {model!r} is not a directory")
    # Fail on names/configs (and, with --model, layers) before converting the default model
    # or starting vLLM; TllmLLM then adds only the checks that were not run yet.
    checked = validate_consumers(consumers, model)
    if model is None:
        from tllm_core.default_model import default_model_path

        model = str(default_model_path(progress=not args.json))
    if args.chat is None:
        args.chat = has_chat_template(Path(model))
    llm = TllmLLM(model, checked, **engine_kwargs(args), **(extra_engine or {}))
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in texts_in]
        outs = llm.chat(convs, params, use_tqdm=not args.json)
    else:
        outs = llm.generate(texts_in, params, use_tqdm=not args.json)
    report = llm.close()
    texts = [[c.text for c in o.outputs] for o in outs]
    return texts_in, texts, report


def has_chat_template(model: Path) -> bool:
    """Whether the model folder ships a chat template."""
    if (model / "chat_template.jinja").is_file():
        return True
    cfg = model / "tokenizer_config.json"
    return cfg.is_file() and "chat_template" in json.loads(cfg.read_text())


def _idle_consumers(report: dict[str, Any]) -> list[str]:
    """Consumers whose counters are all zero: they did no work."""
    return [
        name
        for name, c in report["consumers"].items()
        if not any(v for k, v in c.items() if not k.startswith("memory"))
    ]


def _counters(report: dict[str, Any]) -> dict[str, Any]:
    out = {"runtime": report["runtime"]}
    out.update(report["consumers"])
    return out


def print_report(
    prompts: list[str], texts: list[list[str]], report: dict[str, Any], as_json: bool
) -> None:
    """Completions and counters as text (errors and idle consumers on stderr), or one JSON."""
    if as_json:
        print(
            json.dumps(
                {
                    "outputs": texts,
                    "counters": _counters(report),
                    "results": report.get("results", {}),
                    "errors": report.get("errors", []),
                },
                default=str,
            )
        )
        return
    for i, (p, samples) in enumerate(zip(prompts, texts, strict=False)):
        print(f"=== prompt {i}: {p[:70]}")
        for j, t in enumerate(samples):
            print(f"--- sample {j}\n{t.strip()}")
    print("\n=== counters")
    for group, values in _counters(report).items():
        print(f"[{group}]")
        for k, v in sorted(values.items()):
            print(f"  {k:<40} {v:.6g}" if isinstance(v, float) else f"  {k:<40} {v}")
    for e in report.get("errors", []):
        print(f"ERROR: {e['error']}", file=sys.stderr)
    for name in _idle_consumers(report):
        print(
            f"WARNING: consumer {name!r} did no work (all its counters are zero)", file=sys.stderr
        )


def exit_status(report: dict[str, Any]) -> int:
    """1 when a consumer failed during the run, else 0."""
    return 1 if report.get("errors") else 0


def json_spec(spec: dict) -> str:
    """``NAME:{json}`` of a ``{"name", "config"}`` dict (a ``--consumer`` value)."""
    return f"{spec['name']}:{json.dumps(spec['config'])}"
