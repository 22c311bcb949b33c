"""Per-request settings a consumer declares (field ``f`` of consumer ``c``'s ``Request`` is the
``extra_args`` key ``tllm_{c}_{f}``), and the field types of configs and settings."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainValidator,
    ValidationError,
    ValidationInfo,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from tllm_core.api.ports import Phase, as_selector
from tllm_core.api.windows import GRAMMAR, LastRow, Window

# Largest finite float32 (numpy.finfo(numpy.float32).max), written out to keep numpy out.
F32_MAX = 3.4028234663852886e38
F32_ERROR = "float32_range"
# float32's own shortest spelling of its maximum (rounded up: every value below it fits).
F32_MAX_TEXT = "3.4028235e+38"


def check_f32(value: float) -> float:
    """``value`` if it is finite and fits float32, else a pydantic error naming both: a float
    finite in Python may overflow float32 (``1e39``) and turn the model's tensors into inf/NaN."""
    if not (math.isfinite(value) and abs(value) <= F32_MAX):
        raise PydanticCustomError(
            F32_ERROR,
            f"must be finite and within float32's range [-{F32_MAX_TEXT}, {F32_MAX_TEXT}]",
        )
    return value


#: Type of every float field of a ``ConsumerConfig`` or ``RequestSettings``: float32-finite.
FiniteF32 = Annotated[float, AfterValidator(check_f32)]

# The request-settings field name the runtime narrows a consumer's rows by.
WINDOW_FIELD = "window"
WINDOW_ERROR = "capture_window"


def request_window(value: Any) -> Any:
    """A request's window setting checked: ``None``, or its selector."""
    if value is None:
        return None
    if not isinstance(value, (str, Phase, Window, LastRow)):
        raise PydanticCustomError(WINDOW_ERROR, "must be a window text")
    try:
        selector = as_selector(value, "window")
    except ValueError:
        raise PydanticCustomError(WINDOW_ERROR, "is not a capture window") from None
    if selector is Phase.GUIDE:  # selects no bundle row: nothing would be captured
        raise PydanticCustomError(WINDOW_ERROR, "is not a capture window")
    return selector


#: Type of a consumer's per-request ``window`` field: a window text in, its selector held.
WindowSetting = Annotated[Any, PlainValidator(request_window)]


def config_window(value: Any, info: ValidationInfo) -> str:
    """A config's ``phase`` checked as a capture window (``ValueError`` naming the consumer in
    ``context["consumer"]``, the field and the grammar) and kept as its text."""
    text = str(getattr(value, "value", value))
    consumer = (info.context or {}).get("consumer")
    where = f"{consumer}: {info.field_name}" if consumer else str(info.field_name)
    if text == "guide":  # Phase.GUIDE: read at guide time only, no row in any bundle
        raise ValueError(
            f"{where}: 'guide' selects no row of a bundle (a port read at guide time only); "
            f"give a window: {GRAMMAR}"
        )
    as_selector(text, where)
    return text


#: Type of a capturing consumer's config field ``phase``: a capture window, kept as its text.
CaptureWindow = Annotated[str, BeforeValidator(config_window)]

PREFIX = "tllm_"
# Keys tllm itself reads (tllm_core.serving.keys); no consumer field may map onto one.
CONSUMERS_KEY = "tllm_consumers"
GROUP_KEY = "tllm_group"
# How tllm serve's group of a request without a ``tllm_group`` begins (a client's: "client-").
OWN_GROUP = "request/"
# Internal tags TllmLLM adds to every request (tllm serve: tllm_n), not for clients.
SAMPLES_KEY = "tllm_n"  # the n of the request's prompt
TAGS = ("tllm_prompt_index", SAMPLES_KEY)
RESULTS_KEY = "tllm_results"
GENERIC_KEYS = (CONSUMERS_KEY, GROUP_KEY, RESULTS_KEY, *TAGS)


def consumer_names(extra_args: Mapping[str, Any] | None, key: str, where: str) -> list[str]:
    """The names in ``extra_args[key]`` (comma-separated), in order, once each; ``ValueError``
    naming ``where`` for a value not a string."""
    raw = (extra_args or {}).get(key, "")
    if not isinstance(raw, str):
        raise ValueError(
            f"{where}[{key!r}] must be a comma-separated string of consumer names (e.g. "
            f'"esamp,steer"), got {short_repr(raw)}'
        )
    return list(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))


def enabled_consumers(extra_args: Mapping[str, Any], where: str = "extra_args") -> list[str]:
    """The per-request consumers a request switches on (``tllm_consumers``)."""
    return consumer_names(extra_args, CONSUMERS_KEY, where)


def acts_on(consumer: str, per_request: bool, extra_args: Mapping[str, Any]) -> bool:
    """Whether ``consumer`` acts on a request: unless per-request and not named by it."""
    return not per_request or consumer in enabled_consumers(extra_args)


class RequestSettings(BaseModel):
    """Base of a consumer's per-request settings: one field per request key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def request_key(consumer: str, field: str) -> str:
    """The ``extra_args`` key of ``field`` of consumer ``consumer``: ``tllm_{consumer}_{field}``."""
    return f"{PREFIX}{consumer}_{field}"


def request_keys(consumer: str, model: type[RequestSettings] | None) -> dict[str, str]:
    """Key -> field name of every field of ``model`` (empty for None)."""
    if model is None:
        return {}
    return {request_key(consumer, f): f for f in model.model_fields}


def _parts(annotation: Any) -> Iterator[Any]:
    """The types and ``Annotated`` metadata an annotation is made of, through unions."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        yield from args[1:]
        yield from _parts(args[0])
    elif origin in (typing.Union, types.UnionType):
        for a in args:
            yield from _parts(a)
    else:
        yield annotation


