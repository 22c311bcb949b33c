"""Independent reference: transformers' hidden states for the same token sequences."""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import torch


@lru_cache(maxsize=2)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_states(path: str, token_ids: list[int] | list[list[int]]) -> dict[str, torch.Tensor]:
    """``layer.{i}`` (residual stream after layer i), ``final`` (normed), ``attn.{i}`` and
    ``mlp.{i}`` (the blocks' outputs, from forward hooks on ``self_attn`` / ``mlp``) for
    every position; for a batch of equal-length sequences, each key holds ``[batch, seq, ...]``.

    transformers' last ``hidden_states`` entry is already normed, so the last layer's own
    output is taken with a forward hook.
    """
    model = hf_model(path)
    layers = model.model.layers
    last = {}

    def keep(name):
        return lambda _m, _i, out: last.__setitem__(name, out[0] if isinstance(out, tuple) else out)

    handles = [layers[-1].register_forward_hook(keep("h"))]
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.register_forward_hook(keep(f"attn.{i}")))
        handles.append(layer.mlp.register_forward_hook(keep(f"mlp.{i}")))
    try:
        batch = torch.tensor(token_ids if isinstance(token_ids[0], list) else [token_ids])
        out = model(batch, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    hs = out.hidden_states
    n = len(layers)
    states = {f"layer.{i}": hs[i + 1] for i in range(n - 1)}
    states[f"layer.{n - 1}"] = last["h"]
    states["final"] = hs[n]
    for i in range(n):
        states[f"attn.{i}"] = last[f"attn.{i}"]
        states[f"mlp.{i}"] = last[f"mlp.{i}"]
    if not isinstance(token_ids[0], list):
        states = {k: v[0] for k, v in states.items()}
    return states


def sequences_from_rows(rows: list[dict], sampled: list[dict]) -> dict[tuple[str, int], list[int]]:
    """Full token sequence per (request, sample): fed tokens by position, then the last sample."""
    by = defaultdict(dict)
    for r in rows:
        by[(r["request_id"], r["sample_index"])][r["position"]] = r["token_id"]
    for s in sampled:
        by[(s["request_id"], s["sample_index"])].setdefault(s["position"] + 1, s["token_id"])
    seqs = {}
    for key, pos in by.items():
        n = max(pos) + 1
        assert sorted(pos) == list(range(n)), f"{key}: positions not contiguous"
        seqs[key] = [pos[i] for i in range(n)]
    return seqs
