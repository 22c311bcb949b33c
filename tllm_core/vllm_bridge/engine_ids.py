"""vLLM's internal request ids (CONTRACT.md, "Request ids"): ``"{external id}-{8 chars}"``;
``n > 1`` fans a request out into children ``"{index}_{parent id}"``."""

from __future__ import annotations

import re
from typing import Any

from tllm_core.api.request_settings import SAMPLES_KEY

_SUFFIX = re.compile(r"^(?P<base>.*)-[0-9A-Za-z]{8}$")
CHILD = re.compile(r"^(?P<index>\d+)_(?P<rest>.+)$")


def parse_engine_id(engine_id: str, extra_args: dict[str, Any]) -> tuple[str, int, str]:
    """(caller's request id, sample index, the engine id of the request it is a sample of:
    itself unless a child) from vLLM's internal request id."""
    parent, sample = engine_id, 0
    n_hint = extra_args.get(SAMPLES_KEY)
    m = CHILD.match(engine_id)
    if m and (n_hint is None or int(n_hint) > 1):
        sample, parent = int(m.group("index")), m.group("rest")
    m = _SUFFIX.match(parent)
    return (m.group("base") if m else parent), sample, parent
