"""ESamp's decode step on CUDA, counted without a GPU: the consumer's guidance and training
submission (and the distiller alone) on the fake CUDA device of ``tllm_core.testing.fake_cuda``
at Qwen2.5-7B's shapes (hidden 3584, vocabulary 152064, bf16 states):

    python benchmarks/esamp_fake_step.py [--json] [--steps 3] [--configs]

Per step and layout (prompts x samples: 8 x 16, 1 x 128, 64 x 16), mode (post_filter,
full_vocab) and beta schedule (constant, fit): launches (aten operations on the device, a
graph replay counting the operations it captured), bytes they read and write, device
allocations, host waits and pageable copies (must be 0). The whole step through tllm's
runtime too, with ESamp on every request and as a per-request consumer switched on by half
the prompts' requests (``PER_REQUEST``). ``--configs``: the same at 8 x 16
for each setting of ``CONFIGS`` (ablations, diagnostics, a head without its weight...: which
of them allocate or wait is in docs/consumers/esamp.md). Host time is not measured here:
the checker's dispatch mode costs more than the step (``benchmarks/gpu_smoke.py`` times it).

Nothing here runs on a GPU; the GPU figures come from ``benchmarks/gpu_smoke.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import algorithms.esamp.factory as factory  # noqa: E402
from algorithms.esamp.config import ESampConfig  # noqa: E402
from algorithms.esamp.consumer import ESampConsumer  # noqa: E402
from tllm_core.api.bundles import Bundle, GuideView  # noqa: E402
from tllm_core.api.consumer import ConsumerContext, ModelInfo  # noqa: E402
from tllm_core.api.ports import resolve_layer  # noqa: E402
from tllm_core.api.rows import RequestInfo, RowInfo  # noqa: E402
from tllm_core.testing.fake_cuda import FakeCuda  # noqa: E402

H, V, LAYERS = 3584, 152064, 28
LAYOUTS = ((8, 16), (1, 128), (64, 16))
MODES = ("post_filter", "full_vocab")
# ESamp per request (esamp_runtime_step): every other prompt's requests switch it on, or the
# first half of the prompts (one prompt: that prompt, all the rows).
PER_REQUEST = ("interleaved", "block")
# Settings that change what a step runs, each counted at 8 x 16 in both modes (constant beta;
# the noise ablations with 'fit' too). plain_head=False: a head given without its weight.
CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ablation=noise", {"ablation": "noise"}),
    ("ablation=f_noise", {"ablation": "f_noise"}),
    ("ablation=noise, fit", {"ablation": "noise", "beta_schedule": "fit"}),
    ("ablation=f_noise, fit", {"ablation": "f_noise", "beta_schedule": "fit"}),
    ("ablation=frozen", {"ablation": "frozen"}),
    ("diagnostics=true", {"diagnostics": True}),
    ("head without lm_head_weight", {"plain_head": False}),
    ("mix=latent", {"mix": "latent"}),
    ("target_layer=20, mix=latent", {"target_layer": 20, "mix": "latent"}),
    ("init=zero_output", {"init": "zero_output"}),
    ("scope=batch", {"scope": "batch"}),
    ("optimizer_stats=true", {"optimizer_stats": True}),
    ("cuda_adam_moments=bfloat16", {"cuda_adam_moments": "bfloat16"}),
    ("use_cuda_graph=false", {"use_cuda_graph": False}),
    ("cuda_max_candidates=1000", {"cuda_max_candidates": 1000}),
)


@contextlib.contextmanager
def _fake_gpu(order: bool = False) -> Iterator[FakeCuda]:
    """The fake CUDA device (stream ordering checked with ``order``), ESamp taking its GPU
    path there (``factory.uses_gpu_path``); both put back after."""
    gpu_path = factory.uses_gpu_path
    factory.uses_gpu_path = lambda device: True
    try:
        with FakeCuda(order=order) as fc:
            yield fc
    finally:
        factory.uses_gpu_path = gpu_path


def consumer(
    device: torch.device, prompts: int, n: int, plain_head: bool = True, **cfg: Any
) -> ESampConsumer:
    """The ESamp consumer on a 7B-shaped model on ``device``, taking the CUDA path (the
    caller makes ``factory.uses_gpu_path`` true for the fake device). ``plain_head=False``:
    the model gives no ``lm_head_weight`` (a quantized or soft-capped head), only the call."""
    w = torch.zeros(V, H, dtype=torch.bfloat16, device=device)
    weight = w if plain_head else None
    model = ModelInfo(H, LAYERS, V, torch.bfloat16, device, lambda z: z @ w.t(), weight)
    ctx = ConsumerContext(model, lambda i: resolve_layer(i, LAYERS))
    return ESampConsumer(ESampConfig(cuda_rows_per_step=prompts * n, **cfg), ctx)


def decode_rows(device: torch.device, prompts: int, n: int, renewed: bool = False) -> RowInfo:
    """Decode rows of ``prompts`` x ``n``; ``renewed``: the first prompt replaced by a new one."""
    ids = [prompts if renewed else 0, *range(1, prompts)]
    reqs = [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in ids for s in range(n)]
    r = len(reqs)
    tokens = torch.zeros(r, dtype=torch.long, device=device)
    return RowInfo(np.arange(r), reqs, np.full(r, 5), np.ones(r, bool), np.zeros(r, bool), tokens)


def step_inputs(
    device: torch.device,
    rows: RowInfo,
    t: int,
    filtered: bool,
    keys: tuple[str, ...],
    greedy_rows: int = 0,
):
    """The engine's tensors of step ``t``: the hidden states at ``keys`` (and the final
    one), the logits and the guide view over them (its last ``greedy_rows`` rows greedy,
    so not guided)."""
    r = len(rows)
    hidden = {k: torch.zeros(r, H, dtype=torch.bfloat16, device=device) for k in {*keys, "final"}}
    logits = torch.zeros(r, V, device=device)
    is_random = np.arange(r) < r - greedy_rows
    view = GuideView(t, rows, logits, torch.ones(r, device=device), is_random, filtered, hidden)
    return view, Bundle(t, rows, hidden)


def run(
    prompts: int,
    n: int,
    mode: str,
    fit: bool,
    steps: int = 3,
    plain_head: bool = True,
    greedy_rows: int = 0,
    order: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """One configuration: the last step's counts. ``options``: more ESampConfig fields;
    ``greedy_rows``: rows of the counted steps that are greedy (not guided). ``order``: check
    stream ordering (``FakeCuda(order=True)``) on the engine's pattern: one set of step
    tensors, written by each step's forward and the logits read by its sampler on the main
    stream, and halfway through the first prompt finishes and a new one takes its slot
    (see :func:`run_ordered`); the result's ``races`` are the race findings."""
    cfg = {"mode": mode, **({"beta_schedule": "fit"} if fit else {}), **options}
    if order:
        return run_ordered(prompts, n, mode, steps, cfg, greedy_rows)
    with _fake_gpu() as fc:
        c = consumer(fc.device, prompts, n, plain_head, **cfg)
        rows = decode_rows(fc.device, prompts, n)
        filtered = mode != "full_vocab"  # 'auto' takes its post-filter branch here
        keys = (c.shared.src_key, c.shared.tgt_key)

        def one(t: int) -> None:
            view, bundle = step_inputs(fc.device, rows, t, filtered, keys)
            with torch.inference_mode():  # as vLLM runs a step
                c.guide(view)
                view.commit()
                c.on_bundle(bundle)

        one(0)  # the groups' slots are allocated (host bookkeeping)
        # The engine's tensors of each step (made by vLLM, not by the step).
        inputs = [
            step_inputs(fc.device, rows, t, filtered, keys, greedy_rows)
            for t in range(1, steps + 1)
        ]
        fc.start_steps()
        for view, bundle in inputs:
            with fc.step(), torch.inference_mode():
                c.guide(view)
                view.commit()
                c.on_bundle(bundle)
        report = fc.report()["steps"]
        failures = [
            f"{f.kind} {f.where} {f.code}"
            for f in fc.failures()
            if f.kind in ("host_wait", "pageable_copy", "first_cublas")
        ]
        allocations = sorted({f"{f.where} {f.code}" for f in fc.findings(kind="allocation")})
        reused = c.distiller.updates_reusing_prediction
        # Counted while the steps ran (the device sums' copies that came back), not at
        # a closing read.
        guided_counted = c.counters.snapshot().get("rows_guided", 0)
    last = report["per_step"][-1]
    return {
        "prompts": prompts,
        "n": n,
        "mode": mode,
        "fit": fit,
        "options": {**options, **({} if plain_head else {"plain_head": False})},
        "launches": last["launches"],
        "bytes": last["bytes"],
        "allocations": last["allocation"],
        "allocated_bytes": last["allocated_bytes"],
        "graph_replays": last["graph_replays"],
        "host_waits": last["host_wait"],
        "pageable_copies": last["pageable_copy"],
        "first_cublas": last["first_cublas"],
        "failures": failures,
        "allocation_sites": allocations,
        "updates_reusing_prediction": reused,  # of the 1 + steps updates (setup step included)
        "rows_guided_counted_in_the_run": guided_counted,
    }


