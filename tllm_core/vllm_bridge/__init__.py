"""The only package of tllm that touches vLLM internals. Contract: CONTRACT.md here."""

from tllm_core.vllm_bridge.version import UnsupportedEngineError, check_version

WORKER_EXTENSION = "tllm_core.vllm_bridge.worker_ext.TllmWorkerExtension"

__all__ = ["WORKER_EXTENSION", "UnsupportedEngineError", "check_version"]
