"""ESamp's decode step driven without vLLM, for the tests and ``benchmarks/esamp_step.py``.

:class:`RuntimeStep` drives ESamp through tllm's runtime as the vLLM bridge does: the runtime
is built with the built-in producers, the bridge's architectures and ESamp registered
directly (no entry points: the GPU image runs a checkout, not an install). One decode step is
``begin_step``; the forward's writes (the tapped hidden states and their stamps, made by the
caller); ``guide`` on the filtered logits; the sampler (the caller's); ``end_step`` (bundles,
ESamp's training submission, the stamps' read). ``per_request`` makes ESamp a per-request
consumer switched on by some requests' ``tllm_consumers`` extra arg: ``"interleaved"``, every
other prompt's requests; ``"block"``, the first half of the prompts (one contiguous run of
rows); ``"all"``, every request.

:func:`run` (the consumer alone) and :func:`run_runtime` (the whole step) count a step on the
fake CUDA device of ``tllm_core.testing.fake_cuda`` at Qwen2.5-7B's shapes (hidden 3584,
vocabulary 152064, bf16 states): launches, bytes moved, allocations, host waits, pageable
copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import numpy as np
import torch

import algorithms.esamp.factory as factory  # noqa: E402
import producers.plugin as producers_plugin
import tllm_core.vllm_bridge.plugin as bridge_plugin
from algorithms.esamp.config import ESampConfig  # noqa: E402
from algorithms.esamp.consumer import ESampConsumer
from tllm_core.api.bundles import Bundle, GuideView  # noqa: E402
from tllm_core.api.consumer import (
    ConsumerContext,  # noqa: E402
    ModelInfo,
)
from tllm_core.api.ports import resolve_layer  # noqa: E402
from tllm_core.api.request_settings import CONSUMERS_KEY
from tllm_core.api.rows import (
    RequestInfo,
    RowInfo,  # noqa: E402
    StepLayout,
    layout_rows,
)
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.runtime.stamp_copies import StampRead
from tllm_core.testing.fake_cuda import FakeCuda  # noqa: E402

PER_REQUEST = ("interleaved", "block", "all")


def switched_on(prompts: int, per_request: str) -> list[bool]:
    """Which prompts' requests switch ESamp on (see the module docstring)."""
    if per_request not in PER_REQUEST:
        raise ValueError(f"per_request must be one of {PER_REQUEST} or None, got {per_request!r}")
    if per_request == "interleaved":
        return [p % 2 == 0 for p in range(prompts)]
    if per_request == "block":
        return [p < max(1, prompts // 2) for p in range(prompts)]
    return [True] * prompts


class RuntimeStep:
    """A runtime with ESamp (config ``cfg``) over ``prompts`` x ``n`` decode rows; with
    ``per_request``, a per-request ESamp switched on by some of the requests."""

    def __init__(
        self,
        model: ModelInfo,
        prompts: int,
        n: int,
        cfg: dict[str, Any],
        per_request: str | None = None,
    ) -> None:
        reg = Registry(load_entry_points=False)
        reg.register(producers_plugin, name="producers")
        reg.register(bridge_plugin, name="vllm-bridge")
        reg.use(ESampConsumer)
        spec = {"name": "esamp", "config": cfg, "per_request": per_request is not None}
        settings = RuntimeSettings.model_validate({"consumers": [spec]})
        with torch.inference_mode(False):  # as the engine builds consumers (trainable state)
            self.runtime = Runtime(settings, model, reg)
        self.device = model.device
        on = switched_on(prompts, per_request) if per_request else [False] * prompts
        self.requests = [
            RequestInfo(
                f"{p}-{s}", f"r{p}", p, s, 3, extra_args={CONSUMERS_KEY: "esamp"} if on[p] else {}
            )
            for p in range(prompts)
            for s in range(n)
        ]
        # The rows ESamp acts on.
        self.acted_on = sum(on) * n if per_request else prompts * n
        self.rows = len(self.requests)
        self.token_ids = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        # The taps the forward writes (and stamps) vs those filled after it ("final").
        self.tap_keys = sorted(t.key for t in self.runtime.taps)
        self.stamps = {
            t.key: torch.zeros(1, dtype=torch.long, device=self.device)
            for t in self.runtime.taps
            if t.layer is not None
        }
        self._position = 5

    @property
    def consumer(self) -> ESampConsumer:
        return self.runtime.slots[0].consumer

    @torch.inference_mode()  # as vLLM runs a step (close and collect run outside it)
    def step(
        self,
        hidden: Callable[[str], torch.Tensor],
        logits: torch.Tensor,
        temperature: torch.Tensor,
        sample: Callable[[torch.Tensor], torch.Tensor],
    ) -> float:
        """One decode step (every row a sampled decode row); ``hidden(tap_key)``: that tap's
        ``[rows, H]`` states, ``logits``: already filtered (min-p). Returns the host seconds
        of the runtime's calls (``begin_step``, ``guide``, ``end_step``; not the sampler)."""
        r = self.rows
        layout = StepLayout(
            engine_ids=[q.engine_id for q in self.requests],
            num_scheduled=np.ones(r, np.int64),
            num_computed=np.full(r, self._position, np.int64),
            num_tokens=np.full(r, self._position + 1, np.int64),
            token_ids=self.token_ids,
        )
        self._position += 1
        rows, sample_row, kept = layout_rows(layout, self.requests)
        number = self.runtime.step_index + 1
        for stamp in self.stamps.values():
            stamp.fill_(number)  # the forward's stamp writes (on the device)
        step = StepCapture(
            number, rows, sample_row, kept, {k: hidden(k) for k in self.tap_keys}, dict(self.stamps)
        )
        t0 = perf_counter()
        self.runtime.begin_step(rows, {})
        self.runtime.guide(step, logits, temperature, np.ones(r, bool), True)
        t1 = perf_counter()
        step.tensors["sampled"] = sample(logits)
        t2 = perf_counter()
        with self._stamps_as_written(number):
            self.runtime.end_step(step)
        return (t1 - t0) + (perf_counter() - t2)

    @contextmanager
    def _stamps_as_written(self, number: int) -> Iterator[None]:
        """On the meta device (the test kit's fake CUDA) a read-back has no values (it reads
        ones): the step's stamps are answered as its forward wrote them, after their copy and
        event were made as on a GPU. Elsewhere nothing changes."""
        if self.device.type != "meta":
            yield
            return
        real = StampRead.values

        def values(read: StampRead) -> list[int]:
            real(read)
            return [number] * read.n_stamps + [0] * (len(read.keys) - read.n_stamps)

        StampRead.values = values  # type: ignore[method-assign]
        try:
            yield
        finally:
            StampRead.values = real  # type: ignore[method-assign]

    def close(self) -> dict[str, Any]:
        """The runtime's final report (ESamp's result under ``results``)."""
        return self.runtime.close()


H, V, LAYERS = 3584, 152064, 28
LAYOUTS = ((8, 16), (1, 128), (64, 16))
MODES = ("post_filter", "full_vocab")
# ESamp per request (RuntimeStep): every other prompt's requests switch it on, or the
# first half of the prompts (one prompt: that prompt, all the rows).
COUNTED_PER_REQUEST = ("interleaved", "block")
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
    (:class:`RuntimeStep`: ``begin_step``, ``guide``, ``end_step`` with the step's
    stamps), on the fake device: the last step's counts of the whole runtime step, the
    places that allocated in any counted step (none: the runtime's gathers and the guide's
    view reuse its buffers, see ``tllm_core/runtime/buffer_pool.py``) and the copies of the
    step's row indices to the device (one per step). ``order``: also check stream ordering
    (the result's ``races``). ``per_request``: ESamp as a per-request consumer switched on by
    some requests (``"interleaved"``, ``"block"``, ``"all"``: see :class:`RuntimeStep`)."""
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