def run_ordered(
    prompts: int, n: int, mode: str, steps: int, cfg: dict[str, Any], greedy_rows: int = 0
) -> dict[str, Any]:
    """``run(..., order=True)``: ``steps`` steps on one set of step tensors (as the engine's
    static buffers); at step ``steps // 2`` the first prompt finishes and a new prompt takes
    its slot; the last ``greedy_rows`` rows of each step are greedy (all: nothing is guided,
    so the updates run without a prediction before them). Returns the races, host waits
    and update counts."""
    with _fake_gpu(order=True) as fc:
        c = consumer(fc.device, prompts, n, True, **cfg)
        filtered = mode != "full_vocab"
        keys = (c.shared.src_key, c.shared.tgt_key)
        before = decode_rows(fc.device, prompts, n)
        after = decode_rows(fc.device, prompts, n, renewed=True)
        half = steps // 2
        view, _ = step_inputs(fc.device, before, 0, filtered, keys)
        hidden, logits, temp = view._hidden, view._logits, view.temperature
        sampled = torch.zeros(len(before), dtype=torch.long, device=fc.device)
        is_random = np.arange(len(before)) < len(before) - greedy_rows

        @torch.inference_mode()  # as vLLM runs a step (the closing read below: outside)
        def step(t: int, rows: RowInfo) -> None:
            for x in (*hidden.values(), logits):  # the forward writes the step's tensors
                x.fill_(1.0)
            view = GuideView(t, rows, logits, temp, is_random, filtered, hidden)
            c.guide(view)
            view.commit()
            torch.argmax(logits, dim=-1, out=sampled)  # the sampler reads the logits
            c.on_bundle(Bundle(t, rows, hidden))

        step(0, before)  # the groups' slots are allocated (host bookkeeping)
        with fc.steps():
            for t in range(1, steps + 1):
                if t == half:
                    for req in before.requests[:n]:
                        c.on_request_finished(req)
                step(t, before if t < half else after)
        # Counted from the results and sums that came back during the steps.
        counted = c.counters.snapshot()
        c.result()  # the closing flush (teardown: its host wait is expected)
        races = [f"x{f.count} {f.where}: {f.what}" for f in fc.findings(None, "race")]
        waits = [f"{f.where} {f.what}" for f in fc.findings(kind="host_wait")]
        accesses = fc.order.accesses if fc.order is not None else 0
        reused = c.distiller.updates_reusing_prediction
    return {
        "prompts": prompts,
        "n": n,
        "mode": mode,
        "steps": steps,
        "races": races,
        "host_waits": waits,
        "accesses_checked": accesses,
        "updates_reusing_prediction": reused,
        "counted_in_the_run": {
            k: counted.get(k, 0) for k in ("optimizer_steps", "groups_created", "groups_freed")
        },
    }


