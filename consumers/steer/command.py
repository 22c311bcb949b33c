"""``tllm steer compute`` (contributed through ``tllm_commands``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tllm_core import cli_common


def cmd_steer_compute(args: argparse.Namespace) -> int:
    cli_common.quiet(args)
    cli_common.prepare_engine_processes(args)
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


def add_command(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser("steer", help="steering-vector tools")
    ssub = s.add_subparsers(dest="steer_command", required=True, metavar="SUBCOMMAND")
    sc = ssub.add_parser("compute", help="mean-difference vector from contrastive prompt files")
    sc.add_argument("--positive", required=True, type=Path, help="file, one prompt per line")
    sc.add_argument("--negative", required=True, type=Path, help="file, one prompt per line")
    sc.add_argument("--layer", required=True, type=int, help="decoder layer index")
    sc.add_argument("--out", required=True, type=Path, help="output .safetensors/.pt/.npy")
    sc.add_argument("--model")
    sc.add_argument("--dtype", default="float32")
    sc.add_argument("--max-model-len", type=int, default=None, help="default: the model's own")
    sc.add_argument("--enforce-eager", action="store_true")
    sc.add_argument("--kv-cache-gib", type=int, default=None)
    sc.add_argument("--json", action="store_true")
    sc.add_argument("-v", "--verbose", action="store_true")
    sc.set_defaults(func=cmd_steer_compute)
