"""Compile or not: without ``--compile`` or ``--enforce-eager`` a job of at most
:data:`EAGER_MAX_TOKENS` new tokens starts in eager mode (compiling costs more start time
than such a job gains; docs/getting-started.md), and the command says so.
"""

from __future__ import annotations

import argparse

# prompts x n x max_tokens at or below which the command runs eager unless told otherwise.
EAGER_MAX_TOKENS = 2048


def choose_eager(args: argparse.Namespace, new_tokens: int) -> str | None:
    """Set ``args.enforce_eager`` for a small job when neither ``--compile`` nor
    ``--enforce-eager`` was given; returns why, for the start line (None: nothing chosen)."""
    if getattr(args, "compile", False) or getattr(args, "enforce_eager", False):
        return None
    if new_tokens > EAGER_MAX_TOKENS:
        return None
    args.enforce_eager = True
    return f"a small job of {new_tokens} new tokens at most, --compile to compile"