def type_name(t: Any) -> str:
    """Readable annotation: ``int | 'final'``, ``list[int | str]``."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if t is type(None):
        return "None"
    return getattr(t, "__name__", str(t))


def _marked(field: FieldInfo, check: Any) -> bool:
    """Whether the field's type (or an arm of it) is annotated with validator ``check``."""
    return any(
        getattr(m, "func", None) is check for m in (*_parts(field.annotation), *field.metadata)
    )


def allowed(field: FieldInfo) -> str:
    """What a field accepts, in words: type (or the field's ``json_schema_extra["form"]``,
    the form a client writes), bounds and choices (``float >= 0 | None``)."""
    if _marked(field, request_window):
        return f"a capture window (docs/ports.md#capture-windows): {GRAMMAR}; None: the consumer's config"
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    form = extra.get("form")
    text = str(form) if form is not None else type_name(field.annotation)
    for m in field.metadata:
        for attr, op in _BOUNDS.values():
            bound = getattr(m, attr, None)
            if bound is not None:
                text += f", {op} {bound}"
        if getattr(m, "allow_inf_nan", None) is False:
            text += ", finite"
        if getattr(m, "max_length", None) is not None:
            text += f", at most {m.max_length} entries"
    if _marked(field, check_f32):
        text += f", finite float32 (|x| <= {F32_MAX_TEXT})"
    return text


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters: a message must not echo a huge request."""
    return short_text(repr(value), limit)


def short_text(text: str, limit: int = 500) -> str:
    """``text`` cut to ``limit`` characters (a validator's words may quote the value)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# pydantic error types -> our words.
_MESSAGES = MappingProxyType(
    {
        **dict.fromkeys(("float_parsing", "float_type"), "must be a number"),
        **dict.fromkeys(("int_parsing", "int_type", "int_from_float"), "must be a whole number"),
        "finite_number": "must be finite",
        **dict.fromkeys(
            ("bool_parsing", "bool_type"), "must be a boolean (true/false, 1/0, yes/no, on/off)"
        ),
    }
)
_BOUNDS = MappingProxyType(
    {
        "greater_than_equal": ("ge", ">="),
        "greater_than": ("gt", ">"),
        "less_than_equal": ("le", "<="),
        "less_than": ("lt", "<"),
    }
)


def error_words(err: dict[str, Any]) -> str:
    kind = err["type"]
    ctx = {
        k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in (err.get("ctx") or {}).items()
    }
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    if kind in (F32_ERROR, WINDOW_ERROR):
        return err["msg"]
    if kind in _BOUNDS:
        attr, op = _BOUNDS[kind]
        return f"must be {op} {ctx.get(attr)}"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} entries (got {ctx.get('actual_length')})"
    return f"is not valid ({message(err)})"


def message(err: dict[str, Any]) -> str:
    """A pydantic error's message; a validator's ``ValueError`` as it said it (no "Value
    error, " prefix)."""
    if err["type"] == "value_error" and "error" in (err.get("ctx") or {}):
        return str(err["ctx"]["error"])
    return err["msg"]


def parse_request_settings(
    consumer: str,
    model: type[RequestSettings],
    extra: dict[str, Any] | None,
    where: str = "extra_args",
    config: Any = None,
) -> RequestSettings:
    """Consumer ``consumer``'s settings from a request's ``extra`` (absent keys: defaults;
    ``config`` goes to validators as ``info.context["config"]``). ``ValueError`` names the
    key, the bad value and what is allowed."""
    extra = extra or {}
    data: dict[str, Any] = {}
    for key, fname in request_keys(consumer, model).items():
        if key not in extra:
            continue
        value = extra[key]
        field = model.model_fields[fname]
        if isinstance(value, bool) and not any(
            t is bool or t is Any for t in _parts(field.annotation)
        ):
            raise ValueError(
                f"{where}[{key!r}] must be a number, got {value!r} (allowed: {allowed(field)})"
            )
        data[fname] = value
    try:
        return model.model_validate(data, context={"config": config})
    except ValidationError as e:
        err = e.errors()[0]
        loc = err["loc"][0] if err["loc"] else None
        if isinstance(loc, str) and loc in model.model_fields:
            key = request_key(consumer, loc)
            # Inside a list or object value: name the entry too (``['tllm_sae_steer'][2].scale``).
            inner = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"][1:])
            value = err.get("input") if inner else data.get(loc)
            raise ValueError(
                f"{where}[{key!r}]{inner} {error_words(err)}, got {short_repr(value)} "
                f"(allowed: {allowed(model.model_fields[loc])})"
            ) from None
        # A model-level check (several fields together): name every key that was given.
        keys = ", ".join(repr(request_key(consumer, f)) for f in data) or "(none)"
        raise ValueError(f"{where}[{keys}]: {message(err)}") from None


def describe_field(f: FieldInfo) -> dict[str, Any]:
    """A field's allowed values, default (None: required) and description, as listed."""
    default = None if f.is_required() else f.get_default(call_default_factory=True)
    return {"allowed": allowed(f), "default": default, "description": f.description or ""}


def describe_request_keys(consumer: str, model: type[RequestSettings] | None) -> list[dict]:
    """Key, allowed values, default and description of each request key of a consumer."""
    keys = request_keys(consumer, model)  # empty when model is None
    return [{"key": k, **describe_field(model.model_fields[f])} for k, f in keys.items()]
