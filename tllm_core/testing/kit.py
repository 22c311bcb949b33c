"""The consumer test kit: consumers run by the engine's own runtime on a transformers model,
scheduled and sampled as vLLM does, without vLLM (what differs: docs/testing-consumers.md)."""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pydantic
import torch
from pydantic import Field
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tllm_core.api.architectures import STEP_SITES
from tllm_core.api.consumer import Consumer, ModelInfo
from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.api.edits import EditBuffers, apply_edit
from tllm_core.api.norms import norm_eps, rmsnorm_gain
from tllm_core.api.request_settings import SAMPLES_KEY
from tllm_core.api.results import asked_results, decode_results, with_missing
from tllm_core.api.rows import RequestInfo, StepLayout, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.app.default_model import default_model_path
from tllm_core.app.defaults import DEFAULT_DTYPE
from tllm_core.app.engine import raise_newly_disabled
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.dry_run import dry_build
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.serving.keys import EngineConsumers, validate_extra_args

# -- the transformers model, described and tapped as the engine's ------------------------------
# Tap sites the kit serves per layer (module of the decoder layer; None: the layer itself).
# Router taps need vLLM's MoE runner: not served here.
LAYER_SITES: Mapping[str, str | None] = MappingProxyType(
    {"residual": None, "attn": "self_attn", "mlp": "mlp"}
)


def _load(path: str, dtype: str) -> tuple[Any, Any]:
    """``(transformers model, tokenizer)`` of a local folder, ``dtype`` a torch dtype's name."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return hf, AutoTokenizer.from_pretrained(path)


# A test process's kits share what they load (the slow part of a kit test); at most two.
_load_shared = functools.lru_cache(maxsize=2)(_load)


def _module(hf: Any, name: str, kind: type, what: str) -> Any:
    found = getattr(getattr(hf, "model", None), name, None)
    if not isinstance(found, kind):
        raise ValueError(f"{type(hf).__name__}: no {what} at model.{name}")
    return found


def site_module(hf: Any, site: str, layer: int) -> nn.Module:
    """The module whose output is tap ``site`` at layer ``layer`` (``final``: the final norm)."""
    if site == "final":
        return _module(hf, "norm", nn.Module, "final norm")
    if site not in LAYER_SITES:
        raise ValueError(
            f"the test kit serves tap sites {', '.join([*LAYER_SITES, *STEP_SITES])}; "
            f"{site!r} needs vLLM (run that consumer in an engine)"
        )
    block = _module(hf, "layers", nn.ModuleList, "decoder layers")[layer]
    child = LAYER_SITES[site]
    return block if child is None else getattr(block, child)


def model_info(hf: Any) -> ModelInfo:
    """The ``ModelInfo`` an engine gives consumers, for this transformers model (the head
    with its scaling and soft-capping, the final norm)."""
    cfg = hf.config.get_text_config()
    linear = hf.get_output_embeddings()
    scaling = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def head(h: torch.Tensor) -> torch.Tensor:
        logits = linear(h.to(linear.weight.dtype)) / scaling  # x / 1.0 is x exactly
        return logits if cap is None else torch.tanh(logits / cap) * cap

    plain = getattr(linear, "bias", None) is None and scaling == 1.0 and cap is None
    norm = site_module(hf, "final", 0)
    w = getattr(norm, "weight", None)
    gain = None
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        with torch.no_grad():
            gain = rmsnorm_gain(norm, w.shape[0], norm_eps(norm), w.dtype, w.device)
    param = next(hf.parameters())
    return ModelInfo(
        hidden_size=int(cfg.hidden_size),
        num_layers=int(cfg.num_hidden_layers),
        vocab_size=int(cfg.vocab_size),
        dtype=param.dtype,
        device=param.device,
        lm_head=head,
        lm_head_weight=linear.weight if plain else None,
        final_norm=lambda h: norm(h),
        final_norm_weight=gain,
        final_norm_eps=norm_eps(norm) if gain is not None else None,
    )


class LockstepBroken(RuntimeError):
    """Another forward of the step failed (or was late) while this one waited at a tap."""


class Lockstep:
    """The step's forwards, one thread each, meet at every tap with a transform, which then
    runs once over all the step's rows as the engine's does (a failure breaks the meeting)."""

    def __init__(self, parties: int, timeout: float) -> None:
        self.timeout = timeout
        self._barrier = threading.Barrier(parties, action=self._run, timeout=timeout)
        self._lock = threading.Lock()
        self._parts: dict[int, torch.Tensor] = {}  # by first row
        self._run_on: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None

    def meet(
        self,
        key: str,
        lo: int,
        part: torch.Tensor,
        run: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand in this forward's rows ``[lo, lo + len(part))``; ``run`` (the same for every
        party) maps the step's rows to ``(new rows, row mask)``; returns this forward's slice."""
        with self._lock:
            self._parts[lo] = part
            self._run_on = run
        try:
            self._barrier.wait()  # bounded: the barrier's timeout
        except threading.BrokenBarrierError:
            raise LockstepBroken(
                f"tap {key!r}: another request's forward of this step failed, or the step's "
                f"forwards did not all reach the tap within {self.timeout:g} s"
            ) from None
        new, mask = self._out
        return new[lo : lo + len(part)], mask[lo : lo + len(part)]

    def _run(self) -> None:
        parts, self._parts = self._parts, {}
        self._out = self._run_on(torch.cat([parts[lo] for lo in sorted(parts)]))

    def abort(self) -> None:
        self._barrier.abort()


