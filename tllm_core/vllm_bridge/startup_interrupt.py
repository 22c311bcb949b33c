"""Ctrl-C while a tllm front end waits for its engine to start.

vLLM 0.32's ``zmq_socket_ctx`` (``vllm.utils.network_utils``) swallows ``KeyboardInterrupt``
(it logs "Got Keyboard Interrupt." and carries on). ``launch_core_engines`` holds the
engine handshake socket in that context while it waits for the engine to load the model,
so a Ctrl-C in those seconds is lost: the handshake is skipped, the front end then waits for
a ready message the engine never sends (``VLLM_ENGINE_READY_TIMEOUT_S``, 600 s by default)
and the engine waits for the handshake. :func:`interrupts_reach_caller` wraps the context
that ``vllm.v1.engine.utils`` uses, while a tllm front end constructs ``vllm.LLM``: the
original still closes its socket, then the interrupt goes on, so ``MPClient`` shuts its
engine down and ``LLM()`` raises ``KeyboardInterrupt``. Plain vLLM is never changed; the
module attribute is restored when the construction ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_WRAPPED = "_tllm_keeps_interrupts"


def keeping_interrupts(original: Any) -> Any:
    """``original`` (a context-manager factory that swallows ``KeyboardInterrupt``), made to
    pass the interrupt on after its own cleanup."""

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
    """While the block runs (the construction of ``vllm.LLM``, main thread only), a Ctrl-C
    during the engine handshake raises ``KeyboardInterrupt`` out of it."""
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
