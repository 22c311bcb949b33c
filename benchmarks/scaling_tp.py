"""Throughput of plain vLLM, capture and ESamp at one tensor-parallel size, in one run.

    python benchmarks/scaling_tp.py [--model PATH] [--tp 2] [--prompts 4] [-n 8]
        [--max-tokens 32] [--rounds 3] [--json]

Cases, one engine each, started one after the other in this process (in-process engine
core; the tensor-parallel workers are vLLM's own processes, one core group per rank):

    plain    ``vllm.LLM`` without tllm
    capture  ``stats`` capturing layers 0 and -1 on every row
    esamp    ``esamp`` with beta 0.25 (training and guidance)

Each engine is warmed up with one short generate, then runs ``--rounds`` timed generates of
the same workload (``ignore_eos``: exactly prompts x n x max_tokens tokens each). ``ratio``
is the case's median tok/s over plain's. Without ``--model`` a tiny random Llama with an
even head count (2 heads, 2 KV heads) is built under ~/.cache/tllm/test-models.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench_setup import offline_engine_env, run_machine

CASES = {
    "plain": None,
    "capture": ['stats:{"layers": [0, -1]}'],
    "esamp": ['esamp:{"beta": 0.25}'],
}


def _model(arg: str | None) -> str:
    if arg:
        return arg
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import build_tiny_model

    root = Path.home() / ".cache" / "tllm" / "test-models"
    return str(build_tiny_model(root, arch="llama", heads=2, kv_heads=2))


def _engine(case: str, model: str, kw: dict):
    if CASES[case] is None:
        from vllm import LLM

        from tllm_core.vllm_bridge.parallel import bind_cpu_threads

        bound = bind_cpu_threads(kw.get("tensor_parallel_size", 1))
        try:
            return LLM(model, **kw)
        finally:
            if bound is not None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    from tllm_core.app.engine import TllmLLM

    return TllmLLM(model, CASES[case], **kw)


def run_case(case: str, model: str, args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    kw = dict(tensor_parallel_size=args.tp, dtype="float32", max_model_len=512, enforce_eager=True)
    prompts = [f"Prompt number {i}: tell me about the sea" for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    llm = _engine(case, model, kw)
    llm.generate(prompts, SamplingParams(n=args.n, max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(args.prompts * args.n * args.max_tokens / (time.perf_counter() - t))
    out = {"case": case, "tok_s": statistics.median(rates), "runs": rates}
    if case != "plain":
        report = llm.close()
        out["errors"] = report["errors"]
        out["counters"] = {k: v for k, v in report["runtime"].items() if k.startswith("rows_")}
    inner = getattr(llm, "llm", llm)
    inner.llm_engine.engine_core.shutdown()
    del llm, inner
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", help="model folder with an even head count (default: a tiny random Llama)"
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--prompts", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("-n", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per sample (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="timed generates per case (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    offline_engine_env(1)  # logs (the rank workers' too) on stderr: stdout is the result
    model = _model(args.model)
    load_start = os.getloadavg()[0]
    results = [run_case(c, model, args) for c in CASES]
    base = results[0]["tok_s"]
    for r in results:
        r["ratio"] = r["tok_s"] / base
    if args.json:
        workload = {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens}
        command = "python " + shlex.join(["benchmarks/scaling_tp.py", *(argv or sys.argv[1:])])
        print(
            json.dumps(
                {
                    "command": command,
                    "tp": args.tp,
                    "model": model,
                    "workload": {**workload, "rounds": args.rounds},
                    "results": results,
                    "machine": run_machine(load_start),
                }
            )
        )
    else:
        for r in results:
            counters = " ".join(f"{k}={v}" for k, v in r.get("counters", {}).items())
            print(f"{r['case']:<8} {r['tok_s']:9.1f} tok/s  ratio {r['ratio']:.3f}  {counters}")
    return 1 if any(r.get("errors") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
