"""``tllm export``: generate and export hidden states (contributed through ``tllm_commands``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tllm_core import ConsumerSpec, cli_common


def _phase(text: str) -> str:
    from pydantic import ValidationError

    from consumers.export.consumer import ExportConfig

    try:
        ExportConfig(out=None, phase=text)  # the config's own check, one definition
    except ValidationError as e:
        err = e.errors()[0]
        said = (err.get("ctx") or {}).get("error", err["msg"])  # the validator's own words
        raise argparse.ArgumentTypeError(f"--phase {text!r}: {said}") from None
    return text


def cmd_export(args: argparse.Namespace) -> int:
    cli_common.quiet(args)
    # The config checks the names' syntax, the consumer checks them against the producers.
    layers: list[int | str] = [s.strip() for s in args.layers.split(",") if s.strip()]
    config = dict(out=str(args.out), layers=layers, phase=args.phase, overwrite=args.overwrite)
    consumers = [ConsumerSpec(name="export", config=config), *(args.consumer or [])]
    # Cached prompt blocks are not recomputed, so their rows would be missing.
    cli_common.say(
        "export: prefix caching is turned off for this run (every prompt row is exported)"
    )
    args.no_prefix_caching = True
    prompts, texts, report = cli_common.generate_with(
        args, consumers, status=lambda: written(args.out)
    )
    return cli_common.show(args, prompts, texts, report)


def written(out: Path) -> str:
    """Rows and bytes of the complete shards in ``out`` so far (from its manifest)."""
    try:
        shards = json.loads((out / "manifest.json").read_text()).get("shards", [])
    except (OSError, ValueError):
        shards = []
    rows = sum(int(s.get("rows", 0)) for s in shards)
    size = sum(int(s.get("bytes", 0)) for s in shards)
    # A shard is written when full or at the end: none yet is no loss.
    return f"on disk: {len(shards)} shard(s), {rows} rows, {size / 1e6:.1f} MB"


def add_command(subparsers: argparse._SubParsersAction) -> None:
    e = subparsers.add_parser(
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
    e.add_argument(
        "--phase",
        type=_phase,
        default="all",
        help="rows to export: prefill, decode, all (default), or a capture window: "
        "last_prompt, prompt[-4:], generated[0:16], all[::4] (docs/ports.md#capture-windows)",
    )
    e.add_argument("--out", required=True, type=Path, help="output directory")
    e.add_argument("--overwrite", action="store_true", help="allow a non-empty output directory")
    cli_common.add_consumer_arg(e, "more consumers")
    cli_common.add_generation_args(e)
    e.set_defaults(func=cmd_export)
