"""Why a consumer could not be built, told in the author's terms: the consumer, the config
field or the line that failed, and where the build ran."""

from __future__ import annotations

import traceback
from typing import Any

from tllm_core.api.ports import PortDeclarationError, resolve_layer

# Where a build runs, for messages.
DRY = "dry"  # the front end's build on the meta device, from config.json, before vLLM starts
ENGINE = "engine"  # the build in the process that runs the model, weights loaded


class ConsumerBuildError(ValueError):
    """A consumer's construction (``__init__``, ``reads``, ``writes``, their ports) failed."""

    def __init__(self, consumer: str, message: str):
        super().__init__(message)
        self.consumer = consumer


class LayerResolver:
    """``resolve_layer`` for one consumer's build, remembering the index it refused."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.refused: int | None = None

    def __call__(self, layer: int) -> int:
        try:
            return resolve_layer(layer, self.num_layers)
        except ValueError:
            self.refused = layer
            raise


def _fields_holding(config: Any, value: int) -> list[str]:
    """Config fields whose value is the int ``value`` or a list containing it."""
    out = []
    for name, v in getattr(config, "__dict__", {}).items():
        items = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, int) and not isinstance(x, bool) and x == value for x in items):
            out.append(name)
    return out


def _author_frame(e: BaseException) -> str:
    """`` (at file:line in function)`` of the innermost frame outside tllm_core and torch."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if "tllm_core" not in f.filename and "/torch/" not in f.filename]
    f = (mine or frames or [None])[-1]
    return "" if f is None else f" (at {f.filename}:{f.lineno} in {f.name})"


def explain(
    name: str, config: Any, e: Exception, resolver: LayerResolver, where: str, model: str = ""
) -> ConsumerBuildError:
    """The one-line error for consumer ``name`` whose build raised ``e``."""
    n = resolver.num_layers
    at = f" at {model}" if model else ""
    if resolver.refused is not None and isinstance(e, ValueError):
        bad = resolver.refused
        fields = _fields_holding(config, bad)
        what = (
            " and ".join(f"config field {f!r}" for f in fields) + f" = {bad}"
            if fields
            else f"layer index {bad} (from its ports)"
        )
        return ConsumerBuildError(
            name,
            f"consumer {name!r}: {what} is out of range: the model{at} has {n} decoder "
            f"layers (valid: {-n}..{n - 1}, negative counts from the end)",
        )
    # The consumer's own refusal of its settings, or ports it declared wrongly.
    if isinstance(e, (ValueError, PortDeclarationError)):
        return ConsumerBuildError(name, f"consumer {name!r}: {e}")
    if where == DRY:
        return ConsumerBuildError(
            name,
            f"consumer {name!r} raised {type(e).__name__} while being built in the dry build "
            f"(before vLLM starts: ModelInfo from the model's config.json{at}, device "
            f"'meta': its tensors hold no data, no LM head): {e}{_author_frame(e)}. Code that "
            f"needs real weights can check `context.model.device.type == 'meta'`",
        )
    return ConsumerBuildError(
        name,
        f"consumer {name!r} raised {type(e).__name__} while being built in the engine: "
        f"{e}{_author_frame(e)}",
    )
