"""Worker extension (``LLM(worker_extension_cls=...)``): RPC methods to read results back."""

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
            "consumers": [s.consumer.name for s in rt.slots],
            "capture_layers": sorted(rt.capture_layers),
            "edit_layers": sorted(rt.edit_layers),
            "guides": rt.guides,
        }

    def tllm_end_batch(self) -> None:
        hooks = self._tllm_hooks()
        if hooks is not None:
            hooks.finish_all()

    def tllm_collect(self) -> dict[str, Any] | None:
        hooks = self._tllm_hooks()
        return None if hooks is None else hooks.runtime.collect()

    def tllm_close(self) -> dict[str, Any] | None:
        hooks = self._tllm_hooks()
        return None if hooks is None else hooks.runtime.close()