class HfTap:
    """One tap: captures into ``capture`` (``[T, width]`` for the step) and edits via ``edit``."""

    def __init__(self, key: str, width: int, dtype: torch.dtype):
        self.key = key
        self.width = width
        self.dtype = dtype
        self.capture: torch.Tensor | None = None
        self.edit: EditBuffers | None = None
        self.edited = torch.zeros(1, dtype=torch.int64)
        self._count = threading.Lock()

    def begin(self, total: int) -> None:
        self.capture = torch.zeros(total, self.width, dtype=self.dtype)
        self.edited.zero_()

    def process(self, s: torch.Tensor, lo: int, step: Lockstep) -> torch.Tensor | None:
        """One request's rows ``s``, the step's from row ``lo``, edited (None: as is)."""
        rows = slice(lo, lo + len(s))
        new = None
        if self.edit is not None:
            e = self.edit
            mask = e.mask[rows]
            new = apply_edit(s, mask, e.keep[rows], e.add[rows], e.dir[rows])
            if e.transforms:  # over the step's rows, as in the engine
                new, mask = step.meet(self.key, lo, new, self._transform)
            changed = ((new != s) & (new == new)).any(-1, keepdim=True) & mask
            with self._count:
                self.edited += changed.sum()
            s = new
        self.capture[rows] = s.detach().to(self.dtype)
        return new

    def _transform(self, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The in-graph transforms over the step's rows in consumer order: ``(new rows, edited)``."""
        mask = self.edit.mask[: len(new)]
        for _, module, rows in self.edit.transforms:
            rows = rows[: len(new)]
            new = torch.where(rows, module(new, rows), new)
            mask = mask | rows
        return new, mask


# -- the sampler: vLLM's order of greedy, temperature, min-p, top-k / top-p, guidance, draw -----
GREEDY_BELOW = 1e-5  # vLLM treats a temperature below this as greedy


@pydantic.dataclasses.dataclass(frozen=True)
class Sampling:
    """One request's sampling settings (the fields of vLLM's ``SamplingParams`` the kit uses)."""

    temperature: float = Field(1.0, ge=0, le=2)  # vLLM's bounds
    top_k: int = Field(0, ge=-1)  # 0 or -1: off (vLLM's)
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def filter_logits(logits: torch.Tensor, params: list[Sampling]) -> tuple[torch.Tensor, bool]:
    """``(filtered, filtered_any)``: fp32 logits divided by temperature (greedy rows by 1), min-p
    then top-k / top-p applied per row (removed entries ``-inf``); ``filtered_any`` as the
    ``GuideView.filtered`` flag: a top-k or top-p for the batch, or min-p > 0 for a row."""
    temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    out = logits.float() / temp[:, None]
    for i, p in enumerate(params):
        row = out[i]
        if p.min_p > 0:
            probs = row.softmax(-1)
            row.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k > 0 and p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row.masked_fill_(row < kth, float("-inf"))
        if p.top_p < 1.0:
            # Keep the smallest set of highest logits whose probability reaches top_p.
            vals, idx = row.sort(descending=True)
            before = vals.softmax(-1).cumsum(-1) - vals.softmax(-1)  # mass above each entry
            drop = before >= p.top_p
            drop[0] = False
            row[idx[drop]] = float("-inf")
    filtered = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params)
    return out, filtered


