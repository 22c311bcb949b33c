"""Hidden-state edits through tllm's runtime on CUDA, counted without a GPU:

    python benchmarks/edit_fake_step.py [--json] [--steps 3]      # counts from tests/edit_steps.py

A step's edit path (``Runtime.begin_step``: each editing consumer's plan, checked and written
into the edit taps' buffers) on the fake CUDA device, over ``--steps`` steady steps after a
warm-up (8 requests, bf16), as is and under ``torch.inference_mode``: host waits, pageable
copies, allocations and races (each must be 0). Cases: ``steer`` on every request and per
request, one consumer per edit kind, and ``add`` with a CPU value (moved to the device once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_setup import code_version, command_line, section, table  # noqa: E402
from edit_steps import KINDS, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--steps", type=int, default=3, help="steady steps counted per case")
    args = ap.parse_args(argv)
    cases = ("steer_all", "steer_per_request", *KINDS)
    out = {
        "command": command_line("edit_fake_step.py", argv),
        "code": code_version(),
        "results": [run(c, args.steps, inf) for inf in (False, True) for c in cases],
    }
    print(json.dumps(out, indent=1) if args.json else render(out))


def render(es: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: each editing case's counts over
    the steady steps, as is and in inference mode."""
    kinds = ("host_wait", "pageable_copy", "allocation", "race", "consumer_errors")
    rows = [
        [
            r["case"],
            "inference" if r.get("inference_mode") else "plain",
            *(r[k] for k in kinds),
            r.get("values_prepared") or 0,
        ]
        for r in es["results"]
    ]
    head = ["case", "mode", "host waits", "pageable copies", "allocations", "races", "errors"]
    return section(
        "Hidden-state edits on the fake CUDA device",
        es,
        table([*head, "values prepared"], rows),
    )


if __name__ == "__main__":
    main()
