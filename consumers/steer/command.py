"""``tllm steer compute``: a steering vector as the mean difference of one layer's prompt rows
between contrastive prompt sets, through the export path. Imports no torch until it runs."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tllm_core import cli_common

if TYPE_CHECKING:
    import torch


def cmd_steer_compute(args: argparse.Namespace) -> int:
    cli_common.quiet(args)
    cli_common.prepare_engine_processes(args)
    _, info = compute_steering_vector(args)
    if args.json:
        print(json.dumps(info))
    else:
        print(
            f"wrote {args.out}: layer {info['layer']}, norm {info['norm']:.4f}, "
            f"{info['positive_rows']} positive / {info['negative_rows']} negative rows"
        )
    return 0


def check_out(out: Path) -> None:
    if out.suffix not in (".safetensors", ".pt", ".npy"):
        raise ValueError(f"--out must end in .safetensors, .pt or .npy, got {out.name!r}")
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; give a file name")
    if out.parent.exists() and not os.access(out.parent, os.W_OK):
        raise ValueError(f"--out directory {out.parent} is not writable")


def save_vector(vec: torch.Tensor, out: Path) -> None:
    """Write ``vec`` by suffix (.safetensors, .pt, .npy), atomically."""
    import numpy as np
    import torch

    check_out(out)
    suffix = out.suffix
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".vec-", suffix=suffix, dir=out.parent)
    os.close(fd)
    try:
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({"vector": vec.contiguous()}, tmp)
        elif suffix == ".pt":
            torch.save(vec, tmp)
        else:
            np.save(tmp, vec.numpy())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def mean_difference(records, layer_key: str, n_positive: int) -> tuple[torch.Tensor, int, int]:
    """Mean over prompt tokens per prompt, then over prompts; positive minus negative."""
    import torch

    pos, neg = [], []
    for rec in records:
        h = rec.hidden[layer_key]
        keep = torch.as_tensor(rec.positions) < rec.num_prompt_tokens
        (pos if rec.prompt_index < n_positive else neg).append(h[keep].float().mean(0))
    if not pos or not neg:
        raise ValueError("steer compute: one of the prompt sets produced no activations")
    return torch.stack(pos).mean(0) - torch.stack(neg).mean(0), len(pos), len(neg)


def compute_steering_vector(args: argparse.Namespace) -> tuple[torch.Tensor, dict[str, Any]]:
    from vllm import SamplingParams

    from consumers.export import read_export
    from tllm_core import TllmLLM, cli_common, layer_key

    positive = cli_common.read_prompt_file(args.positive, "--positive file")
    negative = cli_common.read_prompt_file(args.negative, "--negative file")
    check_out(args.out)  # before the engine starts
    with tempfile.TemporaryDirectory(prefix="tllm-steer-") as tmp:
        spec = {
            "name": "export",
            "config": {"out": tmp, "layers": [args.layer], "phase": "prefill", "overwrite": True},
        }
        llm = TllmLLM(
            args.model,
            [spec],
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            callback_deadline_s=args.callback_deadline,
            enforce_eager=args.enforce_eager,
            enable_prefix_caching=False,
        )
        layer = llm.status["capture_layers"][0]
        llm.generate(positive + negative, SamplingParams(max_tokens=1), use_tqdm=False)
        llm.close()
        vec, n_pos, n_neg = mean_difference(read_export(tmp), layer_key(layer), len(positive))
    save_vector(vec, args.out)
    return vec, {
        "out": str(args.out),
        "layer": layer,
        "norm": float(vec.norm()),
        "positive_rows": n_pos,
        "negative_rows": n_neg,
    }


EXAMPLES = """examples:
  tllm steer compute --positive calm.txt --negative angry.txt --layer 12 --out calm.safetensors
  tllm run --consumer 'steer:{"vectors": [{"layer": 12, "path": "calm.safetensors", "scale": 4.0}]}'

Modes (add, ablate, clamp), gates and per-request vectors: docs/consumers/steer.md."""


def add_command(subparsers: argparse._SubParsersAction) -> None:
    shown = dict(epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = subparsers.add_parser(
        "steer",
        help="steering-vector tools",
        description="Make steering vectors for the steer consumer.",
        **shown,
    )
    ssub = s.add_subparsers(dest="steer_command", required=True, metavar="SUBCOMMAND")
    sc = ssub.add_parser(
        "compute",
        help="mean-difference vector from contrastive prompt files",
        description="The residual stream after decoder layer LAYER, averaged over each "
        "prompt's tokens and then over the prompts, for the positive prompts minus the same for "
        "the negative ones (one forward per prompt), saved for the steer consumer.",
        **shown,
    )
    sc.add_argument("--positive", required=True, type=Path, help="file, one prompt per line")
    sc.add_argument("--negative", required=True, type=Path, help="file, one prompt per line")
    sc.add_argument("--layer", required=True, type=int, help="decoder layer index")
    sc.add_argument("--out", required=True, type=Path, help="output .safetensors/.pt/.npy")
    cli_common.add_model_args(sc)  # checked as `tllm run`'s (--kv-cache-gib 0 is refused)
    sc.add_argument("--enforce-eager", action="store_true", help="no compilation (faster start)")
    sc.add_argument("--json", action="store_true", help="print the result as one JSON object")
    sc.add_argument(
        "-v", "--verbose", action="store_true", help="show vLLM's and torch's logs and warnings"
    )
    sc.set_defaults(func=cmd_steer_compute)