def draw(
    raw: torch.Tensor,
    guided: torch.Tensor,
    params: list[Sampling],
    gens: list[torch.Generator],
    rows: list[str],
) -> torch.Tensor:
    """Token per row: greedy rows the raw logits' argmax, random ones a draw from the guided
    (``rows``: how an error names each row; the engine draws an arbitrary token instead)."""
    out = torch.empty(len(params), dtype=torch.int32)  # as vLLM's sampler gives them
    for i, p in enumerate(params):
        if p.greedy:
            out[i] = raw[i].argmax()
        elif not bool((probs := guided[i].softmax(-1)).isfinite().all()):  # vLLM: token 0
            row = f"sampling row {i} ({rows[i]})"
            raise ValueError(f"the guides left {row} nothing to draw (all -inf, NaN or +inf)")
        else:
            out[i] = torch.multinomial(probs, 1, generator=gens[i])[0]
    return out


# -- the kit -----------------------------------------------------------------------------------
ConsumerArg = str | dict | ConsumerSpec | type[Consumer] | tuple[type[Consumer], dict]


@dataclass
class _Request:
    info: RequestInfo
    sampling: Sampling
    max_tokens: int
    ignore_eos: bool
    generator: torch.Generator
    forced: list[int] | None = None  # tokens to take instead of drawing (a replay)
    cache: Any = None
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return [*self.info.prompt_token_ids, *self.output]


def warn_undeclared(consumer: Consumer, guides: bool, edits: bool) -> None:
    """Warn an author whose consumer defines ``guide``/``edit`` without declaring its write
    port: the runtime never calls it (``writes()`` may leave a port out on purpose, so the
    engine says nothing)."""
    for method, declared, port in (
        ("guide", guides, "SamplerGuide()"),
        ("edit", edits, "an Edit(...) or ResidualEdit(...)"),
    ):
        if getattr(type(consumer), method) is not getattr(Consumer, method) and not declared:
            warnings.warn(
                f"consumer {consumer.name!r} defines {method}() but its writes() declare no "
                f"{port} with this config: {method}() is never called (docs/ports.md, "
                '"Write ports")',
                stacklevel=3,
            )


