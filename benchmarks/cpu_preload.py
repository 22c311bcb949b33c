"""Plain vLLM's throughput with and without tcmalloc + Intel OpenMP preloaded, paired.

    python benchmarks/cpu_preload.py [--model PATH] [--prompts N] [-n N] [--max-tokens T]
        [--pairs P] [--rounds R] [--enforce-eager] [--json]

vLLM's CPU backend asks for ``libtcmalloc`` and ``libiomp`` in ``LD_PRELOAD``. This script
measures what they bring on the benchmark workload of benchmarks/throughput.py (8 prompts x
16 samples x 128 tokens, min-p 0.1, ``ignore_eos``, the embedded model, fp32, compiled).

Method: ``--pairs`` pairs of fresh processes; each process starts plain ``vllm.LLM`` in vLLM's
default multiprocess layout (what ``tllm run`` uses), warms up, then times ``--rounds``
generate calls. In one process of a pair ``LD_PRELOAD`` holds the libraries
(:func:`tllm_core.app.cpu_preload.apply`, as the ``tllm`` command sets it), in the other it is
unset (vLLM then preloads PyTorch's libgomp itself); the order alternates between pairs.
``ratio`` is the median over pairs of preload tok/s / plain tok/s (min and max: the spread;
the machine may be shared).
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.txt"


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One process: start plain vLLM, warm up, time the rounds (tok/s each)."""
    if cfg["preload"]:
        from tllm_core.app.cpu_preload import apply

        added = apply()
    else:
        os.environ.pop("LD_PRELOAD", None)
        added = []
    from vllm import LLM, SamplingParams

    lines = [ln.strip() for ln in PROMPTS_FILE.read_text().splitlines() if ln.strip()]
    prompts = [lines[i % len(lines)] for i in range(cfg["prompts"])]
    llm = LLM(
        model=cfg["model"],
        dtype="float32",
        max_model_len=1024,
        enforce_eager=cfg["enforce_eager"],
    )
    params = SamplingParams(
        n=cfg["n"], max_tokens=cfg["max_tokens"], min_p=0.1, ignore_eos=True, seed=0
    )
    llm.generate(prompts, SamplingParams(n=cfg["n"], max_tokens=8), use_tqdm=False)
    rates = []
    for _ in range(cfg["rounds"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / dt)
    llm.llm_engine.engine_core.shutdown(timeout=60)
    return {"preload": added, "tok_s": rates}


def run_child(cfg: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("LD_PRELOAD", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, __file__, "--_child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("-n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=3, help="fresh process pairs (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per process (default 2)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        print(json.dumps(child(json.loads(args._child))))
        return 0
    sys.path.insert(0, str(ROOT))
    from tllm_core.app.cpu_preload import preload_libs

    libs = preload_libs()
    if not libs:
        print("no tcmalloc / libiomp5 found: nothing to compare", file=sys.stderr)
        return 1
    model = args.model
    if model is None:
        from tllm_core.app.default_model import default_model_path

        model = str(default_model_path())
    base = dict(
        model=model,
        prompts=args.prompts,
        n=args.n,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        enforce_eager=args.enforce_eager,
    )
    pairs = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        res = {}
        for preload in order:
            r = run_child({**base, "preload": preload})
            res["preload" if preload else "plain"] = r
            print(
                f"pair {i} {'preload' if preload else 'plain  '}: "
                + ", ".join(f"{x:.0f}" for x in r["tok_s"])
                + " tok/s",
                file=sys.stderr,
                flush=True,
            )
        pre = statistics.median(res["preload"]["tok_s"])
        plain = statistics.median(res["plain"]["tok_s"])
        pairs.append({"preload_tok_s": pre, "plain_tok_s": plain, "ratio": pre / plain})
    ratios = [x["ratio"] for x in pairs]
    out = {
        "libs": libs,
        "workload": {k: v for k, v in base.items() if k != "model"},
        "pairs": pairs,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "loadavg_1m_end": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"preload/plain tok/s: median {out['ratio']:.3f} "
            f"(min {out['ratio_min']:.3f}, max {out['ratio_max']:.3f}) over {len(pairs)} pairs; "
            f"libs {libs}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