def run_runtime(
    prompts: int,
    n: int,
    mode: str,
    fit: bool,
    steps: int = 3,
    order: bool = False,
    per_request: str | None = None,
) -> dict[str, Any]:
    """ESamp driven through tllm's runtime as the vLLM bridge drives it
    (:mod:`esamp_runtime_step`: ``begin_step``, ``guide``, ``end_step`` with the step's
    stamps), on the fake device: the last step's counts of the whole runtime step, the
    places that allocated in any counted step (none: the runtime's gathers and the guide's
    view reuse its buffers, see ``tllm_core/runtime/buffer_pool.py``) and the copies of the
    step's row indices to the device (one per step). ``order``: also check stream ordering
    (the result's ``races``). ``per_request``: ESamp as a per-request consumer switched on by
    some requests (``"interleaved"``, ``"block"``, ``"all"``: see :mod:`esamp_runtime_step`)."""
    from esamp_runtime_step import RuntimeStep

    cfg = {"mode": mode, "cuda_rows_per_step": prompts * n}
    if fit:
        cfg["beta_schedule"] = "fit"
    with _fake_gpu(order=order) as fc:
        w = torch.zeros(V, H, dtype=torch.bfloat16, device=fc.device)
        model = ModelInfo(H, LAYERS, V, torch.bfloat16, fc.device, lambda z: z @ w.t(), w)
        rs = RuntimeStep(model, prompts, n, cfg, per_request)
        r = rs.rows
        hidden = {k: torch.zeros(r, H, dtype=torch.bfloat16, device=fc.device) for k in rs.tap_keys}
        logits = torch.zeros(r, V, device=fc.device)
        temp = torch.ones(r, device=fc.device)
        sampled = torch.zeros(r, dtype=torch.long, device=fc.device)

        def sample(x: torch.Tensor) -> torch.Tensor:
            return torch.argmax(x, dim=-1, out=sampled)

        def one() -> None:
            for x in (*hidden.values(), logits):  # the forward writes the step's tensors
                x.fill_(1.0)
            rs.step(hidden.__getitem__, logits, temp, sample)

        one()  # the groups' slots are allocated (host bookkeeping)
        fc.start_steps()
        copies = rs.runtime._buffers.copies
        for _ in range(steps):
            with fc.step():
                one()
        index_copies = rs.runtime._buffers.copies - copies
        report = fc.report()["steps"]
        waits = [f"{f.where} {f.what}" for f in fc.findings(kind="host_wait")]
        pageable = [f"{f.where} {f.what}" for f in fc.findings(kind="pageable_copy")]
        sites = sorted({f"{f.where} {f.code}" for f in fc.findings(kind="allocation")})
        races = [f"x{f.count} {f.where}: {f.what}" for f in fc.findings(None, "race")]
        counters = rs.runtime.counters.snapshot()
        esamp = rs.consumer.counters.snapshot()
        rs.close()
    last = report["per_step"][-1]
    return {
        "prompts": prompts,
        "n": n,
        "mode": mode,
        "fit": fit,
        **({} if per_request is None else {"per_request": per_request, "acted_on": rs.acted_on}),
        "launches": last["launches"],
        "bytes": last["bytes"],
        "allocations": last["allocation"],
        "allocation_sites": sites,
        "host_waits": waits,
        "pageable_copies": pageable,
        "races": races,
        "index_copies_per_step": index_copies / steps,
        "rows_captured": counters.get("rows_captured.layer.0", 0),
        "rows_guide_visited": counters.get("rows_guide_visited", 0),
        "esamp_decode_steps": esamp.get("decode_steps", 0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--configs", action="store_true", help="also each setting of CONFIGS at 8 x 16")
    args = p.parse_args(argv)
    out = [
        run(pr, n, mode, fit, args.steps)
        for pr, n in LAYOUTS
        for mode in ("post_filter", "full_vocab")
        for fit in (False, True)
    ]
    # The whole step through tllm's runtime (esamp_runtime_step), with stream-order checks.
    runtime = [
        run_runtime(pr, n, mode, fit, args.steps, order=True)
        for pr, n in LAYOUTS
        for mode in MODES
        for fit in (False, True)
    ]
    per_request = [
        run_runtime(pr, n, mode, False, args.steps, order=True, per_request=pq)
        for pr, n in LAYOUTS
        for mode in MODES
        for pq in PER_REQUEST
        if pr > 1 or pq == "block"
    ]
    configs = []
    if args.configs:
        for name, opts in CONFIGS:
            fit = opts.get("beta_schedule") == "fit"
            rest = {k: v for k, v in opts.items() if k != "beta_schedule"}
            for mode in ("post_filter", "full_vocab"):
                configs.append({"config": name, **run(8, 16, mode, fit, args.steps, **rest)})
    if args.json:
        print(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "results": out,
                    "runtime": runtime,
                    "runtime_per_request": per_request,
                    "configurations": configs,
                }
            )
        )
        return 0
    print(
        "| prompts x n | mode | beta | launches | GB moved | allocations (MB) | host waits "
        "| pageable copies |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in out:
        print(
            f"| {r['prompts']} x {r['n']} | {r['mode']} | {'fit' if r['fit'] else 'constant'} | "
            f"{r['launches']} | {r['bytes'] / 1e9:.2f} | {r['allocations']} "
            f"({r['allocated_bytes'] / 1e6:.0f}) | {r['host_waits']} | {r['pageable_copies']} |"
        )
    for r in runtime:
        beta = "fit" if r["fit"] else "constant"
        print(
            f"\nthrough the runtime, {r['prompts']} x {r['n']} {r['mode']} {beta}: "
            f"{r['launches']} launches, "
            f"{r['bytes'] / 1e9:.2f} GB, host waits {len(r['host_waits'])}, pageable copies "
            f"{len(r['pageable_copies'])}, races {len(r['races'])}, allocations "
            f"{r['allocations']} (in any step: {len(r['allocation_sites'])} places), "
            f"{r['index_copies_per_step']:g} index copy per step"
        )
    for r in per_request:
        print(
            f"\nper request ({r['per_request']}, {r['acted_on']} rows), {r['prompts']} x "
            f"{r['n']} {r['mode']}: {r['launches']} launches, {r['bytes'] / 1e9:.2f} GB, host "
            f"waits {len(r['host_waits'])}, pageable copies {len(r['pageable_copies'])}, races "
            f"{len(r['races'])}, allocations {r['allocations']} (in any step: "
            f"{len(r['allocation_sites'])} places), {r['index_copies_per_step']:g} index copy "
            "per step"
        )
    if configs:
        print("\n| 8 x 16, setting | mode | launches | GB moved | allocations (MB) | host waits |")
        print("|---|---|---:|---:|---:|---:|")
        for r in configs:
            print(
                f"| {r['config']} | {r['mode']} | {r['launches']} | {r['bytes'] / 1e9:.2f} | "
                f"{r['allocations']} ({r['allocated_bytes'] / 1e6:.0f}) | {r['host_waits']} |"
            )
    return 0


def render(fs: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: ESamp's step alone, through the
    runtime, per request and per setting, each row a count on the fake device."""
    from bench_setup import section, table

    def beta(r: dict[str, Any]) -> str:
        return "fit" if r.get("fit") else "constant"

    def n(v: Any) -> int:
        return len(v) if isinstance(v, list) else v

    rows = []
    for where, key in (
        ("consumer", "results"),
        ("runtime", "runtime"),
        ("runtime", "runtime_per_request"),
        ("consumer", "configurations"),
    ):
        for r in fs.get(key, []):
            what = r.get("config") or (
                f"per request ({r['per_request']})" if "per_request" in r else where
            )
            rows.append(
                [
                    f"{r['prompts']} x {r['n']}" if "prompts" in r else "8 x 16",
                    what,
                    r["mode"],
                    beta(r),
                    r["launches"],
                    f"{r['bytes'] / 1e9:.2f}",
                    r["allocations"],
                    n(r["host_waits"]),
                    n(r.get("pageable_copies", 0)),
                ]
            )
    head = ["prompts x n", "driven by", "mode", "beta", "launches", "GB moved", "allocations"]
    command = "python benchmarks/esamp_fake_step.py --configs --json"
    return section(
        "ESamp decode step on the fake CUDA device",
        fs,
        table([*head, "host waits", "pageable copies"], rows),
        command=command,
    )


if __name__ == "__main__":
    sys.exit(main())
