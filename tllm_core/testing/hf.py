"""The kit's transformers side: a Hugging Face causal LM described as the engine describes the
model to consumers (:class:`~tllm_core.api.consumer.ModelInfo`), and forward hooks that capture
and edit its tap sites as the engine's taps do, over the step's packed rows (a request's
forward covers ``[offset, offset + n)``)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from tllm_core.api.consumer import ModelInfo
from tllm_core.api.edits import EditBuffers, apply_edit
from tllm_core.api.norms import norm_eps, rmsnorm_gain
from tllm_core.app.default_model import default_model_path

# Tap sites the kit serves: per layer (module of the decoder layer; None: the layer itself)
# and per step. Router taps need vLLM's MoE runner: not served here.
LAYER_SITES: Mapping[str, str | None] = MappingProxyType(
    {"residual": None, "attn": "self_attn", "mlp": "mlp"}
)
STEP_SITES = ("final", "logits", "sampled")


def load_model(
    model: str | Path | None, dtype: torch.dtype | str = torch.float32, *, shared: bool = False
) -> tuple[Any, Any, str]:
    """``(transformers model, tokenizer, folder)``; ``None``: the embedded model. ``dtype``: a
    torch dtype or its name. ``shared``: the process's one copy of this folder in this dtype
    (weights must then not be changed in place)."""
    model = default_model_path() if model is None else model
    path = str(Path(model).resolve())
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"model {str(model)!r} is not a local Hugging Face folder (no config.json)"
        )
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    hf, tok = (_load_shared if shared else _load)(path, name)
    return hf, tok, path


def _load(path: str, dtype: str) -> tuple[Any, Any]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return hf, AutoTokenizer.from_pretrained(path)


# A test process's kits share what they load (the slow part of a kit test); at most two.
_load_shared = functools.lru_cache(maxsize=2)(_load)


def _module(hf: Any, name: str, kind: type, what: str) -> Any:
    """``hf.model.<name>``, checked to be a ``kind``."""
    found = getattr(getattr(hf, "model", None), name, None)
    if not isinstance(found, kind):
        raise ValueError(f"{type(hf).__name__}: no {what} at model.{name}")
    return found


def site_module(hf: Any, site: str, layer: int) -> nn.Module:
    """The module whose output is tap ``site`` at decoder layer ``layer`` (``final``: the
    final norm)."""
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
    """What a consumer is told about the model in an engine, for this transformers model: the
    head as the model computes it (scaling and soft-capping included), its ``[vocab, hidden]``
    weight when it is a plain linear, the final norm and its gain when it is a plain RMSNorm."""
    cfg = hf.config.get_text_config()
    linear = hf.get_output_embeddings()
    scaling = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def head(h: torch.Tensor) -> torch.Tensor:
        logits = linear(h.to(linear.weight.dtype)) / scaling  # x / 1.0 is x exactly
        return logits if cap is None else torch.tanh(logits / cap) * cap

    plain = getattr(linear, "bias", None) is None and scaling == 1.0 and cap is None
    norm = _module(hf, "norm", nn.Module, "final norm")
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


class Window:
    """Which packed rows the running forward covers: ``here.span``, its ``(offset, rows)``
    (per thread: forwards may run side by side)."""

    def __init__(self) -> None:
        self.here = threading.local()
        self.active = False  # hooks act only in the kit's own forwards (a test may call the model)
        self.lockstep: Lockstep | None = None


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

    def __init__(self, key: str, width: int, dtype: torch.dtype, window: Window):
        self.key = key
        self.width = width
        self.dtype = dtype
        self.window = window
        self.capture: torch.Tensor | None = None
        self.edit: EditBuffers | None = None
        self.edited = torch.zeros(1, dtype=torch.int64)
        self._count = threading.Lock()

    def begin(self, total: int) -> None:
        self.capture = torch.zeros(total, self.width, dtype=self.dtype)
        self.edited.zero_()

    def process(self, s: torch.Tensor) -> torch.Tensor | None:
        """``s`` ``[n, width]``: this request's rows; returns the edited tensor (None: as is)."""
        lo, n = self.window.here.span
        new = None
        if self.edit is not None:
            e = self.edit
            mask = e.mask[lo : lo + n]
            new = apply_edit(s, mask, e.keep[lo : lo + n], e.add[lo : lo + n], e.dir[lo : lo + n])
            if e.transforms and self.window.lockstep is None:
                new, mask = self._transform(new, lo)
            elif e.transforms:
                new, mask = self.window.lockstep.meet(self.key, lo, new, self._transform)
            changed = ((new != s) & (new == new)).any(-1, keepdim=True) & mask
            with self._count:
                self.edited += changed.sum()
            s = new
        self.capture[lo : lo + n] = s.detach().to(self.dtype)
        return new

    def _transform(self, new: torch.Tensor, lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The in-graph transforms on rows ``[lo, lo + len(new))``, in consumer order; returns
        ``(new rows, rows edited)``."""
        mask = self.edit.mask[lo : lo + len(new)]
        for _, module, rows in self.edit.transforms:
            rows = rows[lo : lo + len(new)]
            new = torch.where(rows, module(new, rows), new)
            mask = mask | rows
        return new, mask

    def install(self, hf: Any, site: str, layer: int | None) -> Any:
        """Hook this tap on ``site``; returns the hook handle."""

        def hook(_module: Any, _args: Any, out: Any) -> Any:
            if not self.window.active:
                return None
            t = out[0] if isinstance(out, tuple) else out  # [1, n, width]: one request
            new = self.process(t[0])
            if new is None:
                return None
            return (new[None], *out[1:]) if isinstance(out, tuple) else new[None]

        return site_module(hf, site, layer or 0).register_forward_hook(hook)
