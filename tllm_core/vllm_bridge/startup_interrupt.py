"""Ctrl-C while a front end waits for its engine to start: vLLM's ``zmq_socket_ctx`` swallows
``KeyboardInterrupt`` in the handshake (then waits up to 600 s); this passes it on."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_WRAPPED = "_tllm_keeps_interrupts"


def keeping_interrupts(original: Any) -> Any:
    """``original`` (a context manager that swallows ``KeyboardInterrupt``), passing it on."""

    @contextlib.contextmanager
    def wrapped(*args: Any, **kwargs: Any) -> Iterator[Any]:
        interrupted = False
        with original(*args, **kwargs) as value:
            try:
                yield value
            except KeyboardInterrupt:
                interrupted = True  # let the original close its socket without it
        if interrupted:
            raise KeyboardInterrupt

    setattr(wrapped, _WRAPPED, True)
    return wrapped


@contextlib.contextmanager
def interrupts_reach_caller() -> Iterator[None]:
    """While the block runs (main thread only), a Ctrl-C during the engine handshake raises."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    import vllm.v1.engine.utils as engine_utils

    original = getattr(engine_utils, "zmq_socket_ctx", None)
    if original is None or getattr(original, _WRAPPED, False):
        yield  # another vLLM layout, or already wrapped by an enclosing block
        return
    engine_utils.zmq_socket_ctx = keeping_interrupts(original)
    try:
        yield
    finally:
        engine_utils.zmq_socket_ctx = original
