"""pass@k of ESamp against vanilla sampling on verifiable tasks, with its controls and ablations.

    python benchmarks/passk.py [--problems P] [-n 16] [--max-tokens T] [--beta B]... [--json]

Problems are generated from ``--task-seed`` (no data set), round-robin over ``--families``;
the checker compares the completion's answer (:func:`extract_answer`: the last integer, after
"Answer:" when the completion says so) with the problem's:

    add, mul       two-digit addition, one-digit times one/two-digit multiplication, answer only
    add_worked     two-digit addition with a short worked solution, "Answer: N" at the end
    count          how many items a short comma-separated list holds
    convert        unit conversions (hours -> minutes, meters -> centimeters, ...)
    word           one-step word problems (gains and losses of apples, coins, ...)
    multi_worked   three-step word problems with a worked solution in full sentences,
                   "Answer: N" at the end (long answers: the distiller trains before the answer)

Methods and engine loop: ``benchmarks/diversity.py``'s (vanilla; ESamp per beta; ``temp_*``;
the noise and frozen ablations, ``--controls`` choosing the default recipe's; each
``--esamp-variant`` with its own frozen ablation). pass@k per problem is the unbiased estimator
of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)``; a method's pass@k is its mean over
problems; methods are compared problem by problem (paired t-test and sign test).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import diversity as dv  # one method table and engine loop for both benchmarks
import numpy as np
from bench_setup import command_line, model_path, offline_engine_env, section, table

# Calibrated on the embedded model (vanilla, T=1, min-p 0.1, n=8, 48 tokens, 6 problems each):
# pass@1 add 0.15, add_worked 0.10, mul 0.31, count 0.12, convert 0.08, word 0.02 (left out).
DEFAULT_FAMILIES = ("add", "add_worked", "mul", "count", "convert")
DIRECT = " Reply with just the number."
WORKED = " Work it out in one or two short steps, then end with 'Answer: <number>'."
WORKED_LONG = " Explain each step in a full sentence, then end with 'Answer: <number>'."


# ----------------------------------------------------------------------------- tasks
def _add(rng: random.Random, ask: str = DIRECT) -> tuple[str, int]:
    a, b = rng.randint(10, 89), rng.randint(10, 89)
    return f"What is {a} + {b}?" + ask, a + b


def _mul(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    return f"What is {a} times {b}?" + DIRECT, a * b


_ITEMS = ("apple", "pear", "cat", "dog", "car", "book", "cup", "hat", "pen", "star", "tree")


def _count(rng: random.Random) -> tuple[str, int]:
    k = rng.randint(3, 7)
    items = [rng.choice(_ITEMS) for _ in range(k)]
    return f"How many words are in this list: {', '.join(items)}?" + DIRECT, k


_UNITS = (  # (from, to, factor, lo, hi)
    ("hours", "minutes", 60, 2, 9),
    ("minutes", "seconds", 60, 2, 9),
    ("meters", "centimeters", 100, 2, 19),
    ("kilograms", "grams", 1000, 2, 9),
    ("days", "hours", 24, 2, 6),
    ("weeks", "days", 7, 2, 12),
    ("dozens", "items", 12, 2, 9),
)


def _convert(rng: random.Random) -> tuple[str, int]:
    src, dst, f, lo, hi = rng.choice(_UNITS)
    x = rng.randint(lo, hi)
    return f"How many {dst} are in {x} {src}?" + DIRECT, x * f


_NAMES = ("Tom", "Anna", "Lee", "Maria", "Sam", "Ravi", "Emma", "Omar")
_THINGS = ("apples", "coins", "marbles", "stickers", "books", "pencils")


def _word(rng: random.Random) -> tuple[str, int]:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a = rng.randint(5, 30)
    if rng.random() < 0.5:
        b = rng.randint(2, 20)
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        return q + DIRECT, a + b
    b = rng.randint(1, a - 1)
    q = f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have left?"
    return q + DIRECT, a - b


def _multi_worked(rng: random.Random) -> tuple[str, int]:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, boxes, each = rng.randint(12, 40), rng.randint(2, 6), rng.randint(3, 9)
    d = rng.randint(2, a - 1)
    q = (
        f"{name} has {a} {thing}. {name} buys {boxes} boxes with {each} {thing} in each box, "
        f"then gives {d} {thing} to a friend. How many {thing} does {name} have now?"
    )
    return q + WORKED_LONG, a + boxes * each - d


_MAKERS = {
    "add": _add,
    "add_worked": lambda rng: _add(rng, WORKED),
    "mul": _mul,
    "count": _count,
    "convert": _convert,
    "word": _word,
    "multi_worked": _multi_worked,
}
FAMILIES = tuple(_MAKERS)


def make_problems(
    count: int, seed: int, families: tuple[str, ...] = DEFAULT_FAMILIES
) -> list[dict]:
    """``count`` problems ``{"id", "family", "prompt", "answer"}``, round-robin over
    ``families``, reproducible from ``seed``; no prompt repeats."""
    bad = [f for f in families if f not in _MAKERS]
    if bad or not families:
        raise ValueError(f"unknown task families {bad or families!r}; allowed: {list(FAMILIES)}")
    rng = random.Random(seed)
    out: list[dict] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < count:
        fam = families[len(out) % len(families)]
        prompt, answer = _MAKERS[fam](rng)
        tries += 1
        if prompt in seen and tries < 100 * count:
            continue
        seen.add(prompt)
        out.append({"id": len(out), "family": fam, "prompt": prompt, "answer": answer})
    return out


_INT = re.compile(r"-?\d[\d,]*")


def extract_answer(text: str) -> int | None:
    """The integer a completion answers with: the first integer after its last "Answer" if
    one follows it, else the completion's last integer (thousands separators allowed)."""
    marks = list(re.finditer(r"answer", text, flags=re.IGNORECASE))
    after = _INT.findall(text[marks[-1].end() :]) if marks else []
    nums = after[:1] or _INT.findall(text)[-1:]
    return int(nums[0].replace(",", "")) if nums else None


