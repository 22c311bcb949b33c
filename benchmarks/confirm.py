"""The pre-registered confirmatory analysis of ESamp (issue 29; the plan, written before the
run, is in docs/history.md, "Confirmatory experiment (pre-registered)").

    python benchmarks/confirm.py --passk RUN.json --diversity RUN.json --esamp NAME \
        --ablations FROZEN,FNOISE,NOISE [--frozen FROZEN] [--json | --markdown]

Endpoints: per problem the pass@k AUC, the mean of the unbiased pass@k over k in
{1, 2, 4, 8, 16}; per prompt the Vendi score. ESamp (method ``--esamp``) against each
ablation on both endpoints: one-sided paired t-tests (ESamp higher), Holm-corrected over all
these comparisons together at alpha 0.05. pass@16 against vanilla: non-inferiority with
margin -0.05 (the one-sided 95% lower bound of the mean paired difference above -0.05).
Quality guard: ESamp's mean per-prompt perplexity at most 5% above the frozen ablation's,
or, when it is not, ESamp's Vendi above vanilla's at matched perplexity (``vanilla_t*``
runs of ``diversity.py --vanilla-temps``, interpolated per prompt; one-sided p < 0.05).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from passk import pass_at_k  # noqa: E402

KS_AUC = (1, 2, 4, 8, 16)
ALPHA = 0.05
MARGIN = -0.05
PPL_GUARD = 1.05


def auc(correct: list[int], n: int, ks: tuple[int, ...] = KS_AUC) -> list[float]:
    """Per problem: mean of pass@k over ``ks`` (c correct of n samples)."""
    return [float(np.mean([pass_at_k(n, c, k) for k in ks])) for c in correct]


def one_sided(a: list[float], b: list[float]) -> dict[str, float]:
    """Paired one-sided t-test that ``a`` is higher than ``b``, with the mean difference and
    its two-sided 95% interval."""
    from scipy import stats

    d = np.asarray(a, float) - np.asarray(b, float)
    n, mean = d.size, float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("inf")
    if se == 0:
        p = 0.0 if mean > 0 else 1.0
    else:
        p = float(stats.t.sf(mean / se, n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * se if n > 1 else float("inf")
    return {"n": n, "mean_delta": mean, "ci95": [mean - half, mean + half], "p": p}


def holm(ps: dict[str, float], alpha: float = ALPHA) -> dict[str, dict[str, Any]]:
    """Holm's step-down procedure: adjusted p-values and rejections."""
    order = sorted(ps, key=lambda k: ps[k])
    m, running, out = len(order), 0.0, {}
    stopped = False
    for i, key in enumerate(order):
        running = max(running, min(1.0, (m - i) * ps[key]))
        stopped = stopped or running >= alpha
        out[key] = {"p": ps[key], "p_holm": running, "reject": not stopped}
    return out


def noninferior(a: list[float], b: list[float], margin: float = MARGIN) -> dict[str, Any]:
    """Non-inferiority of ``a`` to ``b``: the one-sided 95% lower bound of the mean paired
    difference is above ``margin``."""
    from scipy import stats

    d = np.asarray(a, float) - np.asarray(b, float)
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
    lower = mean - float(stats.t.ppf(0.95, d.size - 1)) * se
    return {"mean_delta": mean, "lower95": lower, "margin": margin, "pass": lower > margin}


def validity(passk: dict[str, Any], div: dict[str, Any]) -> dict[str, Any]:
    """The run is valid only if every ESamp method created one distiller per problem /
    prompt, trained (optimizer steps > 0, unless never trained by design) with staleness 0,
    and vanilla's completions average at least 64 tokens on the pass@k problems."""
    bad = []
    for run, items in ((passk, len(passk["methods"]["vanilla"]["per_problem"]["correct"])),
                       (div, len(div["methods"]["vanilla"]["per_prompt"]["vendi"]))):  # fmt: skip
        for name, m in run["methods"].items():
            c = m.get("counters", {}).get("esamp")
            if c is None:
                continue
            untrained = any('"frozen"' in x or '"train": false' in x for x in m["consumers"])
            if c["groups_created"] != items or c["staleness_max"] != 0:
                bad.append(f"{name}: groups {c['groups_created']} of {items}, staleness "
                           f"{c['staleness_max']}")  # fmt: skip
            elif not untrained and c["optimizer_steps"] <= 0:
                bad.append(f"{name}: no optimizer step")
    tokens = float(passk["methods"]["vanilla"]["mean_tokens"])
    if tokens < 64:
        bad.append(f"vanilla's pass@k completions average {tokens:.1f} tokens (< 64)")
    return {"valid": not bad, "problems": bad}


