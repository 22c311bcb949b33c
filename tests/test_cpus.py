"""The ESamp side thread widens its affinity to the process's allowed CPUs, noted before
vLLM pins threads, never to every CPU of the machine (issue 26)."""

from __future__ import annotations

import os
import threading

import pytest

from tllm_core.runtime import cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def test_side_thread_widens_to_the_noted_set_only(monkeypatch):
    from algorithms.esamp import cpu as side_thread

    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a big machine; the process may use 1
    allowed = set(os.sched_getaffinity(0))
    monkeypatch.setattr(cpus, "_noted", None)
    cpus.note_allowed_cpus()
    cpus.note_allowed_cpus()  # the first note wins
    assert cpus.allowed_cpus() == allowed
    seen = []
    real = os.sched_setaffinity

    def record(pid, mask):
        seen.append(set(mask))
        real(pid, mask)

    monkeypatch.setattr(os, "sched_setaffinity", record)
    t = threading.Thread(target=side_thread._widen_affinity)
    t.start()
    t.join()
    assert seen == [allowed]  # not range(64)


def test_without_a_note_the_current_set_is_kept(monkeypatch):
    monkeypatch.setattr(cpus, "_noted", None)
    assert cpus.allowed_cpus() == set(os.sched_getaffinity(0))