def check(problem: dict, text: str) -> bool:
    """True when the completion's answer (:func:`extract_answer`) equals the problem's."""
    return extract_answer(text) == problem["answer"]


# ----------------------------------------------------------------------------- pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct among ``n`` samples: ``1 - C(n-c,k)/C(n,k)``,
    as the product ``prod_{i=n-c+1..n} (1 - k/i)`` (no large binomials)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_curve(n: int, c: int) -> list[float]:
    """pass@k for k = 1..n."""
    return [pass_at_k(n, c, k) for k in range(1, n + 1)]


# ----------------------------------------------------------------------------- methods
def score(samples: list[list[dict]], problems: list[dict]) -> dict[str, Any]:
    """Per problem: correct count, pass@k curve; answers seen."""
    correct, curves, answers = [], [], []
    for prob, comp in zip(problems, samples, strict=True):
        ok = [check(prob, c["text"]) for c in comp]
        correct.append(int(sum(ok)))
        curves.append(pass_curve(len(comp), int(sum(ok))))
        answers.append([extract_answer(c["text"]) for c in comp])
    return {"correct": correct, "curves": curves, "answers": answers}


def compare(a: list[list[float]], b: list[list[float]], ks: list[int]) -> dict[str, Any]:
    """Paired comparison of per-problem pass@k (a against b) at each k in ``ks``."""
    return {str(k): dv.paired([c[k - 1] for c in a], [c[k - 1] for c in b], True) for k in ks}


