"""Where ESamp's guidance acts, token by token, on the pass@k problems.

    python benchmarks/esamp_tokens.py [--problems P] [-n N] [--config NAME=JSON]... [--json]

Runs each ESamp config (``diagnostics`` switched on) on problems of ``benchmarks/passk.py`` and
summarises the consumer's per-row records: for rows whose candidate set (after min-p) holds
more than one token, how often the mix changes the top candidate and how far it moves the
candidate distribution (total variation), split by the class of the model's own top token
(digit / word / other) and by the group's step index; and the distiller's relative
prediction error ``||h_L - f(h_1)|| / ||h_L||`` over a group's steps.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_setup import model_path, offline_engine_env

AGE_BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 10**9))


FIT_WINDOW = (5, 60)  # decode steps of a group over which the stage-0 fit is averaged


def fit_in_window(curve: list[list[float]], lo: int = 5, hi: int = 60) -> float | None:
    """Mean relative error ``||h_L - f(h_1)|| / ||h_L||`` over a group's decode steps
    ``lo..hi`` (inclusive), weighted by rows: from ``rel_err_curve`` rows ``[step, mean,
    rows]``. None when no row falls in the window (the stage-0 selection statistic of the
    pre-registered experiment, docs/history.md)."""
    pts = [(e, n) for a, e, n in curve if lo <= a <= hi and n]
    if not pts:
        return None
    return sum(e * n for e, n in pts) / sum(n for _, n in pts)


def token_class(text: str) -> str:
    """'digit' (a token of digits), 'word' (letters), else 'other' (spaces, punctuation)."""
    t = text.strip()
    if t and t.isdigit():
        return "digit"
    if re.search(r"[A-Za-z]", t):
        return "word"
    return "other"


def summarise(diag: dict[str, list], tokenizer) -> dict[str, Any]:
    """Per token class and per step bucket: rows, share with >1 candidate, and over those
    rows the mean TV and the share whose top candidate changed; the error curve."""
    n = len(diag["age"])
    cls = [token_class(tokenizer.decode([t])) if t >= 0 else "other" for t in diag["top_ref"]]
    age = np.asarray(diag["age"])
    multi = np.asarray(diag["candidates"]) > 1
    tv = np.asarray(diag["tv"])
    changed = np.asarray(diag["top_ref"]) != np.asarray(diag["top_new"])

    def stats(mask: np.ndarray) -> dict[str, Any]:
        m = mask & multi
        return {
            "rows": int(mask.sum()),
            "multi_candidate_share": float(m.sum() / max(mask.sum(), 1)),
            "tv_mean_multi": float(tv[m].mean()) if m.any() else None,
            "top_changed_share_multi": float(changed[m].mean()) if m.any() else None,
            "top_changed_rows": int((changed & mask).sum()),
        }

    by_class = {c: stats(np.asarray([x == c for x in cls])) for c in ("digit", "word", "other")}
    by_age = {
        f"{lo}-{hi - 1 if hi < 10**9 else 'end'}": stats((age >= lo) & (age < hi))
        for lo, hi in AGE_BUCKETS
    }
    changed_total = int(changed.sum())
    return {
        "rows": n,
        "all": stats(np.ones(n, bool)),
        "by_top_token_class": by_class,
        "by_step": by_age,
        "changed_rows_by_class": {
            c: int(sum(1 for i in range(n) if changed[i] and cls[i] == c)) for c in by_class
        },
        "changed_rows_total": changed_total,
    }


def _resumed(path: Path | None, settings: dict[str, Any], configs: dict[str, Any]):
    """The finished configs of an earlier run written to ``path`` with the same settings and
    the same config for that name."""
    if path is None or not path.exists():
        return
    old = json.loads(path.read_text())
    if any(old.get(k) != v for k, v in settings.items()):
        raise SystemExit(f"{path}: written by a run with other settings; remove it or use --out")
    for name, r in old["configs"].items():
        if configs.get(name) == r["config"]:
            yield name, r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", type=int, default=24)
    p.add_argument("--families", default="add,add_worked,mul,count,convert")
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("-n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-p", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='ESamp config to analyse (repeatable; default paper={"beta": 0.25})',
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the JSON result here after every config; configs already in the file, "
        "from a run with the same settings, are kept and not run again (a long run resumes)",
    )
    args = p.parse_args(argv)
    configs = {}
    for spec in args.config or ['paper={"beta": 0.25}']:
        name, _, raw = spec.partition("=")
        try:
            configs[name] = {**json.loads(raw), "diagnostics": True}
        except ValueError as e:
            p.error(f"--config {spec!r}: bad JSON ({e})")

    offline_engine_env(2)
    import passk
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    model = model_path(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    fams = tuple(f for f in args.families.split(",") if f)
    problems = passk.make_problems(args.problems, args.task_seed, fams)
    convs = [[{"role": "user", "content": q["prompt"]}] for q in problems]
    settings = {
        "problems": len(problems),
        "families": list(fams),
        "task_seed": args.task_seed,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "min_p": args.min_p,
        "seed": args.seed,
    }
    out: dict[str, Any] = dict(_resumed(args.out, settings, configs))

    def result() -> dict[str, Any]:
        return {
            "command": "python "
            + shlex.join(["benchmarks/esamp_tokens.py", *(argv or sys.argv[1:])]),
            **settings,
            "configs": out,
        }

    for name, cfg in configs.items():
        if name in out:
            print(f"[esamp_tokens] {name}: kept from {args.out}", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        llm = TllmLLM(
            model,
            ["esamp:" + json.dumps(cfg)],
            dtype="float32",
            max_model_len=512,
            enforce_eager=args.enforce_eager,
            seed=0,
            max_num_batched_tokens=8192,
        )
        params = [
            SamplingParams(
                n=args.n, max_tokens=args.max_tokens, min_p=args.min_p, seed=args.seed + i
            )
            for i in range(len(convs))
        ]
        outs = []
        for s in range(0, len(convs), 8):
            outs += llm.chat(convs[s : s + 8], params[s : s + 8], use_tqdm=False)
        rep = llm.close()
        res = rep["results"]["esamp"]
        diag = res["diagnostics"]
        correct = [
            sum(passk.check(q, c.text) for c in o.outputs)
            for q, o in zip(problems, outs, strict=True)
        ]
        out[name] = {
            "config": cfg,
            "summary": summarise(diag, tok),
            "rel_err_curve": diag["rel_err_curve"],
            "fit_5_60": fit_in_window(diag["rel_err_curve"], *FIT_WINDOW),
            "loss_curve": res["loss_curve"],
            "pass_at_1": float(np.mean(correct) / args.n),
            "counters": res["counters"],
            "seconds": time.perf_counter() - t0,
        }
        print(f"[esamp_tokens] {name} done in {out[name]['seconds']:.0f}s", file=sys.stderr)
        if args.out is not None:
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result()))
            tmp.replace(args.out)
        core = getattr(getattr(llm.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm
    if args.json:
        print(json.dumps(result()))
    else:
        for name, r in out.items():
            s = r["summary"]
            print(
                f"== {name}: pass@1 {r['pass_at_1']:.3f}, rows {s['rows']}, fit 5-60 {r['fit_5_60']}"
            )
            for c, v in s["by_top_token_class"].items():
                print(f"  {c:<6} {v}")
            for a, v in s["by_step"].items():
                print(f"  step {a:<6} {v}")
            print("  rel err by step:", [(a, round(e, 3)) for a, e, _ in r["rel_err_curve"][:12]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
