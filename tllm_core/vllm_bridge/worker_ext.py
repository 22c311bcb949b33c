"""Worker extension (``LLM(worker_extension_cls=...)``): tllm's RPC methods. A server needs no
``--worker-extension-cls``: :func:`ensure_worker_methods` mixes it in as vLLM would."""

from __future__ import annotations

from typing import Any


class TllmWorkerExtension:
    def _tllm_hooks(self):
        runner = getattr(self, "model_runner", None)
        return getattr(runner, "_tllm_hooks", None)

    def tllm_status(self) -> dict[str, Any]:
        hooks = self._tllm_hooks()
        if hooks is None:
            return {"installed": False}
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

    def tllm_mark_aborted(self, request_ids: list[str]) -> None:
        hooks = self._tllm_hooks()
        if hooks is not None:
            hooks.mark_aborted(request_ids)

    def tllm_failed_requests(self, request_ids: list[str] | None = None) -> dict[str, list[str]]:
        """The consumers that failed while acting on each of ``request_ids`` (None: all)."""
        hooks = self._tllm_hooks()
        return {} if hooks is None else hooks.runtime.bus.failures_of(request_ids)

    def tllm_mark_cut_short(self, engine_ids: list[str]) -> None:
        hooks = self._tllm_hooks()
        if hooks is not None:
            hooks.mark_cut_short(engine_ids)

    def tllm_end_batch(self) -> list[dict[str, Any]]:
        """Finish the batch's requests; the consumer errors so far."""
        hooks = self._tllm_hooks()
        if hooks is None:
            return []
        hooks.finish_all()
        return list(hooks.runtime.bus.errors)

    def tllm_collect(self) -> dict[str, Any] | None:
        hooks = self._tllm_hooks()
        return None if hooks is None else {**hooks.runtime.collect(), "rank": hooks.rank.as_dict()}

    def tllm_take_results(
        self, request_ids: list[str], wait_s: float = 0.0
    ) -> dict[str, dict[str, dict[str, Any]]]:
        """The per-request results made so far for these caller ids, taken from the engine
        (caller id -> sample index as text -> consumer -> result)."""
        hooks = self._tllm_hooks()
        if hooks is None:
            return {}
        got = hooks.runtime.take_results([str(i) for i in request_ids], float(wait_s))
        return {rid: {str(k): v for k, v in per.items()} for rid, per in got.items()}

    def tllm_control(self, name: str, action: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A control request for consumer ``name`` (``Runtime.control``)."""
        hooks = self._tllm_hooks()
        if hooks is None:
            return {"error": "tllm is not installed in this engine", "status": 503}
        return hooks.runtime.control(name, action, payload)

    def tllm_node_check(self) -> int:
        """A barrier over every rank of a multi-node engine (``nodes.NodeWatch.watch_nodes``)."""
        from tllm_core.vllm_bridge.nodes import node_check

        return node_check()

    def tllm_join_leader(self, settings: dict | None, endpoint: Any) -> dict[str, Any]:
        """The leader's settings and address, sent by its API server (``dp_nodes``)."""
        from tllm_core.vllm_bridge.dp_nodes import join_leader
        from tllm_core.vllm_bridge.engine_settings import tllm_settings

        hooks = self._tllm_hooks()
        rank = hooks.rank if hooks is not None else None
        mine = tllm_settings(getattr(self.vllm_config, "additional_config", None))
        dp_rank = rank.dp_rank if rank is not None else -1
        watch = rank is not None and rank.leader
        parallel = getattr(self.vllm_config, "parallel_config", None)
        address = getattr(parallel, "data_parallel_master_ip", None)
        return join_leader(
            mine,
            settings,
            dp_rank,
            endpoint,
            watch,
            watcher=self._tllm_nodes(),
            fallback_host=address,
        )

    def _tllm_nodes(self) -> Any:
        """This worker's :class:`~tllm_core.vllm_bridge.nodes.NodeWatch`, made on first use."""
        watcher = getattr(self, "_tllm_node_watch", None)
        if watcher is None:
            from tllm_core.vllm_bridge.nodes import NodeWatch

            watcher = self._tllm_node_watch = NodeWatch()
        return watcher

    def tllm_close(self) -> dict[str, Any] | None:
        hooks = self._tllm_hooks()
        return None if hooks is None else {**hooks.close(), "rank": hooks.rank.as_dict()}


def ensure_worker_methods(worker_cls: type) -> None:
    """Give the worker class the ``tllm_*`` RPC methods (idempotent)."""
    if hasattr(worker_cls, "tllm_collect") or TllmWorkerExtension in worker_cls.__mro__:
        return
    worker_cls.__bases__ = worker_cls.__bases__ + (TllmWorkerExtension,)