# ----------------------------------------------------------------------------- plot
def plot(result: dict[str, Any], path: Path) -> None:
    """pass@k curves, one per method (a line style per method of the same kind)."""
    styles = ["-", "--", ":", "-."]
    fig, ax = dv.pyplot().subplots(figsize=(7, 4.8))
    seen: dict[str, int] = {}
    for name, m in result["methods"].items():
        i = seen[m["kind"]] = seen.get(m["kind"], -1) + 1
        ks = list(range(1, len(m["pass_at_k"]) + 1))
        color = dv.KIND_COLORS.get(m["kind"], "tab:purple")
        ax.plot(ks, m["pass_at_k"], styles[i % 4], marker="o", ms=3, color=color, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("pass@k (mean over problems)")
    cfg = result["config"]
    ax.set_title(f"pass@k, {cfg['num_problems']} problems, n={cfg['n']}, embedded model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    dv.save_figure(fig, path, 120)


# ----------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", type=int, default=40, help="problems (default 40)")
    p.add_argument(
        "--families",
        default=",".join(DEFAULT_FAMILIES),
        help=f"comma-separated task families (default {','.join(DEFAULT_FAMILIES)}; "
        f"all: {','.join(FAMILIES)})",
    )
    p.add_argument("--task-seed", type=int, default=0, help="seed of the problem generator")
    p.add_argument(
        "--controls",
        default="temperature,noise",
        help="controls of the default recipe to run: comma-separated subset of "
        "temperature,noise,fnoise ('' for none; default temperature,noise; fnoise also adds "
        "each variant's f-noise ablation)",
    )
    p.add_argument("--no-default", action="store_true", help="skip the default ESamp recipe")
    dv.add_engine_args(p, max_tokens=40, max_model_len=512, kv_cache_gib=2, batch_prompts=8)
    p.add_argument("--ks", default="1,4,16", help="k values of the paired comparisons")
    p.add_argument("--plot", type=Path, default=None, help="pass@k curves PNG to write")
    args = p.parse_args(argv)
    betas, variants = dv.parse_methods_args(p, args)
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    try:
        problems = make_problems(args.problems, args.task_seed, families)
    except ValueError as e:
        p.error(str(e))
    if args.n < 1:
        p.error("-n must be >= 1")
    ks = sorted({int(k) for k in args.ks.split(",") if k.strip() and 1 <= int(k) <= args.n})

    offline_engine_env(args.kv_cache_gib)
    model = model_path(args.model)

    controls = {c.strip() for c in args.controls.split(",") if c.strip()}
    if controls - {"temperature", "noise", "fnoise"}:
        p.error(f"--controls {args.controls!r}: allowed values are temperature, noise, fnoise")
    methods = dv.build_methods(
        betas, args.temperature, variants, args.variant_noise, "fnoise" in controls
    )
    # The default recipe's methods (no variant): --controls picks its controls.
    default = {"esamp", "frozen", "fnoise"} | controls if not args.no_default else set()
    methods = [m for m in methods if m["kind"] in default | {"vanilla"} or "variant" in m]
    methods = dv.select_methods(p, methods, args.methods)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    gen = dv.generate_all(
        methods, [q["prompt"] for q in problems], args, model, tag="passk", partial=args.partial
    )
    t_gen = time.perf_counter() - t_start

    out_methods: dict[str, Any] = {}
    for m in methods:
        g = gen[m["name"]]
        s = score(g["samples"], problems)
        curves = np.asarray(s["curves"], float)
        fams = {}
        for fam in families:
            idx = [i for i, q in enumerate(problems) if q["family"] == fam]
            if idx:
                fams[fam] = curves[idx].mean(0).tolist()
        sem = curves.std(0, ddof=1) / math.sqrt(len(problems)) if len(problems) > 1 else None
        out_methods[m["name"]] = dv.method_record(
            m,
            g,
            pass_at_k=curves.mean(0).tolist(),
            pass_at_k_sem=[0.0] * args.n if sem is None else sem.tolist(),
            pass_at_k_by_family=fams,
            per_problem={"correct": s["correct"], "curves": s["curves"]},
            answers=s["answers"],
            mean_tokens=float(
                np.mean([len(c["token_ids"]) for comp in g["samples"] for c in comp])
            ),
        )

    def control(m: dict[str, Any], c: dict[str, Any]) -> bool:
        """``c`` is ``m``'s temperature control or own ablation (a variant's: also the default
        recipe's ESamp), at ``m``'s beta."""
        v = m.get("variant")
        return c.get("beta") == m["beta"] and (
            c["kind"] == "temperature"
            or (c["kind"] in ("noise", "frozen", "fnoise") and c.get("variant") == v)
            or (v is not None and c["kind"] == "esamp" and c.get("variant") is None)
        )

    pairs = [(n, "vanilla") for n in out_methods if n != "vanilla"]
    pairs += [
        (m["name"], c["name"])
        for m in methods
        if m["kind"] == "esamp"
        for c in methods
        if control(m, c)
    ]
    curves = {n: m["per_problem"]["curves"] for n, m in out_methods.items()}
    comparisons = [
        {"method": a, "against": b, "pass_at_k": compare(curves[a], curves[b], ks)}
        for a, b in pairs
    ]
    result = {
        "command": command_line("passk.py", argv),
        "config": {
            "model": model,
            "num_problems": len(problems),
            "families": list(families),
            "task_seed": args.task_seed,
            **dv.sampling_config(args, betas, variants),
            "dtype": args.dtype,
        },
        "problems": problems,
        "methods": out_methods,
        "comparisons": comparisons,
        **dv.run_record(out_methods, t_gen, t_start, load_start),
    }
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result, default=str) if args.json else render(result))
    gc.collect()
    return 1 if result["errors"] else 0


def render(pk: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: pass@k per method (± standard
    error), then each paired comparison."""
    c = pk["config"]
    ks = [k for k in (1, 2, 4, 8, 16) if k <= c["n"]]
    size = f"{c['num_problems']} problems x n={c['n']} x {c['max_tokens']} tokens"
    rows = [
        [
            name,
            *(f"{m['pass_at_k'][k - 1]:.3f} ± {m['pass_at_k_sem'][k - 1]:.3f}" for k in ks),
            f"{m['mean_tokens']:.1f}",
            size,
        ]
        for name, m in pk["methods"].items()
    ]
    head = ["method", *(f"pass@{k}" for k in ks), "tokens", "workload"]
    pairs = [
        [f"{cm['method']} vs {cm['against']}"]
        + [
            f"{v['mean_delta']:+.3f} ({v['improved']}/{v['worse']}, p_t {v['t_test_p']:.2g})"
            for v in cm["pass_at_k"].values()
        ]
        for cm in pk["comparisons"]
    ]
    tables = [table(head, rows)]
    if pairs:
        cks = list(pk["comparisons"][0]["pass_at_k"])
        tables.append(table(["comparison", *(f"Δ pass@{k}" for k in cks)], pairs))
    return section("pass@k on verifiable tasks", pk, *tables)


if __name__ == "__main__":
    sys.exit(main())
