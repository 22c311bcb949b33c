"""An offline ``vllm.LLM``'s engine: stop it cleanly (``LLM`` has no ``close``; its finalizer
kills engines slower than 5 s), abort its requests, keep finished outputs (CONTRACT.md)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from tllm_core.vllm_bridge.engine_watch import engine_processes

# Seconds after SIGTERM before vLLM kills the engine processes (measured: 2-20 s when busy).
SHUTDOWN_TIMEOUT_S = 60.0
WAKE_INTERVAL_S = 0.5  # between two wake-up messages to an engine core still running
WAKE_REQUEST_ID = "tllm-shutdown-wakeup"  # no request has it: aborting it changes nothing


def shutdown_engine(llm: Any, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Stop the engine processes of ``llm`` (in-process engines in place); idempotent. vLLM's
    ``Process.join`` of an engine core also wakes it every :data:`WAKE_INTERVAL_S` meanwhile
    (a SIGTERM arriving as it waits for input stays pending until a message comes)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    procs = engine_processes(core)

    def waking_join(proc: Any, join: Callable[[float | None], None]) -> Callable[..., None]:
        def joining(timeout: float | None = None) -> None:
            deadline = time.monotonic() + (math.inf if timeout is None else timeout)
            while True:
                join(max(0.0, min(WAKE_INTERVAL_S, deadline - time.monotonic())))
                if not proc.is_alive() or time.monotonic() >= deadline:
                    return
                with contextlib.suppress(Exception):  # engine gone or client closed
                    core.abort_requests([WAKE_REQUEST_ID])

        return joining

    for p in procs:
        p.join = waking_join(p, p.join)
    try:
        try:
            core.shutdown(timeout=timeout)
        except TypeError:  # a client whose shutdown takes no timeout
            core.shutdown()
    finally:
        for p in procs:
            vars(p).pop("join", None)


def unfinished_ids(llm: Any) -> list[str]:
    """The external (caller's) ids of the requests the front end still tracks."""
    return list(getattr(llm.llm_engine.output_processor, "external_req_ids", {}) or {})


def texts_so_far(llm: Any) -> dict[str, dict[int, tuple[str, bool]]]:
    """Every sample of ``llm``'s unfinished requests: the caller's request id -> sample index
    -> (its text so far, as vLLM would stream it, or whole when the sample finished; whether
    it finished). Read before an abort, which drops them."""
    proc = llm.llm_engine.output_processor
    texts: dict[str, dict[int, tuple[str, bool]]] = {}
    # A finished sample of n > 1 waits in its request's aggregator until all have finished.
    for parent in list(getattr(proc, "parent_requests", {}).values()):
        for out in parent.output_aggregator:  # offline (FINAL_ONLY): the finished, else None
            if out is not None:
                texts.setdefault(str(parent.external_req_id), {})[out.index] = (out.text, True)
    for state in list(proc.request_states.values()):
        parent = state.parent_req  # a sample of n > 1: its request's id is the parent's
        rid = state.external_req_id if parent is None else parent.external_req_id
        det = state.detokenizer  # None without a tokenizer: no text
        text = "" if det is None else det.get_next_output_text(finished=False, delta=False)
        texts.setdefault(str(rid), {})[int(state.request_index)] = (text, False)
    return texts


def abort_unfinished(llm: Any, ids: list[str] | None = None) -> int:
    """Abort the external requests ``ids`` (None: every one still tracked); how many."""
    ids = unfinished_ids(llm) if ids is None else ids
    if ids:
        llm.llm_engine.abort_request(ids, internal=False)
    return len(ids)


def next_request_index(llm: Any) -> int:
    """The number vLLM gives the next request of ``llm`` (its request ids count up from 0)."""
    return int(llm.request_counter.counter)


@contextlib.contextmanager
def finished_outputs(llm: Any) -> Iterator[list[Any]]:
    """The finished ``RequestOutput``s of the calls inside (an interrupted call keeps them)."""
    engine = llm.llm_engine
    step = engine.step
    done: list[Any] = []

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        outs = step(*args, **kwargs)
        done.extend(o for o in outs if getattr(o, "finished", False))
        return outs

    engine.step = recording_step
    try:
        yield done
    finally:
        del engine.step
