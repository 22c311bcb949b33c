"""The opt-in CUDA precisions of ESamp's distiller (bf16 Adam moments, TF32 products) against
fp32, on the embedded model's real hidden states (CPU, transformers; no vLLM, no GPU):

    python benchmarks/esamp_precision.py [--prompts 8] [--n 16] [--tokens 48] [--json]

The embedded SmolLM2-135M-Instruct samples ``n`` continuations of each prompt
(``benchmarks/prompts.txt``; min-p 0.1, temperature 1); its hidden states after layer 0
and the final ones (what ESamp's distiller maps) are read back at every generated position.
Decode step ``t`` then gives each prompt's group its ``n`` rows at position ``t``, and the
CUDA distiller (``CudaGroupedDistiller``, run on CPU with stream and graph stand-ins) trains
one Adam step per group per step, as ESamp does, from the same initial weights, with:

- ``fp32``: the default;
- ``bf16_moments``: ``cuda_adam_moments: "bfloat16"`` (the moments stored in bf16; the same
  code as on CUDA);
- ``tf32``: ``cuda_tf32``, emulated: the inputs of every distiller product rounded to TF32's
  10-bit mantissa (round to nearest even), fp32 accumulation, as tensor cores do;
- ``bf16_moments+tf32``.

Reported: each variant's loss curve (the mean over groups of each step's loss) and its
relative difference from fp32's, step by step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import algorithms.esamp.cuda as cuda_mod  # noqa: E402
import algorithms.esamp.slot_ops as slot_ops  # noqa: E402


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32 (10 mantissa bits, round to nearest even)."""
    i = x.float().contiguous().view(torch.int32)
    lsb = (i >> 13) & 1
    return ((i + 0x0FFF + lsb) & ~0x1FFF).view(torch.float32)


def states(prompts: int, n: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, target)`` ``[tokens, prompts * n, H]``: layer 0's and the final hidden states of
    each generated token of each sample (rows of a prompt's samples side by side)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tllm_core.app.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = [t for t in (ROOT / "benchmarks" / "prompts.txt").read_text().splitlines() if t][
        :prompts
    ]
    torch.manual_seed(seed)
    xs, ts = [], []
    with torch.no_grad():
        for text in texts:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
            )
            ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
            out = model.generate(
                ids, do_sample=True, min_p=0.1, temperature=1.0, max_new_tokens=tokens,
                min_new_tokens=tokens, num_return_sequences=n, pad_token_id=tok.eos_token_id,
            )  # fmt: skip
            hs = model(out, output_hidden_states=True).hidden_states
            gen = slice(ids.shape[1] - 1, ids.shape[1] - 1 + tokens)  # states that predict them
            xs.append(hs[1][:, gen])
            ts.append(hs[-1][:, gen])
    x = torch.cat(xs).transpose(0, 1).contiguous()  # [tokens, prompts * n, H]
    t = torch.cat(ts).transpose(0, 1).contiguous()
    return x, t


def _tf32_ops(monkeypatch) -> None:
    mm, adam = slot_ops.kernels.slot_matmul, slot_ops.kernels.grad_adam

    def slot_matmul(x, w, gs, out, **kw):
        return mm(tf32_round(x), tf32_round(w), gs, out, **kw)

    def grad_adam(a, b, *args, **kw):
        return adam(tf32_round(a), tf32_round(b), *args, **kw)

    monkeypatch.setattr(slot_ops.kernels, "slot_matmul", slot_matmul)
    monkeypatch.setattr(slot_ops.kernels, "grad_adam", grad_adam)


def curve(x: torch.Tensor, t: torch.Tensor, prompts: int, n: int, variant: str) -> list[float]:
    from _pytest.monkeypatch import MonkeyPatch

    from algorithms.esamp.config import ESampConfig
    from tllm_core.testing.fake_cuda import FakeCuda

    cfg = ESampConfig()
    mp = MonkeyPatch()
    with FakeCuda(device="cpu"):  # CUDA streams, events and graphs, computing on CPU
        try:
            if "tf32" in variant:
                _tf32_ops(mp)
                mp.setattr(
                    torch, "bmm", lambda a, b, **kw: torch.matmul(tf32_round(a), tf32_round(b))
                )
            d = cuda_mod.CudaGroupedDistiller(
                x.shape[-1], device="cpu", capacity=prompts, graph_max_rows=n,
                intermediate_size=cfg.intermediate_size, num_blocks=cfg.num_blocks, lr=cfg.lr,
                eps=cfg.eps, grad_clip=cfg.grad_clip, loss_reduction=cfg.loss_reduction,
                init=cfg.init, seed=cfg.seed,
                moments_dtype=torch.bfloat16 if "bf16" in variant else torch.float32,
            )  # fmt: skip
            slots = torch.tensor([d.alloc() for _ in range(prompts)]).repeat_interleave(n)
            results = [d.train_step(slots, x[i], t[i]) for i in range(x.shape[0])]
            d.synchronize()
        finally:
            mp.undo()
    return [float(r.losses.mean()) for r in results]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    x, t = states(args.prompts, args.n, args.tokens)
    variants = ("fp32", "bf16_moments", "tf32", "bf16_moments+tf32")
    curves = {v: curve(x, t, args.prompts, args.n, v) for v in variants}
    base = torch.tensor(curves["fp32"])
    out: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (embedded)",
        "prompts": args.prompts,
        "n": args.n,
        "steps": args.tokens,
        "curves": curves,
        "max_rel_diff": {
            v: float(((torch.tensor(c) - base).abs() / base).max()) for v, c in curves.items()
        },
        "last_rel_diff": {
            v: (c[-1] - curves["fp32"][-1]) / curves["fp32"][-1] for v, c in curves.items()
        },
    }
    if args.json:
        print(json.dumps(out))
        return 0
    marks = [i for i in (0, 1, 3, 7, 15, 31, args.tokens - 1) if i < args.tokens]
    print("| variant | " + " | ".join(f"step {i + 1}" for i in marks) + " | max rel. diff |")
    print("|---|" + "---:|" * (len(marks) + 1))
    for v, c in curves.items():
        print(
            f"| {v} | "
            + " | ".join(f"{c[i]:.4f}" for i in marks)
            + f" | {out['max_rel_diff'][v]:.2e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
