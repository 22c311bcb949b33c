"""An offline ``vllm.LLM``'s engine: stop it cleanly, abort its requests, keep finished outputs.

vLLM 0.32's ``LLM`` has no ``shutdown``/``close``: its engine processes are stopped by a
finalizer at interpreter exit, which gives them 5 s after SIGTERM and then kills them
("force killing remaining process EngineCore"). :func:`shutdown_engine` stops them while the
program still runs, with a longer grace period. See CONTRACT.md ("Engine lifecycle").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# Seconds the engine processes get to exit after SIGTERM before vLLM kills them. Measured:
# 2-10 s on a busy 2-core machine (the worker process exits after the engine core).
SHUTDOWN_TIMEOUT_S = 60.0


def shutdown_engine(llm: Any, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Stop the engine processes of ``llm`` (``llm_engine.engine_core.shutdown``); idempotent.

    In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) are shut down in place."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    try:
        core.shutdown(timeout=timeout)
    except TypeError:  # a client whose shutdown takes no timeout
        core.shutdown()


def abort_unfinished(llm: Any) -> int:
    """Abort every request the front end still tracks (after an interrupted ``generate``);
    returns how many external requests were aborted."""
    engine = llm.llm_engine
    ids = list(getattr(engine.output_processor, "external_req_ids", {}) or {})
    if ids:
        engine.abort_request(ids, internal=False)
    return len(ids)


def next_request_index(llm: Any) -> int:
    """The number vLLM gives the next request of ``llm`` (its request ids count up from 0)."""
    return int(llm.request_counter.counter)


@contextlib.contextmanager
def finished_outputs(llm: Any) -> Iterator[list[Any]]:
    """Collect the finished ``RequestOutput``s of the ``generate``/``chat`` calls made inside,
    as ``LLMEngine.step`` returns them, so that an interrupted call still has what finished."""
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
