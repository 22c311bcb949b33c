"""The summary ``tllm serve`` prints when it stops, from the last ``GET /tllm/counters``
answer, read every :data:`INTERVAL_S` seconds while it runs (the engine is gone by the end;
a server with an API key answers no reads: then nothing is printed)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

from tllm_core.app.summary import Lookup, summarize

INTERVAL_S = 5.0


class LastCounters:
    """The last report read from ``{url}/tllm/counters``."""

    def __init__(self, url: str, interval_s: float = INTERVAL_S):
        self.url = f"{url}/tllm/counters"
        self.interval_s = interval_s
        self.report: dict[str, Any] | None = None
        self.read_at = 0.0
        self._stop = threading.Event()

    def read_once(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=10) as r:
                report = json.loads(r.read())
        except (OSError, ValueError):
            return False
        if isinstance(report, dict) and "consumers" in report:
            self.report, self.read_at = report, time.monotonic()
            return True
        return False

    def start(self) -> None:
        def follow() -> None:
            while not self._stop.wait(self.interval_s):
                self.read_once()

        threading.Thread(target=follow, daemon=True, name="tllm-serve-counters").start()

    def stop(self) -> None:
        self._stop.set()

    def lines(self, lookup: Lookup | None = None) -> list[str]:
        """Summary lines (no ``tllm: `` prefix), empty before any read."""
        if self.report is None:
            return []
        runtime = self.report.get("runtime", {})
        age = time.monotonic() - self.read_at
        s = summarize({**self.report, "run": {}}, lookup)
        head = (
            f"served {runtime.get('requests_finished', 0)} request(s), "
            f"{runtime.get('rows_seen', 0)} token rows (counters read {age:.0f} s before the "
            "server stopped)"
        )
        return [head, *s.text()[1:]]