def matched_ppl(div: dict[str, Any], esamp: str) -> dict[str, Any] | None:
    """Vendi at matched perplexity, prompt by prompt: vanilla's Vendi interpolated (linearly
    in perplexity, over vanilla and every ``vanilla_t*`` temperature) at ESamp's perplexity
    of that prompt, against ESamp's Vendi (one-sided paired t-test, ESamp higher). None
    without ``vanilla_t*`` runs. Prompts where ESamp's perplexity is outside vanilla's range
    are counted (``outside``) and use the nearest end."""
    names = ["vanilla"] + [k for k in div["methods"] if k.startswith("vanilla_t")]
    if len(names) < 2:
        return None
    ppl = np.array([div["methods"][k]["per_prompt"]["ppl"] for k in names], float)
    ven = np.array([div["methods"][k]["per_prompt"]["vendi"] for k in names], float)
    e_ppl = np.asarray(div["methods"][esamp]["per_prompt"]["ppl"], float)
    e_ven = div["methods"][esamp]["per_prompt"]["vendi"]
    interp, outside = [], 0
    for i in range(e_ppl.size):
        order = np.argsort(ppl[:, i])
        xs, ys = ppl[order, i], ven[order, i]
        outside += int(not xs[0] <= e_ppl[i] <= xs[-1])
        interp.append(float(np.interp(e_ppl[i], xs, ys)))
    return {**one_sided(e_ven, interp), "outside": outside, "temperatures": names}


def decide(
    passk: dict[str, Any], div: dict[str, Any], esamp: str, ablations: list[str], frozen: str
) -> dict[str, Any]:
    """The verdict from the two runs (JSON of passk.py and diversity.py)."""
    n = passk["config"]["n"]
    pk = {k: auc(m["per_problem"]["correct"], n) for k, m in passk["methods"].items()}
    p16 = {
        k: [pass_at_k(n, c, 16) for c in m["per_problem"]["correct"]]
        for k, m in passk["methods"].items()
    }
    vendi = {k: m["per_prompt"]["vendi"] for k, m in div["methods"].items()}
    tests = {}
    for abl in ablations:
        tests[f"passk_auc:{abl}"] = one_sided(pk[esamp], pk[abl])
        tests[f"vendi:{abl}"] = one_sided(vendi[esamp], vendi[abl])
    adj = holm({k: t["p"] for k, t in tests.items()})
    for k in tests:
        tests[k].update(adj[k])
    ppl = {k: float(np.mean(div["methods"][k]["per_prompt"]["ppl"])) for k in (esamp, frozen)}
    guard = ppl[esamp] <= PPL_GUARD * ppl[frozen]
    matched = matched_ppl(div, esamp)
    # The quality guard, or (when it fails) Vendi above vanilla's at matched perplexity.
    quality_ok = guard or (matched is not None and matched["p"] < ALPHA)
    wins = {
        "passk": all(tests[f"passk_auc:{a}"]["reject"] for a in ablations),
        "diversity": quality_ok and all(tests[f"vendi:{a}"]["reject"] for a in ablations),
    }
    ni = noninferior(p16[esamp], p16["vanilla"])
    valid = validity(passk, div)
    return {
        "validity": valid,
        "tests": tests,
        "pass16_vs_vanilla": ni,
        "ppl": ppl,
        "quality_guard": guard,
        "vendi_at_matched_ppl": matched,
        "learning_wins": wins,
        # The rule written before the run: the selected config becomes the default only
        # when the learned direction wins on at least one benchmark and pass@16 is
        # non-inferior to vanilla; an invalid run is reported, not analysed.
        "default_follows_selection": valid["valid"]
        and (wins["passk"] or wins["diversity"])
        and ni["pass"],
    }


