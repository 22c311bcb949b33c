"""How long a ``tllm`` command takes to refuse bad input, and ``tllm --help`` to answer.

Each case runs ``python -m tllm_core.app.cli ...`` ``--repeat`` times in a fresh process (the
console script's ``main``) and reports the median and minimum wall time, its exit status and
whether stderr holds the expected message. ``--before DIR`` times another checkout too (put
first on ``PYTHONPATH``; e.g. the commit before a change), in turns with this one. One JSON
object on stdout (``after``: this checkout, ``before``), with the load average, since other
jobs on a small machine move these figures by seconds.

    python benchmarks/cli_errors.py --model TINY_MODEL_DIR [--before OTHER_CHECKOUT] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BAD_BETA = 'esamp:{"beta": "x"}'


def cases(model: str | None, out: str) -> dict[str, tuple[list[str], str]]:
    """name -> (command arguments, a piece of the expected stderr; "" for --help)."""
    out_cases = {
        "help": (["--help"], ""),
        "run_bad_config": (["run", "--consumer", BAD_BETA, "--prompt", "hi"], "beta"),
        "export_bad_config": (
            ["export", "--layers", "0", "--out", out, "--consumer", BAD_BETA],
            "beta",
        ),
        "serve_bad_config": (["serve", "--consumer", BAD_BETA], "beta"),
        "run_unknown_consumer": (["run", "--consumer", "nope", "--prompt", "hi"], "nope"),
    }
    if model:
        out_cases["run_layer_out_of_range"] = (
            ["run", "--model", model, "--consumer", 'stats:{"layers": [40]}', "--prompt", "hi"],
            "out of range",
        )
    return out_cases


def time_cases(
    chosen: dict[str, tuple[list[str], str]], trees: dict[str, Path], repeat: int
) -> dict[str, dict[str, dict]]:
    """label -> case -> figures; the trees take turns run by run (a busy machine slows both
    alike)."""
    times: dict[str, dict[str, list[float]]] = {k: {c: [] for c in chosen} for k in trees}
    last: dict[str, dict[str, tuple[int, bool]]] = {k: {} for k in trees}
    for case, (argv, expect) in chosen.items():
        for _ in range(repeat):
            for label, tree in trees.items():
                # Built-in plugins only: a stray third-party one would add its own imports.
                env = {**os.environ, "PYTHONPATH": str(tree), "TLLM_PLUGINS": ""}
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "tllm_core.app.cli", *argv],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=tree,  # ``-m`` puts the working directory first on sys.path
                    timeout=600,
                )
                times[label][case].append(time.perf_counter() - t0)
                ok = last[label].get(case, (0, True))[1] and expect in proc.stderr
                last[label][case] = (proc.returncode, ok)
    return {
        label: {
            case: {
                "median_s": round(statistics.median(ts), 2),
                "min_s": round(min(ts), 2),
                "exit": last[label][case][0],
                "message": last[label][case][1],
            }
            for case, ts in per_case.items()
        }
        for label, per_case in times.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a local model folder (adds the out-of-range layer case)")
    p.add_argument(
        "--before",
        type=Path,
        help="another checkout (e.g. the commit before a change), timed in turns with this one",
    )
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", help="comma-separated case names")
    a = p.parse_args()
    trees = {"after": ROOT} if a.before is None else {"before": a.before.resolve(), "after": ROOT}
    chosen = cases(a.model, str(Path(os.environ.get("TMPDIR", "/tmp")) / "tllm-cli-errors"))
    if a.only:
        chosen = {k: v for k, v in chosen.items() if k in a.only.split(",")}
    load_start = os.getloadavg()[0]
    results = time_cases(chosen, trees, a.repeat)
    out = {
        "command": "python benchmarks/cli_errors.py " + " ".join(sys.argv[1:]),
        "repeat": a.repeat,
        "cores": os.cpu_count(),
        "load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        **results,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
