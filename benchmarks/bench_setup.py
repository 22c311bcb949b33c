"""Set-up shared by the offline benchmark scripts (diversity, passk, esamp_tokens): the
process environment of an in-process engine, the model folder, and the run's tail record."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def offline_engine_env(kv_cache_gib: int) -> None:
    """Environment for one vLLM engine inside this process, quiet and offline; makes the
    checkout and this folder importable."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for p in (str(ROOT), str(Path(__file__).resolve().parent)):
        if p not in sys.path:
            sys.path.insert(0, p)


def model_path(model: str | None) -> str:
    """The model folder asked for, or the embedded SmolLM2."""
    if model is not None:
        return model
    from tllm_core.app.default_model import default_model_path

    return str(default_model_path())


def run_machine(load_start: float) -> dict[str, Any]:
    """The machine record of a run: hardware plus the 1-minute load at its start and end."""
    from throughput import machine_info  # same folder

    return {**machine_info(), "loadavg_1m_start": load_start, "loadavg_1m_end": os.getloadavg()[0]}


def write_samples(path: Path, gen: dict[str, Any]) -> None:
    """The generated texts of every method, per prompt: ``{method: [[text, ...], ...]}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {n: [[c["text"] for c in comp] for comp in g["samples"]] for n, g in gen.items()}
        )
    )