def _means(passk: dict[str, Any], div: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per method: mean pass@k AUC, pass@1 and pass@16, completion tokens (pass@k run);
    mean Vendi and perplexity (diversity run). Reported, not tested."""
    n = passk["config"]["n"]
    out: dict[str, dict[str, float]] = {}
    for k, m in passk["methods"].items():
        c = m["per_problem"]["correct"]
        out.setdefault(k, {}).update(
            auc=float(np.mean(auc(c, n))),
            pass1=float(np.mean([pass_at_k(n, x, 1) for x in c])),
            pass16=float(np.mean([pass_at_k(n, x, 16) for x in c])),
            tokens=float(m["mean_tokens"]),
        )
    for k, m in div["methods"].items():
        out.setdefault(k, {}).update(
            vendi=float(np.mean(m["per_prompt"]["vendi"])),
            ppl=float(np.mean(m["per_prompt"]["ppl"])),
        )
    return out


def markdown(out: dict[str, Any], passk: dict[str, Any], div: dict[str, Any], esamp: str) -> str:
    """The verdict as Markdown tables, every figure from ``out`` (:func:`decide`) and the runs."""

    def f(x: float | None, fmt: str = ".4f") -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    lines = []
    v = out["validity"]
    lines.append(f"Validity: {'valid' if v['valid'] else 'INVALID: ' + '; '.join(v['problems'])}.")
    if not v["valid"]:  # the plan: an invalid run is reported as invalid, not analysed
        lines.append("The run is invalid: no comparison is reported and the default stays.")
        return "\n".join(lines) + "\n"
    lines += ["", "| method | pass@k AUC | pass@1 | pass@16 | tokens | Vendi | PPL |"]
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for k, m in _means(passk, div).items():
        cells = [f(m.get(x)) for x in ("auc", "pass1", "pass16")]
        cells += [f(m.get("tokens"), ".1f"), f(m.get("vendi"), ".3f"), f(m.get("ppl"), ".3f")]
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"| `{esamp}` against | mean Δ | 95% interval | p (one-sided) | Holm p | rejects |",
    ]
    lines.append("|---|---:|---|---:|---:|---|")
    for k, t in out["tests"].items():
        lo, hi = t["ci95"]
        lines.append(
            f"| {k.replace(':', ': `')}` | {t['mean_delta']:+.4f} | [{lo:+.4f}, {hi:+.4f}] "
            f"| {t['p']:.4f} | {t['p_holm']:.4f} | {'yes' if t['reject'] else 'no'} |"
        )
    ni = out["pass16_vs_vanilla"]
    lines += [
        "",
        f"pass@16 against vanilla: mean Δ {ni['mean_delta']:+.4f}, one-sided 95% lower bound "
        f"{ni['lower95']:+.4f} (margin {ni['margin']}): "
        f"{'non-inferior' if ni['pass'] else 'non-inferiority not shown'}.",
    ]
    ppl = out["ppl"]
    names = list(ppl)
    lines.append(
        f"Quality guard: mean PPL {ppl[names[0]]:.3f} (`{names[0]}`) against "
        f"{ppl[names[-1]]:.3f} (`{names[-1]}`), limit x{PPL_GUARD}: "
        f"{'holds' if out['quality_guard'] else 'fails'}."
    )
    mp = out["vendi_at_matched_ppl"]
    if mp is not None:
        lo, hi = mp["ci95"]
        lines.append(
            f"Vendi against vanilla at matched perplexity: mean Δ {mp['mean_delta']:+.4f} "
            f"[{lo:+.4f}, {hi:+.4f}], p {mp['p']:.4f}, {mp['outside']} prompts outside "
            f"vanilla's range."
        )
    w = out["learning_wins"]
    lines.append(
        f"Learned direction helps: pass@k {'yes' if w['passk'] else 'no'}, diversity "
        f"{'yes' if w['diversity'] else 'no'}. Default follows the selection: "
        f"{'yes' if out['default_follows_selection'] else 'no'}."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passk", type=Path, required=True)
    p.add_argument("--diversity", type=Path, required=True)
    p.add_argument("--esamp", required=True, help="the ESamp method's name in both runs")
    p.add_argument("--ablations", required=True, help="comma-separated method names")
    p.add_argument("--frozen", default=None, help="the frozen ablation (quality guard)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="the verdict as Markdown tables")
    args = p.parse_args(argv)
    ablations = [a for a in args.ablations.split(",") if a]
    frozen = args.frozen or next(a for a in ablations if a.startswith("frozen"))
    passk, div = json.loads(args.passk.read_text()), json.loads(args.diversity.read_text())
    out = decide(passk, div, args.esamp, ablations, frozen)
    if args.markdown:
        print(markdown(out, passk, div, args.esamp), end="")
    elif args.json:
        print(json.dumps(out))
    else:
        for k, t in out["tests"].items():
            print(f"{k:<28} delta {t['mean_delta']:+.4f} p {t['p']:.4f} holm {t['p_holm']:.4f}")
        print("pass@16 vs vanilla:", out["pass16_vs_vanilla"])
        print("learning wins:", out["learning_wins"], "quality guard:", out["quality_guard"])
        print("default follows the selection:", out["default_follows_selection"])
        print("validity:", out["validity"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
