"""Fixes for defects of supported vLLM builds, for tllm engines only (CONTRACT.md,
"Workarounds")."""

from __future__ import annotations

import functools
import logging
from typing import Any

from tllm_core.vllm_bridge.version import in_series, require_attrs

log = logging.getLogger("tllm")

SEEDED_CHUNKED_PREFILL = "seeded_chunked_prefill"
_SEEDED_ATTRS = (
    "_sample",
    "_bookkeeping_sync",
    "discard_request_mask.np",
    "input_batch.generators",
)


def runner_fixes(vllm_version: str, is_cpu: bool, generation: str = "V1") -> list[str]:
    """The runner fixes this vLLM build and runner generation need (pure: for tests)."""
    seeded = is_cpu and generation == "V1" and in_series(vllm_version, "0.32")
    return [SEEDED_CHUNKED_PREFILL] if seeded else []


def apply_to_runner(runner: Any, generation: str) -> None:
    """Apply the fixes this build needs to a runner of ``generation``."""
    import vllm
    from vllm.platforms import current_platform

    fixes = runner_fixes(vllm.__version__, current_platform.is_cpu(), generation)
    if SEEDED_CHUNKED_PREFILL in fixes:
        _fix_seeded_chunked_prefill(runner)
    if fixes:
        log.debug("tllm: vLLM runner workarounds %s (tllm_core/vllm_bridge/workarounds.py)", fixes)


def _discarded_generators(runner: Any) -> dict[int, Any]:
    """Generators of this step's rows whose sampled token vLLM will discard."""
    gens = runner.input_batch.generators
    if not gens:
        return {}
    mask = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
    return {int(i): gens[int(i)] for i in mask.nonzero()[0] if int(i) in gens}


def _fix_seeded_chunked_prefill(runner: Any) -> None:
    require_attrs(runner, _SEEDED_ATTRS, "V1 runner (for tllm's seeded chunked-prefill fix)")
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(*args, **kwargs):
        saved = [(g, g.get_state()) for g in _discarded_generators(runner).values()]
        out = sample(*args, **kwargs)
        for g, state in saved:
            g.set_state(state)
        return out

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(*args, **kwargs):
        # Already rewound in _sample: hide them from vLLM's offset rewind.
        gens = runner.input_batch.generators
        hidden = {i: gens.pop(i) for i in list(_discarded_generators(runner))}
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            gens.update(hidden)

    runner._sample = _sample
    runner._bookkeeping_sync = _bookkeeping_sync
