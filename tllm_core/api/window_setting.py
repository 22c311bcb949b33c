"""The per-request window setting: a consumer's ``Request`` field ``window: WindowSetting =
None`` (request key ``tllm_{consumer}_window``; apart from windows.py, which the ports import)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, PlainValidator
from pydantic_core import PydanticCustomError

from tllm_core.api.ports import Phase, as_selector
from tllm_core.api.windows import GRAMMAR, LastRow, Window

# The request-settings field name the runtime narrows a consumer's rows by.
WINDOW_FIELD = "window"
WINDOW_ERROR = "capture_window"
SETTING_ALLOWED = (
    f"a capture window (docs/ports.md#capture-windows): {GRAMMAR}; None: the consumer's config"
)


def request_window(value: Any) -> Any:
    """A request's window setting checked: ``None``, or its selector (a ``Phase`` or a
    :class:`Window`)."""
    if value is None:
        return None
    if isinstance(value, (Phase, Window, LastRow)):
        selector = value
    elif not isinstance(value, str):
        raise PydanticCustomError(WINDOW_ERROR, "must be a window text")
    else:
        try:
            selector = as_selector(value, "window")
        except ValueError:
            raise PydanticCustomError(WINDOW_ERROR, "is not a capture window") from None
    if selector is Phase.GUIDE:  # selects no bundle row: nothing would be captured
        raise PydanticCustomError(WINDOW_ERROR, "is not a capture window")
    return selector


#: Type of a consumer's per-request ``window`` field: a window text in, its selector held.
WindowSetting = Annotated[Any, PlainValidator(request_window)]


def config_window(value: Any) -> str:
    """A config's ``phase`` checked as a capture window and kept as its text (a ``Phase`` or
    :class:`Window` given from Python: its text); ``ValueError`` naming the grammar."""
    text = str(getattr(value, "value", value))
    as_selector(text, "phase")
    return text


#: Type of a capturing consumer's config field ``phase`` (export, stats, sae): a phase or a
#: capture window, kept as its text (``as_selector(config.phase, ...)`` gives its selector).
CaptureWindow = Annotated[str, BeforeValidator(config_window)]


def is_window_marker(meta: Any) -> bool:
    """Whether a field's metadata item is :data:`WindowSetting`'s check (to describe it)."""
    return isinstance(meta, PlainValidator) and meta.func is request_window
