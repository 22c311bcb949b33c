"""Worker extension (``LLM(worker_extension_cls=...)``): tllm's RPC methods. A server needs no
``--worker-extension-cls``: :func:`ensure_worker_methods` mixes it in as vLLM would."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

from tllm_core.vllm_bridge.engine_settings import tllm_settings
from tllm_core.vllm_bridge.errors import EngineCallFailed
from tllm_core.vllm_bridge.nodes import NODE_CHECK_TIMEOUT_S, NodeWatch, join_leader, node_check

logger = logging.getLogger("vllm.tllm")  # through vLLM's handler in the worker's log

# A rank's error, answered as a value: vLLM's collective_rpc raises at the first rank's error
# and leaves the other ranks' answers queued, to be read as the next call's.
FAILED_KEY = "tllm_call_failed"


def _with_hooks(default: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the method with the runner's hooks; answer (a copy of) ``default`` without them,
    and ``{FAILED_KEY: error}`` where it raised (:func:`checked` raises it on the caller's side)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def rpc(self: Any, *args: Any, **kwargs: Any) -> Any:
            hooks = getattr(getattr(self, "model_runner", None), "_tllm_hooks", None)
            if hooks is None:
                return copy.copy(default)
            try:
                return method(self, hooks, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - answered, so that every rank answers
                logger.exception("tllm: %s failed in this worker", method.__name__)
                return {FAILED_KEY: f"{method.__name__}: {type(e).__name__}: {e}"}

        return rpc

    return wrap


def checked(answers: list[Any]) -> list[Any]:
    """Every rank's answer to a tllm call, or :class:`EngineCallFailed` with the first error."""
    for a in answers:
        if isinstance(a, dict) and FAILED_KEY in a:
            raise EngineCallFailed(f"a worker failed: {a[FAILED_KEY]}")
    return answers


class TllmWorkerExtension:
    @_with_hooks({"installed": False})
    def tllm_status(self, hooks: Any) -> dict[str, Any]:
        rt = hooks.runtime
        return {
            "installed": True,
            "runner": hooks.adapter.describe(),
            "rank": hooks.rank.as_dict(),
            "consumers": [e.name for e in rt.settings.consumers],
            "taps": sorted(t.key for t in rt.taps),
            "edit_taps": sorted(t.key for t in rt.edit_taps),
            "capture_layers": sorted(t.layer for t in rt.taps if t.site == "residual"),
            "edit_layers": sorted({t.layer for t in rt.edit_taps}),
            "guides": rt.guides,
            "requests_open": len(hooks.requests),
        }

    @_with_hooks()
    def tllm_mark_aborted(self, hooks: Any, request_ids: list[str]) -> None:
        hooks.mark_aborted(request_ids)

    @_with_hooks({})
    def tllm_failed_requests(
        self, hooks: Any, engine_ids: list[str] | None = None
    ) -> dict[str, list[str]]:
        """The consumers that failed while acting on each of ``engine_ids`` (vLLM's id of a
        request as its front end knows it, before the ``n`` fan-out; None: all kept)."""
        return hooks.runtime.bus.failures_of(engine_ids)

    @_with_hooks()
    def tllm_mark_cut_short(self, hooks: Any, engine_ids: list[str]) -> None:
        hooks.mark_cut_short(engine_ids)

    @_with_hooks()
    def tllm_discard_results(
        self, hooks: Any, request_ids: list[str], engine_ids: list[str] = ()
    ) -> None:
        """Drop these caller ids' results, made and to come (no wait: a refused request must
        not hold the engine); ``engine_ids``: the discarded requests' own, none a retry when
        the engine first sees it. Not marked cut short: another client may share the id."""
        ids = sorted({str(i) for i in request_ids})
        hooks.runtime.results.discard(ids, [str(e) for e in engine_ids])

    @_with_hooks([])
    def tllm_end_batch(self, hooks: Any) -> list[dict[str, Any]]:
        """Finish the batch's requests; the consumer errors so far."""
        hooks.finish_all()
        return list(hooks.runtime.bus.errors)

    @_with_hooks()
    def tllm_collect(self, hooks: Any) -> dict[str, Any] | None:
        return {**hooks.runtime.collect(), "rank": hooks.rank.as_dict()}

    @_with_hooks({})
    def tllm_take_results(
        self, hooks: Any, request_ids: list[str], wait_s: float = 0.0
    ) -> dict[str, dict[str, dict[str, Any]]]:
        """The per-request results made so far for these caller ids, taken from the engine
        (caller id -> sample index as text -> consumer -> result)."""
        got = hooks.runtime.take_results([str(i) for i in request_ids], float(wait_s))
        return {rid: {str(k): v for k, v in per.items()} for rid, per in got.items()}

    @_with_hooks({"error": "tllm is not installed in this engine", "status": 503})
    def tllm_control(
        self, hooks: Any, name: str, action: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        """A control request for consumer ``name`` (``Runtime.control``)."""
        return hooks.runtime.control(name, action, payload)

    @_with_hooks()
    def tllm_close(self, hooks: Any) -> dict[str, Any] | None:
        return {**hooks.close(), "rank": hooks.rank.as_dict()}

    def tllm_node_check(self, timeout_s: float = NODE_CHECK_TIMEOUT_S) -> int:
        """A barrier over every rank of a multi-node engine (``nodes.NodeWatch.watch_nodes``)."""
        return node_check(float(timeout_s))

    def tllm_join_leader(self, settings: dict | None, endpoint: Any) -> dict[str, Any]:
        """The leader's settings and address, sent by its API server (``nodes.join_leader``)."""
        hooks = getattr(getattr(self, "model_runner", None), "_tllm_hooks", None)
        rank = getattr(hooks, "rank", None)
        parallel = getattr(self.vllm_config, "parallel_config", None)
        if getattr(self, "_tllm_node_watch", None) is None:
            self._tllm_node_watch = NodeWatch()  # this worker's one leader watch
        return join_leader(
            tllm_settings(getattr(self.vllm_config, "additional_config", None)),
            settings,
            rank.dp_rank if rank is not None else -1,
            endpoint,
            rank is not None and rank.leader,
            watcher=self._tllm_node_watch,
            fallback_host=getattr(parallel, "data_parallel_master_ip", None),
        )


def ensure_worker_methods(worker_cls: type) -> None:
    """Give the worker class the ``tllm_*`` RPC methods (idempotent)."""
    if hasattr(worker_cls, "tllm_collect"):  # this extension, or vLLM mixed it in already
        return
    worker_cls.__bases__ = worker_cls.__bases__ + (TllmWorkerExtension,)
