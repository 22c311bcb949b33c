"""Prompt files: one prompt per line, blank lines skipped."""

from __future__ import annotations

from pathlib import Path


def read_prompt_file(path: Path, what: str = "prompt file") -> list[str]:
    """The prompts in ``path``; ``ValueError`` naming the file if it is missing or empty."""
    if not path.is_file():
        raise ValueError(f"{what} not found: {path}")
    prompts = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if not prompts:
        raise ValueError(f"{what} {path} holds no prompt")
    return prompts