class ConsumerKit:
    """Consumers run on a transformers model by tllm's runtime, without vLLM (arguments:
    docs/testing-consumers.md; ``settings``: other ``RuntimeSettings`` fields)."""

    def __init__(
        self,
        model: str | Path | None = None,
        consumers: Sequence[ConsumerArg] = (),
        *,
        max_num_batched_tokens: int = 2048,
        max_consecutive_failures: int = 3,
        raise_on_disabled: bool = True,
        dtype: torch.dtype | str = DEFAULT_DTYPE,
        share_model: bool = True,
        lockstep_timeout: float = 300.0,
        settings: dict[str, Any] | None = None,
    ):
        self.registry = Registry()  # consumers checked first: before the model loads
        specs = [self._spec(c) for c in ConsumerSpec.listed(consumers)]
        configs = self.registry.check(specs)
        model = default_model_path() if model is None else model
        self.model_path = str(Path(model).resolve())
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(
                f"model {str(model)!r} is not a local Hugging Face folder (no config.json)"
            )
        dry_build(specs, configs, self.model_path, self.registry)  # as TllmLLM does first
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        load = _load_shared if share_model else _load  # shared: weights must not change
        self.hf, self.tokenizer = load(self.model_path, name)
        self.lockstep_timeout = float(lockstep_timeout)
        self.model = model_info(self.hf)
        runtime_settings = RuntimeSettings(
            consumers=specs, max_consecutive_failures=max_consecutive_failures, **(settings or {})
        )
        with torch.inference_mode(False):  # as the engine builds them (trainable state)
            self.runtime = Runtime(runtime_settings, self.model, self.registry)
        for slot in self.runtime.slots:
            warn_undeclared(slot.consumer, guides=slot.guides, edits=bool(slot.edits))
        self._keys = EngineConsumers.of(specs, configs, self.registry)
        self.budget = int(max_num_batched_tokens)
        if self.budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.budget}")
        self.raise_on_disabled = raise_on_disabled
        self._raised: set[str] = set()
        self._here = threading.local()  # lo: the first step row of this thread's forward
        self._lockstep: Lockstep | None = None  # set only during the kit's own forwards
        self._taps: dict[str, HfTap] = {}
        self._handles: list[Any] = []
        self._edits: dict[str, EditBuffers] = {}
        self._install_taps()
        self._ids = itertools.count()  # request ids "0", "1", ... across calls, as vLLM's
        self._seqs = itertools.count(1)
        self._finished: list[RequestInfo] = []
        # The last generate's per-request results: (prompt index, sample) -> {consumer: value}.
        self.results: dict[tuple[int, int], dict[str, Any]] = {}

    # -- set-up -------------------------------------------------------------------------------
    def _spec(self, c: ConsumerArg) -> ConsumerSpec:
        config: dict = {}
        if isinstance(c, tuple):
            c, config = c
        if isinstance(c, type) and issubclass(c, Consumer):
            self.registry.use(c)
            return ConsumerSpec(name=c.name, config=config)
        if isinstance(c, dict) and isinstance(c.get("name"), type):
            self.registry.use(c["name"])  # {"name": TheClass, "per_request": True, ...}
            c = {**c, "name": c["name"].name}
        return ConsumerSpec.coerce(c)

    def _install_taps(self) -> None:
        info = self.model
        edit_keys = {t.key for t in self.runtime.edit_taps}
        for tap in sorted(self.runtime.taps, key=lambda t: t.key):
            if tap.site in ("logits", "sampled"):
                continue  # filled from the sampler
            t = self._taps[tap.key] = HfTap(tap.key, info.hidden_size, info.dtype)
            if tap.key in edit_keys:
                e = EditBuffers(self.budget, info.hidden_size, info.dtype, torch.device("cpu"))
                for owner, module in self.runtime.transforms(tap.key):
                    e.add_transform(owner, module)
                t.edit = self._edits[tap.key] = e
            module = site_module(self.hf, tap.site, tap.layer or 0)
            self._handles.append(module.register_forward_hook(functools.partial(self._hook, t)))

    def _hook(self, tap: HfTap, _module: Any, _args: Any, out: Any) -> Any:
        if self._lockstep is None:  # not the kit's forward (a test may call the model)
            return None
        t = out[0] if isinstance(out, tuple) else out  # [1, n, width]: one request
        new = tap.process(t[0], self._here.lo, self._lockstep)
        if new is None:
            return None
        return (new[None], *out[1:]) if isinstance(out, tuple) else new[None]

    # -- what a test reads ------------------------------------------------------------------------
    def consumer(self, name: str) -> Consumer:
        """The built consumer named ``name`` (to read its state in a test)."""
        for s in self.runtime.slots:
            if s.consumer.name == name:
                return s.consumer
        raise KeyError(f"no consumer {name!r} in this kit (has: {self.names})")

    @property
    def names(self) -> list[str]:
        return [s.consumer.name for s in self.runtime.slots]

    def collect(self) -> dict[str, Any]:
        """The report ``TllmLLM.collect`` returns."""
        return self.runtime.collect()

    def close(self) -> dict[str, Any]:
        """Close the consumers and return the final report (hooks removed)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        report = self.runtime.close()
        if self.raise_on_disabled:  # as TllmLLM.close: switched off while closing
            raise_newly_disabled(report["errors"], self._raised, report=report)
        return report

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt, as vLLM's ``generate`` tokenizes it."""
        return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str | Sequence[int]],
        max_tokens: int = 8,
        n: int = 1,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = 0,
        ignore_eos: bool = False,
        extra_args: dict | Sequence[dict | None] | None = None,
        tokens: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> list[list[list[int]]]:
        """Token ids per prompt and sample, generated like ``TllmLLM.generate`` with one
        ``SamplingParams`` of these fields (``tokens``: a replay; docs/testing-consumers.md)."""
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        extras = list(extra_args) if isinstance(extra_args, (list, tuple)) else None
        if extras is not None and len(extras) != len(items):
            raise ValueError(f"got {len(items)} prompts and {len(extras)} extra_args dicts")
        if max_tokens < 1 or n < 1:
            raise ValueError(f"max_tokens and n must be >= 1, got {max_tokens} and {n}")
        sampling = Sampling(temperature, top_k, top_p, min_p, seed)
        if sampling.greedy and n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {n} (vLLM's rule)")
        if tokens is not None and (
            len(tokens) != len(items) or any(len(t) != n or not all(t) for t in tokens)
        ):
            raise ValueError(f"tokens must hold {n} non-empty token lists for each of the prompts")
        reqs: list[_Request] = []
        for i, p in enumerate(items):
            extra = dict((extras[i] if extras is not None else extra_args) or {})
            validate_extra_args(extra, self._keys, where="extra_args", tags=True)
            extra.setdefault("tllm_prompt_index", i)
            extra[SAMPLES_KEY] = n
            ids = self.tokenize(p) if isinstance(p, str) else [int(t) for t in p]
            rid = str(next(self._ids))
            for j in range(n):
                seq = next(self._seqs)
                base = f"{rid}-kit{seq:05d}"
                gen = torch.Generator().manual_seed((seed if seed is not None else seq) * 1009 + j)
                info = RequestInfo(
                    engine_id=f"{j}_{base}" if n > 1 else base,
                    request_id=rid,
                    prompt_index=i,
                    sample_index=j,
                    num_prompt_tokens=len(ids),
                    extra_args=dict(extra),
                    prompt_token_ids=tuple(ids),
                    parent_id=base,
                )
                forced = None if tokens is None else [int(t) for t in tokens[i][j]]
                limit = max_tokens if forced is None else len(forced)
                cache = DynamicCache(config=self.hf.config)
                reqs.append(_Request(info, sampling, limit, ignore_eos, gen, forced, cache))
        while not all(r.done for r in reqs):
            self._step([r for r in reqs if not r.done])
        self._report_finished()  # as TllmLLM's end of batch: every request is done
        self._take_results(reqs)
        out: list[list[list[int]]] = [[] for _ in items]
        for r in reqs:
            out[r.info.prompt_index].append(r.output)
        if self.raise_on_disabled:  # as TllmLLM.generate
            raise_newly_disabled(self.runtime.bus.errors, self._raised, outputs=out)
        return out

    def _take_results(self, reqs: list[_Request]) -> None:
        """:attr:`results` by (prompt index, sample), as ``TllmLLM`` sets ``completion.tllm``."""
        asking = [r for r in reqs if asked_results(r.info.extra_args)]
        self.results = {}
        if not asking:
            return
        wait = self.runtime.settings.results_wait_s
        got = self.runtime.take_results(sorted({r.info.request_id for r in asking}), wait)
        for r in asking:
            mine = got.get(r.info.request_id, {}).get(r.info.sample_index, {})
            answer = with_missing(asked_results(r.info.extra_args), mine, wait)
            self.results[r.info.prompt_index, r.info.sample_index] = decode_results(answer)

    def _report_finished(self) -> None:
        if self._finished:
            done, self._finished = self._finished, []
            self.runtime.finish_requests(done)

    def _schedule(self, running: list[_Request]) -> list[tuple[_Request, int]]:
        """Decode rows first (one each), then prefill chunks within the token budget."""
        out, left = [], self.budget
        for r in sorted(running, key=lambda r: r.computed < r.info.num_prompt_tokens):
            k = min(max(r.info.num_prompt_tokens - r.computed, 1), left)
            if k > 0:
                out.append((r, k))
                left -= k
        return out

    @torch.inference_mode()
    def _step(self, running: list[_Request]) -> None:
        self._report_finished()  # the engine hears of finished requests at the next step
        sched = self._schedule(running)
        num = np.array([k for _, k in sched], dtype=np.int64)
        fed = [r.tokens[r.computed : r.computed + k] for r, k in sched]
        layout = StepLayout(
            engine_ids=[r.info.engine_id for r, _ in sched],
            num_scheduled=num,
            num_computed=np.array([r.computed for r, _ in sched], dtype=np.int64),
            num_tokens=np.array([len(r.tokens) for r, _ in sched], dtype=np.int64),
            token_ids=torch.tensor([t for f in fed for t in f], dtype=torch.int32),  # as vLLM
        )
        rows, sample_row, kept = layout_rows(layout, [r.info for r, _ in sched])
        total = int(num.sum())
        for t in self._taps.values():
            t.begin(total)
        step = StepCapture(
            step=self.runtime.step_index + 1,
            rows=rows,
            sample_token_row=sample_row,
            sample_kept=kept,
            edited={k: t.edited for k, t in self._taps.items() if t.edit is not None},
        )
        self.runtime.begin_step(rows, self._edits)
        try:
            logits = self._forward(sched, fed)
        finally:
            self._lockstep = None
        step.tensors = {k: t.capture for k, t in self._taps.items() if t.capture is not None}
        raw = torch.stack(logits)
        step.tensors["logits"] = raw
        params = [r.sampling for r, _ in sched]
        guided, filtered = filter_logits(raw, params)
        rand = np.array([not p.greedy for p in params], dtype=bool)
        if rand.any():  # vLLM's all-greedy batches never reach the guided sampler
            temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
            self.runtime.guide(step, guided, temps, rand, filtered)
        guides = ", ".join(repr(s.consumer.name) for s in self.runtime.slots if s.guides)
        named = [
            f"request {r.info.request_id!r}, sample {r.info.sample_index}; guides: {guides}"
            for r, _ in sched
        ]
        tokens = draw(raw, guided, params, [r.generator for r, _ in sched], named)
        for j, (r, _k) in enumerate(sched):
            if r.forced is not None and kept[j]:
                tokens[j] = r.forced[len(r.output)]
        step.tensors["sampled"] = tokens
        self.runtime.end_step(step)
        eos = self._eos()
        for j, (r, k) in enumerate(sched):
            r.computed += k
            if not kept[j]:
                continue  # mid-prefill: the token is discarded
            tok = int(tokens[j])
            r.output.append(tok)
            if len(r.output) >= r.max_tokens or (not r.ignore_eos and tok in eos):
                r.done = True
                self._finished.append(r.info)

    def _forward(
        self, sched: list[tuple[_Request, int]], fed: list[list[int]]
    ) -> list[torch.Tensor]:
        """Each request's forward (own KV cache): its last row's logits. With a transform the
        forwards run side by side and meet at its tap, so that it sees the whole step."""
        spans = np.cumsum([0] + [k for _, k in sched])[:-1].tolist()
        transforms = any(t.edit is not None and t.edit.transforms for t in self._taps.values())
        step = self._lockstep = Lockstep(len(sched), self.lockstep_timeout)
        if len(sched) < 2 or not transforms:  # one party: the tap's meeting runs at once
            return [
                self._forward_one(r, ids, lo)
                for (r, _), ids, lo in zip(sched, fed, spans, strict=True)
            ]
        logits: list[torch.Tensor | None] = [None] * len(sched)
        errors: list[BaseException] = []

        def run(j: int) -> None:
            try:
                with torch.inference_mode():
                    logits[j] = self._forward_one(sched[j][0], fed[j], spans[j])
            except BaseException as e:  # noqa: B036 - handed to the caller below
                errors.append(e)
                step.abort()

        threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(len(sched))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.lockstep_timeout)
            if t.is_alive():
                step.abort()
                raise TimeoutError(
                    f"ConsumerKit: a request's forward did not end within "
                    f"{self.lockstep_timeout:g} s (a transform or hook that hangs?)"
                )
        if errors:  # the forward that failed first, not those it broke off
            raise next((e for e in errors if not isinstance(e, LockstepBroken)), errors[0])
        return [x for x in logits if x is not None]

    def _forward_one(self, r: _Request, ids: list[int], lo: int) -> torch.Tensor:
        self._here.lo = lo
        pos = torch.arange(r.computed, r.computed + len(ids))[None]
        out = self.hf(
            input_ids=torch.tensor([ids]),
            position_ids=pos,
            past_key_values=r.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        r.cache = out.past_key_values
        return out.logits[0, -1].float()

    def _eos(self) -> set[int]:
        ids = getattr(self.hf.generation_config, "eos_token_id", None)
        if ids is None:
            ids = self.hf.config.get_text_config().eos_token_id
        return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]) if i is not None}
