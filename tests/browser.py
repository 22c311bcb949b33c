"""Open a page in a real headless browser (Debian's Chromium, installed by ``install.sh
--test``): its DOM after loading, and a screenshot."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# matplotlib's first colour (C0, #1f77b4): every plot of the report draws its first series
# in it, and nothing else on the page uses it.
PLOT_BLUE = (31, 119, 180)


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        why = "chromium is not installed (bash install.sh --test installs it as root with apt-get)"
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail(why)  # install.sh --test would have installed it here: a broken set-up
        pytest.skip(why)
    return exe


def _run(args: list[str]) -> subprocess.CompletedProcess:
    # --no-sandbox: Chromium refuses to run as root with its sandbox (CI runs as root).
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    return subprocess.run(argv + args, capture_output=True, text=True, timeout=120)


def dump_dom(page: Path) -> str:
    proc = _run(["--dump-dom", page.resolve().as_uri()])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def screenshot(page: Path, out: Path, size: str = "1280,2400") -> Path:
    proc = _run([f"--window-size={size}", f"--screenshot={out}", page.resolve().as_uri()])
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]
    return out


def pixels_of(png: Path, rgb: tuple[int, int, int], tol: int = 6) -> int:
    """How many pixels of ``png`` have colour ``rgb`` (within ``tol`` per channel)."""
    import numpy as np
    from matplotlib.image import imread

    img = (imread(str(png))[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array(rgb)) <= tol).all(axis=-1).sum())
