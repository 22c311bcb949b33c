"""What the ``tllm`` command shows on stderr while it runs: status lines and the progress bar."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from tqdm import tqdm


def say(message: str) -> None:
    """One ``tllm:`` status line on stderr."""
    print(f"tllm: {message}", file=sys.stderr, flush=True)


class _Bar(tqdm):
    """A tqdm bar whose postfix is vLLM's (token rates) plus the command's own status."""

    extra: Callable[[], str] | None = None

    @property
    def postfix(self) -> str | None:  # type: ignore[override]
        base = self.__dict__.get("_vllm_postfix")
        more = self.extra() if self.extra is not None else ""
        return ", ".join(p for p in (base, more) if p) or None

    @postfix.setter
    def postfix(self, value: Any) -> None:
        self.__dict__["_vllm_postfix"] = value


class RunProgress:
    """A ``use_tqdm`` factory for ``vllm.LLM.generate``/``chat``."""

    def __init__(self, extra: Callable[[], str] | None = None):
        self.extra = extra
        self.bar: _Bar | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> tqdm:
        if args:  # an iterable to wrap: vLLM's chat rendering
            return tqdm(args[0], disable=True)
        kwargs.update(desc="generating", unit="seq", file=sys.stderr)
        bar = _Bar(**kwargs)
        bar.extra = self.extra
        self.bar = bar
        if self.extra is not None and self._thread is None:
            self._thread = threading.Thread(target=self._refresh, daemon=True)
            self._thread.start()
        return bar

    def _refresh(self) -> None:
        while not self._stop.wait(1.0):
            bar = self.bar
            if bar is not None:
                bar.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.bar is not None:
            self.bar.close()
