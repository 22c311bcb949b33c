"""Compile or not: a small job starts in eager mode (no ``torch.compile``).

On the 2-core reference machine the embedded model's first start compiles for about
70 s and a later start reuses vLLM's compile cache (about 10 s more than eager), while a
compiled model generates about 1.5 times as fast (docs/getting-started.md). A job of a
few hundred tokens never earns that back, so without ``--compile`` or ``--enforce-eager``
a job of at most :data:`EAGER_MAX_TOKENS` new tokens runs eager, and the command says so.
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
