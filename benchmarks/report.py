"""Regenerate docs/results.md (and its PNG plots) from the benchmark runs.

    python benchmarks/report.py --run     # run throughput + diversity (CPU settings below), then render
    python benchmarks/report.py           # render from benchmarks/results/*.json only
    python benchmarks/report.py --merge run.json --note "when, why"
                                          # fold a later throughput.py --json run in, render

Runs write benchmarks/results/throughput.json and diversity.json; a GPU run of
``benchmarks/gpu_distiller.py --json > benchmarks/results/gpu_distiller.json`` is picked up
when present.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOC = ROOT / "docs" / "results.md"
IMG = ROOT / "docs" / "img"

sys.path.insert(0, str(HERE))
from throughput import CASES  # noqa: E402  (same folder: the one table of cases)

# The settings of the published CPU run: the issues' workloads (throughput: 8 prompts x 16 x
# 128 tokens, compiled, paired method; diversity: 40 prompts x 16 samples, chat, T=1, min-p 0.1).
THROUGHPUT_ARGS = ["--rounds", "2", "--restarts", "2"]
DIVERSITY_ARGS = [
    "--num-prompts",
    "40",
    "-n",
    "16",
    "--max-tokens",
    "96",
    "--batch-prompts",
    "8",
    "--esamp-variant",
    'lr3e-3={"lr": 0.003}',
    "--ppl-check",
    "8",
    "--plot",
    "docs/img/diversity_quality.png",
    "--bars",
    "docs/img/diversity_metrics.png",
]


def key_counters(case: str) -> list[str]:
    """The work counters shown for a case: those its table entry in throughput.py requires,
    then the ones it asks to report."""
    c = CASES.get(case)
    return [*c.required, *c.also_report] if c else []


def cmd(script: str, args: list[str]) -> str:
    return "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{script}", *args, "--json"])


def run_all() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for script, args, out in (
        ("throughput.py", THROUGHPUT_ARGS, "throughput.json"),
        ("diversity.py", DIVERSITY_ARGS, "diversity.json"),
    ):
        print(f"[report] {cmd(script, args)}", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, str(HERE / script), *args, "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        sys.stderr.write(proc.stderr[-2000:])
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if lines:
            (RESULTS / out).write_text(lines[-1] + "\n")
        if proc.returncode != 0:
            print(f"[report] {script} exited {proc.returncode}", file=sys.stderr)


def _get(counters: dict, dotted: str) -> Any:
    group, _, key = dotted.partition(".")
    return counters.get(group, {}).get(key)


def _load_note(*runs: dict | None) -> str:
    """The machine's load average as recorded by each run (other work skews tok/s)."""
    parts = [
        f"{name}: {r['machine']['loadavg_1m_start']:.2f} at start, "
        f"{r['machine'].get('loadavg_1m_end', float('nan')):.2f} at end"
        for name, r in zip(("throughput", "diversity"), runs, strict=True)
        if r and "loadavg_1m_start" in r.get("machine", {})
    ]
    return (
        (
            " 1-minute load average (2 cores; a benchmark itself keeps about one busy) — "
            + "; ".join(parts)
            + "."
        )
        if parts
        else ""
    )


def _machine(m: dict) -> str:
    return (
        f"{m.get('cpu', '?')}, {m.get('cpus', '?')} logical CPUs, {m.get('mem_gib', '?')} GiB "
        f"RAM, {m.get('device', 'cpu')}; {m.get('platform', '')}; Python {m.get('python')}, "
        f"torch {m.get('torch')}, vLLM {m.get('vllm')}"
    )


def throughput_section(tp: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = tp["workload"]
    names = list(tp["cases"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ratios = [tp["cases"][n]["ratio"] for n in names]
    lo = [r - min(tp["cases"][n]["ratio_rounds"]) for n, r in zip(names, ratios, strict=False)]
    hi = [max(tp["cases"][n]["ratio_rounds"]) - r for n, r in zip(names, ratios, strict=False)]
    ax.bar(
        names,
        ratios,
        yerr=[[max(0, x) for x in lo], [max(0, x) for x in hi]],
        capsize=3,
        color=["black"] + ["tab:blue"] * (len(names) - 1),
    )
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_ylabel("throughput / plain vLLM")
    n_runs = w["rounds"] * (w.get("restarts") or 1)
    ax.set_title(f"tok/s ratio (median of {n_runs} paired runs; bars: their range)")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "throughput_ratio.png", dpi=110)
    plt.close(fig)

    out = [
        "## Throughput",
        "",
        f"Command: `{tp.get('command') or cmd('throughput.py', THROUGHPUT_ARGS)}`",
        "",
        *(
            f"Re-measured later (after a change to that case only), with its own paired plain "
            f"runs: {', '.join(f'`{n}`' for n in names_)}: `{command}`."
            + (f" Note: {note}" if (note := _run_note(tp, command)) else "")
            for command, names_ in _remeasured(tp)
        ),
        "",
        f"Workload: embedded SmolLM2-135M-Instruct (fp32, eager={w['enforce_eager']}), "
        f"{w['prompts']} prompts x n={w['n']} x {w['max_tokens']} new tokens "
        f"(`ignore_eos`, temperature {w['temperature']}, min-p {w['min_p']}) = "
        f"{w['tokens_per_case']} tokens per timed run; {w['rounds']} rounds"
        + (f" in each of {w['restarts']} fresh process pairs" if w.get("restarts") else "")
        + f"; method `{w.get('method', 'fresh')}`"
        + (
            ": every engine runs in its own process; for each case, fresh pairs of processes "
            "(plain and the case) are started, and within a pair the two alternate "
            "(plain-case, case-plain, ...); ratio = median over all paired runs of case tok/s / "
            "the paired plain tok/s. "
            if w.get("method") == "paired"
            else ": order rotated and reversed every other round, ratio = median case tok/s / "
            "median plain tok/s. "
        )
        + f"Baseline (plain vLLM): **{tp['baseline_tok_s']:.1f} tok/s**. "
        f"All cases did their work: **{'yes' if tp['ok'] else 'NO: ' + '; '.join(tp['failures'])}**.",
        "",
        "| case | consumers | tok/s | ratio | ratio per paired run | step ratio | tllm host ms/step "
        "| step ms (median) | extra peak RSS vs plain (MiB) "
        "| work counters (all runs of the case, incl. warm-up) |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for n in names:
        c = tp["cases"][n]
        cons = (
            "—"
            if c["consumers"] is None
            else ("none" if not c["consumers"] else "<br>".join(f"`{s}`" for s in c["consumers"]))
        )
        ctr = ", ".join(
            f"{k}={_get(c['counters'], k)}"
            for k in key_counters(n)
            if _get(c["counters"], k) is not None
        )
        rounds = "baseline" if n == "plain" else ", ".join(f"{r:.2f}" for r in c["ratio_rounds"])
        rt = c["counters"].get("runtime", {})
        host = (
            f"{1e3 * rt['host_s'] / rt['engine_steps']:.2f}"
            if rt.get("host_s") is not None and rt.get("engine_steps")
            else "—"
        )
        sr = f"{c['step_ratio']:.3f}" if c.get("step_ratio") else "—"
        sm = f"{c['step_ms_median']:.0f}" if c.get("step_ms_median") else "—"
        out.append(
            f"| {n} | {cons} | {c['tok_s']:.1f} | {c['ratio']:.3f} | {rounds} | {sr} | "
            f"{host} | {sm} | {c['extra_peak_rss_mib']:+.0f} | {ctr or '—'} |"
        )
    spread = {
        n: max(c["ratio_rounds"]) / max(min(c["ratio_rounds"]), 1e-9)
        for n, c in tp["cases"].items()
        if n != "plain"
    }
    below = [n for n, c in tp["cases"].items() if n != "plain" and max(c["ratio_rounds"]) < 1]
    if spread:
        worst = max(spread, key=spread.get)
        out += [
            "",
            f"**Reading.** The paired runs of one case spread by up to "
            f"{100 * (spread[worst] - 1):.0f}% ({worst}): on this shared machine, a ratio "
            "that close to 1 is within noise (tllm cannot make vLLM faster). Below plain in "
            f"every paired run: {', '.join(below) if below else 'no case'}.",
        ]
    ex = tp["cases"].get("export", {}).get("counters", {}).get("export", {})
    if ex.get("rows_exported"):
        out += [
            "",
            f"Export wrote {ex['bytes_written'] / ex['rows_exported']:.0f} bytes per "
            "exported token (all files, shards and manifest, over rows exported).",
        ]
    out += [
        "",
        "Step ratio: median engine-step time of the plain runs paired with the case over "
        "the case's median step time (every step of every timed run; robust to bursts of "
        "outside load). tllm host ms/step: engine-thread time in tllm's per-step code "
        "(`host_s` counter / `engine_steps`), the runtime's own cost without machine noise.",
        "",
        "![throughput ratio per case](img/throughput_ratio.png)",
        "",
        f"Memory: {tp.get('memory_note', '')}. Peak RSS of plain vLLM: "
        f"{tp['cases']['plain']['peak_rss_mib']:.0f} MiB (KV cache "
        f"{w['kv_cache_gib']} GiB reserved)."
        + (
            " In-process mode: the cases share one process, so memory that an earlier "
            "engine freed but the allocator did not return to the OS can show up in a later "
            "case; the extra-memory column is approximate."
            if w.get("method") == "in-process" or w.get("in_process")
            else ""
        ),
        "",
    ]
    return out


def _pm(m: dict, k: str, fmt: str = ".3f") -> str:
    return f"{m['means'][k]:{fmt}} ± {m['sem'][k]:{fmt}}"


def diversity_section(
    dv: dict, title: str = "Diversity and quality", img: str = "diversity"
) -> list[str]:
    sys.path.insert(0, str(HERE))
    import diversity

    diversity.plot(dv, IMG / f"{img}_quality.png", IMG / f"{img}_metrics.png")
    c = dv["config"]
    out = [
        f"## {title}",
        "",
        f"Command: `{dv.get('command') or cmd('diversity.py', DIVERSITY_ARGS)}`",
        "",
        f"{c['num_prompts']} prompts (the first of `benchmarks/prompts.txt`, chat template) x "
        f"n={c['n']} samples x up to {c['max_tokens']} new tokens; temperature "
        f"{c['temperature']}, min-p {c['min_p']}, prompt i seeded {c['seed']}+i in every "
        f"method; ESamp beta {c['betas']}. Mean over prompts ± standard error. Vendi and "
        "cosine similarity: all-MiniLM-L6-v2 embeddings of the n completions of a prompt. "
        "PPL: under the generating model (vLLM raw log-probs)"
        + (
            f", checked against transformers on {dv['ppl_check']['completions']} completions "
            f"(max |ΔNLL| = {dv['ppl_check']['max_abs_nll_diff']:.2g})"
            if dv.get("ppl_check")
            else ""
        )
        + ". distinct-2: unique token bigrams / bigrams within a completion.",
        "",
        "| method | Vendi ↑ | mean cos sim ↓ | PPL | distinct-2 ↑ | generate (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n, m in dv["methods"].items():
        out.append(
            f"| {n} | {_pm(m, 'vendi')} | {_pm(m, 'cos_sim')} | {_pm(m, 'ppl', '.2f')} "
            f"| {_pm(m, 'distinct2')} | {m['generate_s']:.0f} |"
        )
    out += [
        "",
        "Paired per prompt (improved = higher Vendi / lower similarity / lower PPL / "
        "higher distinct-2; p: two-sided sign test and paired t-test):",
        "",
        "| method vs reference | Vendi: improved, Δ, p_sign, p_t | cos sim: improved, Δ, "
        "p_t | PPL: lower, Δ, p_t | distinct-2: improved, Δ |",
        "|---|---|---|---|---|",
    ]
    for cmpn in dv["comparisons"]:
        v, s, p, d = (cmpn["metrics"][k] for k in ("vendi", "cos_sim", "ppl", "distinct2"))
        out.append(
            f"| {cmpn['method']} vs {cmpn['against']} | {v['improved']}/{v['prompts']}, "
            f"{v['mean_delta']:+.3f}, {v['sign_test_p']:.2g}, {v['t_test_p']:.2g} | "
            f"{s['improved']}/{s['prompts']}, {s['mean_delta']:+.4f}, {s['t_test_p']:.2g} | "
            f"{p['improved']}/{p['prompts']}, {p['mean_delta']:+.2f}, {p['t_test_p']:.2g} | "
            f"{d['improved']}/{d['prompts']}, {d['mean_delta']:+.3f} |"
        )
    out += [
        "",
        f"![quality-diversity](img/{img}_quality.png)",
        "",
        f"![per-method metrics](img/{img}_metrics.png)",
        "",
    ]
    out += verdict(dv)
    return out


def verdict(dv: dict) -> list[str]:
    lines = ["**Reading.** "]
    parts = []
    for cmpn in dv["comparisons"]:
        if not cmpn["method"].startswith("esamp"):
            continue
        v, p = cmpn["metrics"]["vendi"], cmpn["metrics"]["ppl"]
        sig = "significant" if min(v["sign_test_p"], v["t_test_p"]) < 0.05 else "not significant"
        parts.append(
            f"{cmpn['method']} vs {cmpn['against']}: Vendi {v['mean_delta']:+.3f} "
            f"(higher on {v['improved']}/{v['prompts']} prompts, {sig} at 0.05), "
            f"PPL {p['mean_delta']:+.2f}"
        )
    lines[0] += "; ".join(parts) + "." if parts else "no ESamp comparison."
    lines += [
        "",
        "A difference that is not significant here is not evidence of no effect, and "
        "one run on a 135M model says little about the 7B models of the paper.",
        "",
    ]
    return lines


def passk_section(pk: dict, stem: str = "passk") -> list[str]:
    """pass@k on verifiable tasks (one benchmarks/passk.py run, ``results/{stem}.json``)."""
    sys.path.insert(0, str(HERE))
    import passk

    passk.plot(pk, IMG / f"{stem}.png")
    c = pk["config"]
    ks = [k for k in (1, 2, 4, 8, 16) if k <= c["n"]]
    out = [
        f"## pass@k on verifiable tasks (`{stem}.json`)",
        "",
        f"Command: `{pk['command']}`",
        "",
        f"{c['num_problems']} problems generated from task seed {c['task_seed']} (families "
        f"{', '.join(c['families'])}; see `benchmarks/passk.py`), chat template, n={c['n']} "
        f"samples x up to {c['max_tokens']} new tokens, temperature {c['temperature']}, "
        f"min-p {c['min_p']}, problem i seeded {c['seed']}+i in every method; ESamp beta "
        f"{c['betas']}; variants {json.dumps(c['esamp_variants'])}. pass@k: the unbiased "
        "estimator per problem, mean over problems ± standard error.",
        "",
        "| method | " + " | ".join(f"pass@{k}" for k in ks) + " | tokens | generate (s) |",
        "|---|" + "---:|" * (len(ks) + 2),
    ]
    for n, m in pk["methods"].items():
        cells = " | ".join(
            f"{m['pass_at_k'][k - 1]:.3f} ± {m['pass_at_k_sem'][k - 1]:.3f}" for k in ks
        )
        out.append(f"| {n} | {cells} | {m['mean_tokens']:.1f} | {m['generate_s']:.0f} |")
    out += ["", "pass@1 by task family:", ""]
    for n, m in pk["methods"].items():
        fams = ", ".join(f"{f} {c[0]:.3f}" for f, c in m["pass_at_k_by_family"].items())
        out.append(f"- {n}: {fams}")
    cks = list(pk["comparisons"][0]["pass_at_k"]) if pk["comparisons"] else []
    if not cks:
        return out + ["", f"![pass@k curves](img/{stem}.png)", ""]
    out += [
        "",
        "Paired per problem (better = higher pass@k; p: two-sided sign test, paired t-test):",
        "",
        "| method vs reference | "
        + " | ".join(f"pass@{k}: better/worse, Δ, p_sign, p_t" for k in cks)
        + " |",
        "|---|" + "---|" * len(cks),
    ]
    for cm in pk["comparisons"]:
        cells = " | ".join(
            f"{v['improved']}/{v['worse']}, {v['mean_delta']:+.3f}, {v['sign_test_p']:.2g}, "
            f"{v['t_test_p']:.2g}"
            for v in cm["pass_at_k"].values()
        )
        out.append(f"| {cm['method']} vs {cm['against']} | {cells} |")
    out += ["", f"![pass@k curves](img/{stem}.png)", ""]
    return out


def _cmp(c: dict | None, fmt: str = "+.3f") -> str:
    """A paired comparison as 'Δ (better/worse, p_t)'."""
    if not c:
        return "—"
    return f"{c['mean_delta']:{fmt}} ({c['improved']}/{c['worse']}, p_t {c['t_test_p']:.2g})"


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("**yes**" if v else "no")


def variants_section() -> list[str]:
    """ESamp's variants on both benchmarks, paired across runs (benchmarks/variants.py)."""
    import variants

    passk_runs, div_runs = variants.published_runs("passk"), variants.published_runs("diversity")
    if not passk_runs or not div_runs:
        return []
    res = variants.load(passk_runs, div_runs)
    van = res["vanilla"]
    out = [
        "## ESamp variants on both benchmarks, with their ablations",
        "",
        "Command: `python benchmarks/variants.py` (pairs the runs below problem by problem and "
        "prompt by prompt after checking that vanilla's samples are identical in all of them; "
        "`--json` for everything). pass@k runs: "
        + ", ".join(f"`{n}`" for n in res["runs"]["passk"])
        + "; diversity runs: "
        + ", ".join(f"`{n}`" for n in res["runs"]["diversity"])
        + f". Vanilla: pass@1 {van['passk']['pass@1']:.3f}, pass@16 "
        f"{van['passk']['pass@16']:.3f}; Vendi {van['diversity']['vendi']:.3f}, PPL "
        f"{van['diversity']['ppl']:.2f}. Each cell: Δ (better/worse items, paired t-test p).",
        "",
        "| variant | pass@1 | pass@16 | pass@16 vs vanilla | vs frozen: pass@1 | "
        "vs frozen: pass@16 | vs noise: pass@16 | Vendi | PPL | Vendi vs vanilla | "
        "vs frozen: Vendi | vs noise: Vendi | vs noise: PPL |",
        "|---|---:|---:|---|---|---|---|---:|---:|---|---|---|---|",
    ]
    rows = []
    for row in res["variants"].values():
        pk, dv = row["passk"] or {}, row["diversity"] or {}
        pvs, dvs = pk.get("vs", {}), dv.get("vs", {})
        out.append(
            " | ".join(
                [
                    f"| `{row['variant']}` β {row['beta']:g}",
                    f"{pk['means']['pass@1']:.3f}" if pk else "—",
                    f"{pk['means']['pass@16']:.3f}" if pk else "—",
                    _cmp(pvs.get("vanilla", {}).get("pass@16")),
                    _cmp(pvs.get("frozen", {}).get("pass@1")),
                    _cmp(pvs.get("frozen", {}).get("pass@16")),
                    _cmp(pvs.get("noise", {}).get("pass@16")),
                    f"{dv['means']['vendi']:.3f}" if dv else "—",
                    f"{dv['means']['ppl']:.2f}" if dv else "—",
                    _cmp(dvs.get("vanilla", {}).get("vendi")),
                    _cmp(dvs.get("frozen", {}).get("vendi")),
                    _cmp(dvs.get("noise", {}).get("vendi")),
                    _cmp(dvs.get("noise", {}).get("ppl"), "+.2f") + " |",
                ]
            )
        )
        g = row["goals"]
        rows.append(
            f"| `{row['variant']}` β {row['beta']:g} | {_yes(g['a'])} | {_yes(g['b'])} | "
            f"{_yes(g['c_passk'])} | {_yes(g['c_diversity'])} | {_yes(g['all'])} |"
        )
    out += [
        "",
        "Goals (rules in `benchmarks/variants.py`): (a) pass@16 at or above vanilla within "
        "noise; (b) a significant Vendi gain at PPL ≤ +5%; (c) significantly better than its "
        "frozen ablation on pass@k (pass@1 or pass@16) and on Vendi. — where a figure was not "
        "measured.",
        "",
        "| variant | (a) | (b) | (c) pass@k | (c) Vendi | all three |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    return out


def tokens_section(stem: str, run: dict) -> list[str]:
    """Where ESamp's guidance acts (one benchmarks/esamp_tokens.py run)."""
    steps = (0, 1, 2, 5, 9, 19)
    out = [
        f"## Where ESamp's guidance acts, token by token (`{stem}.json`)",
        "",
        f"Command: `{run['command']}`",
        "",
        f"{run['problems']} pass@k problems x n={run['n']} x up to {run['max_tokens']} tokens. "
        "Changed: share of the rows with more than one min-p candidate whose top candidate "
        "the guidance changed (TV: mean total-variation distance of the mix from the model's "
        "distribution there). Relative error: `||h_L - f(h_1)|| / ||h_L||` of the group's "
        "distiller at decode step s (1 = as good as predicting zero). Read in "
        "[consumers/esamp.md](consumers/esamp.md).",
        "",
        "| config | pass@1 | changed, TV | changed where the top token is a digit | "
        "relative error at steps " + " / ".join(map(str, steps)) + " |",
        "|---|---:|---|---|---|",
    ]
    for name, c in run["configs"].items():
        a, dg = c["summary"]["all"], c["summary"]["by_top_token_class"]["digit"]
        err = {int(s_): e for s_, e, _ in c["rel_err_curve"]}
        out.append(
            f"| {name} `{json.dumps(c['config'])}` | {c['pass_at_1']:.3f} | "
            f"{a['top_changed_share_multi']:.1%}, {a['tv_mean_multi']:.2f} | "
            f"{dg['top_changed_share_multi']:.1%}, {dg['tv_mean_multi']:.2f} | "
            + " / ".join(f"{err[s_]:.2f}" if s_ in err else "—" for s_ in steps)
            + " |"
        )
    return out + [""]


def gpu_section(gp: dict | None) -> list[str]:
    out = [
        "## ESamp distiller on a GPU (7B shapes)",
        "",
        "Script: `python benchmarks/gpu_distiller.py --json` (PyTorch + Triton, no vLLM): "
        "grouped distiller predict + update at hidden 3584, 8 groups x 16 rows, eager vs "
        "CUDA graph, with and without the side stream, in µs per decode step and as a "
        "fraction of a decode step (synthetic Qwen2-7B linear layers in bf16 at batch 128, "
        "or `--decode-ms` of a real engine).",
        "",
    ]
    if gp is None:
        out += [
            "**Not run**: the machine these results come from has no GPU. "
            "Run it on a CUDA machine and save its output as "
            "`benchmarks/results/gpu_distiller.json`, then `python benchmarks/report.py`.",
            "",
        ]
        return out
    out += [
        f"Device: {gp['device']}, torch {gp['torch']}, triton {gp.get('triton')}; "
        f"decode step {gp['decode_step_us']:.0f} µs ({gp['decode_step_source']}).",
        "",
        "| variant | predict (µs) | update (µs) | both (µs) | added to a step (µs) "
        "| fraction of step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v, d in gp["distiller"].items():
        s = gp["in_step"].get(v, {})
        out.append(
            f"| {v} | {d['predict_us']:.1f} | {d['train_us']:.1f} | {d['step_us']:.1f} "
            f"| {s.get('added_us', float('nan')):.1f} | "
            f"{100 * s.get('fraction_of_step', float('nan')):.1f}% |"
        )
    return out + [""]


def smoke_section(cpu: dict | None, gpu: dict | None) -> list[str]:
    """``benchmarks/gpu_smoke.py``: ESamp's memory plan against measurements, host syncs."""
    out = [
        "## ESamp memory plan and host syncs (`gpu_smoke.py`)",
        "",
        "Script: `python benchmarks/gpu_smoke.py --out benchmarks/results/gpu_smoke.json` "
        "(torch only) on a GPU; `--device cpu --out benchmarks/results/gpu_smoke_cpu.json` "
        "for its CPU parts (tiny shapes: hidden 256, intermediate 64, 4 rows per group).",
        "",
    ]
    if gpu is None:
        out += [
            "**GPU: still to be measured** (no GPU in the sessions since issue 36's rebuild): "
            "the CUDA tests (distiller, kernels, the fake device's GPU checks), ESamp's step "
            "beside the synthetic decode step for 8 x 16, 1 x 128 and 64 x 16 with host time "
            "and the issue-36 targets, the kernels against their floor, syncs under the debug "
            "mode, and the plan against `torch.cuda.max_memory_allocated`.",
            "",
        ]
    for label, sm in (("CPU", cpu), ("GPU", gpu)):
        if sm is None:
            continue
        mem = sm["memory"]
        plan7 = mem.get("qwen2.5_7b_default_plan", {})
        out += [
            f"{label} ({sm['device']}, torch {sm['torch']}): Qwen2.5-7B default plan "
            f"**{plan7.get('total_gib', float('nan')):.3f} GiB** (8 slots, 16 rows per "
            "slot, 128 rows per step).",
            "",
            "| slots | measured (bytes) | plan (bytes) | measured / plan | within plan |",
            "|---:|---:|---:|---:|---|",
        ]
        fake = False
        for k, rec in mem.items():
            if not k.startswith("groups_"):
                continue
            if "fake_device_step" in rec:  # CPU: the CUDA distiller on the fake device
                fake = True
                st = rec["fake_device_step"]
                out.append(
                    f"| {k[7:]} | {st['allocation']} allocations per step | — | — | "
                    f"{rec['within_plan']} |"
                )
                continue
            used = rec.get("update_peak_bytes", rec.get("peak_bytes"))
            plan = rec.get("plan_update_workspace_bytes", rec.get("plan_distiller_bytes"))
            out.append(f"| {k[7:]} | {used} | {plan} | {used / plan:.2f} | {rec['within_plan']} |")
        what = (
            "the CUDA distiller's predict + update on the fake CUDA device (graph replays: "
            "nothing allocated per step)"
            if fake
            else "peak allocated over build + predict/train"
        )
        cs = sm["syncs"].get("consumer_step", {})
        syncs = ", ".join(
            f"{m} {sum(v[-1].values())}" for m, v in cs.items() if isinstance(v, list)
        )
        found = _candidate_search_text(sm["syncs"].get("candidate_search"))
        out += [
            "",
            f"Measured: {what}. Host syncs per ESamp decode step (consumer, CUDA branches): "
            f"{syncs or 'not run'}; distiller step: "
            f"{sum(sm['syncs']['distiller_step'][-1].values())}.{found}",
            "",
        ]
        out += _bytes_and_compile_lines(sm)
    return out


def _candidate_search_text(search: dict | None) -> str:
    """The two candidate searches' sync counts (``gpu_smoke.candidate_syncs``), or "" for a
    run without them."""
    if not isinstance(search, dict) or "exact" not in search:
        return ""
    text = (
        f" Candidate search at {search.get('rows', 128)} rows x {search.get('vocab', 152064)} "
        f"tokens: exact {sum(search['exact'].values())} syncs, fixed-size "
        f"{sum(search['fixed_size'].values())}"
    )
    if "fixed_size_cuda_sync_debug" in search:
        text += f" (CUDA sync debug mode: {search['fixed_size_cuda_sync_debug']})"
    return text + "."


def _bytes_and_compile_lines(sm: dict) -> list[str]:
    """Bytes per parameter per update (``bytes_per_param`` of each distiller run) and the
    compiled-taps comparison, when the run has them."""
    out = []
    for k, rec in sm["distiller"].get("results", {}).items():
        b = rec.get("bytes_per_param")
        if b:
            parts = ", ".join(
                f"{name} {v}" if isinstance(v, int) else f"{name} {v:.1f}" for name, v in b.items()
            )
            out += [f"Bytes per parameter per update, {k[7:]} groups: {parts}.", ""]
    ct = sm.get("compiled_taps")
    if ct and "compiled_max_abs_diff" in ct:
        replay = ct["cuda_graph"].get("replay_max_abs_diff")
        graph = f"max abs difference {max(replay):.1e}" if replay else ct["cuda_graph"]["skipped"]
        out += [
            "Compiled taps (toy decoder, `torch.compile`, edit buffers changed each step): "
            f"max abs difference from eager {max(ct['compiled_max_abs_diff']):.1e} over "
            f"{len(ct['compiled_max_abs_diff'])} steps "
            f"(compile + run {ct['compile_seconds']:.0f} s); CUDA graph replay: {graph}.",
            "",
        ]
    return out


def gpu_first_run_section(fr: dict | None) -> list[str]:
    """The first GPU run (issue 36), from ``gpu_first_run_h200.json``."""
    if fr is None:
        return []
    ps, pr = fr["per_step_ms"], fr["profile_8x16"]
    added = fr["distiller_graph_mode_added_ms"]
    return [
        "## ESamp on a GPU: first run (issue 36)",
        "",
        f"{fr['device']} ({fr['software']}), {fr['shapes']}; code {fr['code']}. Source: "
        f"{fr['source']}.",
        "",
        f"- CUDA tests: {fr['cuda_tests']}.",
        f"- Per decode step: guide {ps['guide_post_filter']} ms (post-filter), "
        f"{ps['guide_full_vocab']} ms (full vocabulary); the update's submission "
        f"{ps['end_step_submission']} ms; the update itself {ps['update_on_side_stream']} ms "
        f"on the side stream; host time equal to device time (the host waited every step). "
        f"The synthetic 7B step: {ps['synthetic_7b_linear_step']} ms.",
        f"- Distiller alone, graph mode: 8 x 16 added {added['8x16']} ms to the "
        f"{fr['synthetic_step_ms']['8x16']} ms step; one shared distiller over 128 rows "
        f"{added['shared_one_distiller_128_rows']} ms; 64 x 16 {added['64x16']} ms to a "
        f"{fr['synthetic_step_ms']['64x16']} ms step.",
        f"- Profile at 8 x 16: Adam {pr['adam_ms']} ms in {pr['adam_launches']} launches (one "
        f"fused call over the same parameters: {pr['one_fused_adam_call_ms_fp32']} ms fp32, "
        f"{pr['one_fused_adam_call_ms_bf16_state']} ms bf16 state); weight gradients as "
        f"batched GEMV {pr['weight_gradient_gemv_ms']} ms; predict {pr['predict_ms']} ms in "
        f"~{pr['predict_launches']} launches; post-filter guidance {pr['post_filter_guidance_gb']}"
        f" GB moved, {pr['post_filter_guidance_alloc_mib']} MiB allocated, "
        f"~{pr['post_filter_guidance_launches']} launches per step.",
        f"- Eager fallback, one group of 2048 rows: {fr['eager_fallback_one_group_2048_rows_gib']}"
        f" GiB of fresh buffers. Copy bandwidth {fr['copy_bandwidth_tb_s']} TB/s.",
        f"- Already right: {'; '.join(fr['already_right'])}.",
        "",
        "What issue 36 changed in answer, and what is still to be measured on a GPU: "
        "docs/consumers/esamp.md, On a GPU; the next GPU session runs "
        "`python benchmarks/gpu_smoke.py --out benchmarks/results/gpu_smoke.json` first and "
        "last, which measures every figure above again (ESamp's step beside the synthetic "
        "step for 8 x 16, 1 x 128 and 64 x 16, host time, syncs under the debug mode, the "
        "kernels against their floor, memory against the plan).",
        "",
    ]


def _per_request_rows(fs: dict) -> list[str]:
    """The runtime step with ESamp per request (``run_runtime(per_request=...)``)."""
    rows = fs.get("runtime_per_request", [])
    if not rows:
        return []
    out = [
        "",
        'ESamp per request through the runtime (`{"per_request": true}`, switched on by the '
        "`tllm_consumers` of every other prompt's requests, `interleaved`, or of the first half "
        "of the prompts, `block`: one range of rows, handed to ESamp as views; constant beta; "
        "stream order checked):",
        "",
        "| prompts x n | mode | requests | rows | launches | GB moved | allocations (places) "
        "| host waits | pageable copies | races | index copies |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['prompts']} x {r['n']} | {r['mode']} | {r['per_request']} | {r['acted_on']} "
            f"| {r['launches']} | {r['bytes'] / 1e9:.2f} | {r['allocations']} "
            f"({len(r['allocation_sites'])}) | {len(r['host_waits'])} "
            f"| {len(r['pageable_copies'])} | {len(r['races'])} "
            f"| {r['index_copies_per_step']:g} |"
        )
    before = fs.get("runtime_per_request_before")
    if before:
        out += ["", f"Before ({before['what']}): {before['text']}"]
    return out


def fake_step_section(fs: dict | None) -> list[str]:
    """``benchmarks/esamp_fake_step.py``: ESamp's decode step counted on the fake device."""
    out = [
        "## ESamp decode step on the fake CUDA device",
        "",
        "Script: `python benchmarks/esamp_fake_step.py --json > "
        "benchmarks/results/esamp_fake_step.json` (CPU, no GPU): ESamp's guidance and "
        "training submission at Qwen2.5-7B shapes, bf16 states, on `tllm_core.testing."
        "fake_cuda` (meta tensors; a graph replay counts the operations it captured; the "
        "fused kernels count as one operation with their arguments). Launches are aten "
        "operations, not CUDA kernels; bytes are what each operation's tensors read and write.",
        "",
    ]
    if fs is None:
        return out + ["(no results yet)", ""]
    out += [
        "| prompts x n | mode | beta | launches | GB moved | allocations (MB) | host waits "
        "| pageable copies |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in fs["results"]:
        out.append(
            f"| {r['prompts']} x {r['n']} | {r['mode']} | {'fit' if r['fit'] else 'constant'} "
            f"| {r['launches']} | {r['bytes'] / 1e9:.2f} | {r['allocations']} "
            f"({r['allocated_bytes'] / 1e6:.0f}) | {r['host_waits']} | {r['pageable_copies']} |"
        )
    before = fs.get("before")
    if before:
        out += ["", f"Before issue 36 ({before['what']}): {before['text']}"]
    rebuilt = fs.get("after_first_rebuild")
    if rebuilt:
        out += ["", f"After the first rebuild ({rebuilt['what']}): {rebuilt['text']}"]
    fused = fs.get("before_fused_update")
    if fused:
        out += ["", f"Before the fused update kernels ({fused['what']}): {fused['text']}"]
    runtime = fs.get("runtime", [])
    if runtime:
        out += [
            "",
            "Through tllm's runtime (`esamp_runtime_step`: `begin_step`, `guide`, `end_step` "
            "with the step's stamps, as the vLLM bridge drives it; stream order checked): "
            "allocations in the last step (and places that allocated in any counted step), "
            "copies of the step's row indices to the device per step.",
            "",
            "| prompts x n | mode | beta | launches | GB moved | allocations (places) "
            "| host waits | pageable copies | races | index copies |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in runtime:
            beta = "fit" if r.get("fit") else "constant"
            copies = r.get("index_copies_per_step")
            out.append(
                f"| {r['prompts']} x {r['n']} | {r['mode']} | {beta} | {r['launches']} "
                f"| {r['bytes'] / 1e9:.2f} | {r['allocations']} ({len(r['allocation_sites'])}) "
                f"| {len(r['host_waits'])} | {len(r['pageable_copies'])} | {len(r['races'])} "
                f"| {'' if copies is None else f'{copies:g}'} |"
            )
    pooled = fs.get("runtime_before_reused_buffers")
    if pooled:
        out += ["", f"Before the runtime reused its buffers ({pooled['what']}): {pooled['text']}"]
    out += _per_request_rows(fs)
    configs = fs.get("configurations")
    if configs:
        out += [
            "",
            "Each setting that changes a guided step, 8 x 16 (`--configs`):",
            "",
            "| setting | mode | beta | launches | GB moved | allocations (MB) | host waits |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        out += [
            f"| {r['config']} | {r['mode']} | {'fit' if r['fit'] else 'constant'} "
            f"| {r['launches']} | {r['bytes'] / 1e9:.2f} | {r['allocations']} "
            f"({r['allocated_bytes'] / 1e6:.0f}) | {r['host_waits']} |"
            for r in configs
        ]
    return out + [""]


def soak_section(sk: dict | None) -> list[str]:
    out = ["## A long day in the server (soak)", ""]
    if sk is None:
        return out + ["(no results yet: `python benchmarks/soak.py --json`)", ""]
    c = sk["counters"]
    kinds = ", ".join(f"{k} {v['sent']}" for k, v in sorted(sk["by_kind"].items()))
    out += [
        f"Command: `{sk.get('command', 'python benchmarks/soak.py')}` — the OpenAI server with "
        "`esamp`, `steer` and the test package's crashing consumer, all per request; "
        f"{sk['requests']} requests, at most {sk['concurrency']} in flight ({kinds}).",
        "",
        "| check | result |",
        "|---|---|",
    ]
    out += [
        f"| {k.replace('_', ' ')} | {'yes' if v else '**no**'} |" for k, v in sk["checks"].items()
    ]
    out += [
        "",
        f"Wall time {sk['wall_s']} s ({sk['requests_per_s']} requests/s). Engine memory (RSS of "
        f"the server's engine processes): {sk['engine_rss_mib_after_warmup']} MiB after warm-up, "
        f"{sk['engine_rss_mib_end']} MiB at the end ({sk['engine_rss_change_pct']:+.2f}%). "
        f"Counters: ESamp guided {c['esamp']['rows_guided']} rows (its requests generated "
        f"{c['esamp_request_tokens']} tokens), groups created {c['esamp']['groups_created']} = "
        f"freed {c['esamp']['groups_freed']}, alive {c['esamp']['groups_alive']}; steer selected "
        f"{c['steer']['rows_selected']} rows, runtime rows_edited {c['runtime']['rows_edited']}; "
        f"consumer errors {c['runtime']['consumer_errors']} (the crasher, isolated).",
        "",
    ]
    return out


def fuzz_section(fz: dict | None) -> list[str]:
    """``tests/test_serve_fuzz.py``: random bodies at a real ``tllm serve``, what came back
    (``benchmarks/results/fuzz.json``, written with ``TLLM_FUZZ_RESULTS``)."""
    out = ["## Server fuzzing (issue 26, `fuzz.json`)", ""]
    if fz is None:
        return out + ["(no results yet)", ""]
    out += [
        f"Command: `{fz['command']}` — one `tllm serve` of the tiny test model with `esamp`, "
        "`steer` and `stats` per request and a 1 MiB body limit; hypothesis writes raw JSON "
        "bodies (random `vllm_xargs` of every type and size, tllm keys or not, NaN/Infinity "
        f"literals, deep nesting, duplicate keys). {fz['bodies']} bodies in {fz['seconds']} s; "
        f"after each, `GET /tllm/counters` parsed as strict JSON; afterwards a good request "
        f"answered {fz['good_request_after']} and was guided. No 5xx, no Traceback in the "
        "server log (the test fails otherwise).",
        "",
        "| route, kind, status | answers |",
        "|---|---:|",
    ]
    out += [f"| {k} | {v} |" for k, v in fz["answers"].items()]
    return out + [""]


def state_section(st: dict | None) -> list[str]:
    """``tests/test_serve_state.py`` (slow case): what a server keeps after N and 10 N
    requests (``benchmarks/results/server_state.json``, copied from the test's output)."""
    out = ["## What a server keeps per request (`server_state.json`)", ""]
    if st is None:
        return out + ["(no results yet)", ""]
    out += [
        f"Command: `{st['command']}` — one `tllm serve` of the tiny test model with `export`, "
        "`stats` (`max_requests` 8) and `esamp`, short requests (`max_tokens` 2, 8 in flight).",
        "",
        "| requests served | `/tllm/counters` bytes | export requests open | runner requests open |",
        "|---:|---:|---:|---:|",
    ]
    for r in st["reads"]:
        out.append(
            f"| {r['requests']} | {r['counters_bytes']} | {r['export_open']} | {r['runner_open']} |"
        )
    out += ["", st.get("note", ""), ""]
    return out


RSS_WHEN = {"start": "when ready", "after_warmup": "after warm-up", "end": "at the end"}


def _rss(v: float | dict) -> str:
    """MiB of a process tree; older runs recorded the total only."""
    return f"{v} MiB" if not isinstance(v, dict) else f"{v['total']} MiB ({v['front_end']})"


def _rss_by_phase(ld: dict) -> str:
    a, b = ld["phases"]["A"], ld["phases"]["B"]
    if "rss_mib_after_rounds" not in a:
        return ""
    after = [
        x
        for pair in zip(a["rss_mib_after_rounds"], b["rss_mib_after_rounds"], strict=True)
        for x in pair
    ]
    return f"; the tree after each phase, in order: {', '.join(map(str, after))} MiB"


def load_section(ld: dict, stem: str = "load") -> list[str]:
    """``tllm serve`` under concurrent mixed load, with and without a counters poller
    (``load.py``)."""
    out = [f"## Server under load (issue 26, `{stem}.json`)", ""]
    a, b, m, w = ld["phases"]["A"], ld["phases"]["B"], ld["machine"], ld["workload"]
    kinds = ", ".join(f"{k} {v}" for k, v in a["by_kind"].items())
    out += [
        f"Command: `{ld['command']}` (saved as `benchmarks/results/{stem}.json`) — `tllm serve` "
        "with `esamp` and `stats` per request and a 1 MiB body limit; one server for every "
        f"phase, in the order {ld['phase_order']}, after a warm-up. Each phase: "
        f"{w['rounds']} rounds of {w['requests']} requests, the same seeded mix in A and B "
        f"({kinds}; totals over the rounds), at most {w['concurrency']} in flight, "
        f"`max_tokens` {w['max_tokens']}, model {w['model']} "
        f"({'eager' if w['enforce_eager'] else 'compiled'}). In phase A another client reads "
        f"`GET /tllm/counters` every {w['poll_interval']} s; in B nobody does. 1-minute load "
        f"average {m['loadavg_1m_start']:.1f} at the start, "
        f"{m['loadavg_1m_end']:.1f} at the end, on {m.get('cpus', '?')} cores shared with "
        "other work.",
        "",
        "| phase | good tok/s (per round) | wall s | engine steps | good completed | status codes "
        "| 5xx | polls (failed) |",
        "|---|---|---:|---:|---|---|---:|---|",
    ]
    for p in (a, b):
        rounds = ", ".join(f"{t:.0f}" for t in p["good_tok_s_rounds"])
        codes = ", ".join(f"{k}: {v}" for k, v in p["status_codes"].items())
        out.append(
            f"| {p['phase']} | {p['good_tok_s']:.1f} ({rounds}) | {p['wall_s']:.0f} | "
            f"{p['counters_added']['runtime.engine_steps']} | {p['good_completed']}/"
            f"{p['good_sent']} | {codes} | {p['status_5xx']} | {p['polls']} "
            f"({p['polls_failed']}) |"
        )
    rss, c = ld["rss_mib"], ld["counters_end"]
    ra, rb = a["good_tok_s_rounds"], b["good_tok_s_rounds"]
    pairs = ", ".join(f"{x / y:.2f}" for x, y in zip(ra, rb, strict=True))
    checks = ", ".join(
        f"{k.replace('_', ' ')}: {'yes' if v else '**no**'}" for k, v in ld["checks"].items()
    )
    out += [
        "",
        f"Tokens/s with polling over without: **{ld['tok_s_ratio_polled_to_unpolled']:.3f}** "
        f"(round by round: {pairs}). "
        "Resident memory of the server's process tree"
        + (" (of which the API server process)" if isinstance(rss["end"], dict) else "")
        + ": "
        + ", ".join(f"{_rss(rss[k])} {when}" for k, when in RSS_WHEN.items())
        + _rss_by_phase(ld)
        + ". Counters at "
        f"the end: ESamp guided {c['esamp.rows_guided']} rows, groups created "
        f"{c['esamp.groups_created']} = freed {c['esamp.groups_freed']}, alive "
        f"{c['esamp.groups_alive']}; stats bundles {c['stats.bundles']}; requests finished "
        f"{c['runtime.requests_finished']}; consumer errors: {len(ld['errors'])}. Checks: "
        f"{checks}.",
        "",
    ]
    return out


def preload_section(cp: dict) -> list[str]:
    """tcmalloc + Intel OpenMP preloaded vs not (``benchmarks/cpu_preload.py``)."""
    w = cp["workload"]
    out = [
        "## tcmalloc and Intel OpenMP preloaded",
        "",
        f"Command: `{cp.get('command', 'python benchmarks/cpu_preload.py --json')}` "
        "(saved as `benchmarks/results/cpu_preload.json`).",
        "",
        f"Plain vLLM (no tllm), embedded SmolLM2-135M-Instruct, fp32, "
        f"{'eager' if w['enforce_eager'] else 'compiled'}, {w['prompts']} prompts x n={w['n']} "
        f"x {w['max_tokens']} tokens (`ignore_eos`, min-p 0.1), vLLM's default multiprocess "
        f"layout; {len(cp['pairs'])} pairs of fresh processes, alternating which starts first, "
        f"{w['rounds']} timed runs each. In one process of a pair `LD_PRELOAD` holds "
        + ", ".join(f"`{lib}`" for lib in cp["libs"])
        + " (as `tllm` sets it for its engines), in the other it is unset (vLLM then preloads "
        "PyTorch's libgomp itself).",
        "",
        "| pair | preload tok/s | plain tok/s | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(cp["pairs"]):
        out.append(
            f"| {i} | {p['preload_tok_s']:.0f} | {p['plain_tok_s']:.0f} | {p['ratio']:.2f} |"
        )
    out += [
        "",
        f"Ratio (median over pairs): **{cp['ratio']:.2f}** (min {cp['ratio_min']:.2f}, max "
        f"{cp['ratio_max']:.2f}); 1-minute load average at the end: {cp['loadavg_1m_end']:.1f} "
        "on 2 cores (the machine was shared).",
        "",
    ]
    if cp.get("reading"):
        out += [f"**Reading.** {cp['reading']}", ""]
    return out


CLI_ERROR_CASES = {
    "help": "`tllm --help`",
    "run_bad_config": '`tllm run --consumer \'esamp:{"beta": "x"}\'`',
    "run_unknown_consumer": "`tllm run --consumer nope`",
    "run_layer_out_of_range": "`tllm run --model TINY --consumer 'stats:{\"layers\": [40]}'`",
    "export_bad_config": '`tllm export ... --consumer \'esamp:{"beta": "x"}\'`',
    "serve_bad_config": '`tllm serve --consumer \'esamp:{"beta": "x"}\'`',
}


def cli_errors_section(ce: dict | None) -> list[str]:
    """Time to refuse bad input, before and after the checks moved ahead of vLLM's import
    (``benchmarks/cli_errors.py``)."""
    if not ce:
        return []
    before, after = ce.get("before", {}), ce["after"]
    out = [
        "## Bad input before vLLM (`cli_errors.json`)",
        "",
        f"Command: `{ce['command']}` (saved as `benchmarks/results/cli_errors.json`). Wall "
        f"time of a fresh `python -m tllm_core.app.cli` process, median (min) of "
        f"{ce['repeat']}, the two checkouts taking turns; built-in plugins only. 1-minute load "
        f"average {ce['load_avg_1min'][0]:.1f} at the start, {ce['load_avg_1min'][1]:.1f} at the "
        f"end on {ce['cores']} cores (the machine was shared).",
        "",
        "| command | before | after | exit | message |",
        "|---|---:|---:|---:|---|",
    ]
    for case, label in CLI_ERROR_CASES.items():
        if case not in after:
            continue
        a = after[case]
        b = before.get(case)
        was = f"{b['median_s']:.2f} ({b['min_s']:.2f})" if b else "-"
        out.append(
            f"| {label} | {was} | {a['median_s']:.2f} ({a['min_s']:.2f}) | {a['exit']} | "
            f"{'yes' if a['message'] else 'no'} |"
        )
    out.append("")
    if ce.get("note"):
        out += [ce["note"], ""]
    return out


def edit_step_section(es: dict | None) -> list[str]:
    """``benchmarks/edit_fake_step.py``: a runtime step's edits counted on the fake device,
    before and after the edit buffers' device writes."""
    if not es:
        return []

    def key(r: dict) -> tuple[str, bool]:
        return r["case"], bool(r.get("inference_mode"))

    before = {key(r): r for r in es["before"]["results"]}
    kinds = ("host_wait", "pageable_copy", "allocation", "race", "consumer_errors")
    out = [
        "## Hidden-state edits on the fake CUDA device (`edit_fake_step.json`)",
        "",
        f"Script: `{es['command']}` (CPU, no GPU): `Runtime.begin_step` with one editing "
        "consumer (`steer` on every request or per request with a scale override; one "
        "consumer per edit kind), bf16 states, stream order checked, counted over 3 steady "
        "steps after a warm-up, as is and in inference mode (as vLLM runs a step; the "
        "'before' inference-mode cells were counted when the fake did not yet take apart "
        "composite operations there, so they miss some reads; `prepared`: the values moved or "
        "converted anew). `errors`: plans refused (before, the fake "
        "answered the ablation check's host read 'true', so the ablating consumers were "
        f"refused and switched off). Before: {es['before']['commit']}; after: "
        f"{es['after']['commit']}. Cells: before -> after.",
        "",
        "| case | mode | host waits | pageable copies | allocations | races | errors | prepared |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in es["after"]["results"]:
        b = before.get(key(r), {})
        cells = [f"{b.get(k, '-')} -> {r[k]}" for k in kinds]
        cells.append(f"{b.get('values_prepared') or '-'} -> {r.get('values_prepared')}")
        mode = "inference" if r.get("inference_mode") else "plain"
        out.append(f"| {r['case']} | {mode} | " + " | ".join(cells) + " |")
    return [*out, ""]


def render() -> None:
    tp = _load("throughput.json")
    dv = _load("diversity.json")
    gp = _load("gpu_distiller.json")
    pks = {p.stem: _load(p.name) for p in sorted(RESULTS.glob("passk*.json"))}
    dvvs = {p.stem: _load(p.name) for p in sorted(RESULTS.glob("diversity_variants*.json"))}
    machine = (tp or dv or {}).get("machine", {})
    out = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/report.py --run` (runs the two CPU benchmarks with "
        "the commands below, writes `benchmarks/results/*.json`, then this page and "
        "`docs/img/*.png`); `python benchmarks/report.py` re-renders from the saved JSON.",
        "",
        f"Machine: {_machine(machine)}.{_load_note(tp, dv)}",
        "",
    ]
    out += throughput_section(tp) if tp else ["## Throughput", "", "(no results yet)", ""]
    cp = _load("cpu_preload.json")
    out += preload_section(cp) if cp else []
    out += diversity_section(dv) if dv else ["## Diversity and quality", "", "(no results yet)", ""]
    for stem, pk in pks.items():
        if pk:
            out += passk_section(pk, stem)
    for stem, dvv in dvvs.items():
        if dvv:
            title = f"Diversity of the ESamp learning variants (`{stem}.json`)"
            out += diversity_section(dvv, title, stem.replace("diversity_", ""))
    for p in sorted(RESULTS.glob("esamp_tokens*.json")):
        out += tokens_section(p.stem, _load(p.name))
    out += variants_section()
    out += soak_section(_load("soak.json"))
    out += state_section(_load("server_state.json"))
    out += fuzz_section(_load("fuzz.json"))

    for p in sorted(RESULTS.glob("load*.json")):
        out += load_section(_load(p.name), p.stem)
    out += gpu_first_run_section(_load("gpu_first_run_h200.json"))
    out += fake_step_section(_load("esamp_fake_step.json"))
    out += edit_step_section(_load("edit_fake_step.json"))
    out += gpu_section(gp)
    out += smoke_section(_load("gpu_smoke_cpu.json"), _load("gpu_smoke.json"))
    out += cli_errors_section(_load("cli_errors.json"))
    DOC.write_text("\n".join(out))
    print(f"wrote {DOC}", file=sys.stderr)


def _remeasured(tp: dict) -> list[tuple[str, list[str]]]:
    """Cases replaced by a later run (``case_commands``: case -> command), grouped by
    command."""
    groups: dict[str, list[str]] = {}
    for name, command in (tp.get("case_commands") or {}).items():
        groups.setdefault(command, []).append(name)
    return list(groups.items())


def merge_throughput(run_path: Path, note: str) -> list[str]:
    """Fold a later ``throughput.py --json`` run into ``results/throughput.json``: its cases
    (not ``plain``) replace the published ones, ``case_commands`` names the run that measured
    each, and the run's command, baseline, machine and ``note`` go to ``later_runs``. The
    replaced figures stay in the earlier ``later_runs`` entries' notes or raw runs."""
    run = json.loads(run_path.read_text())
    if "cases" not in run or "command" not in run:
        raise SystemExit(f"{run_path}: not a throughput.py --json result")
    if not run.get("ok", False):
        raise SystemExit(f"{run_path}: the run failed ({run.get('failures')}); not merged")
    path = RESULTS / "throughput.json"
    tp = json.loads(path.read_text())
    cases = [c for c in run["cases"] if c != "plain"]
    for c in cases:
        tp["cases"][c] = run["cases"][c]
        tp.setdefault("case_commands", {})[c] = run["command"]
    tp.setdefault("later_runs", []).append(
        {
            "command": run["command"],
            "baseline_tok_s": run["baseline_tok_s"],
            "machine": run.get("machine", {}),
            "note": note,
            "cases": {c: run["cases"][c] for c in cases},
        }
    )
    path.write_text(json.dumps(tp))
    return cases


def _run_note(tp: dict, command: str) -> str:
    """The note of the newest later run made with ``command``."""
    notes = [r.get("note", "") for r in tp.get("later_runs", []) if r.get("command") == command]
    return notes[-1] if notes else ""


def _load(name: str) -> dict | None:
    p = RESULTS / name
    if not p.is_file() or not p.read_text().strip():
        return None
    return json.loads(p.read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="run the benchmarks first")
    ap.add_argument(
        "--merge",
        type=Path,
        metavar="RUN.json",
        help="fold a later throughput.py --json run (some cases re-measured with their own "
        "paired plain runs) into results/throughput.json, then render",
    )
    ap.add_argument("--note", default="", help="with --merge: why and when the run was made")
    a = ap.parse_args()
    if a.merge is not None and not a.note:
        ap.error("--merge needs --note (when, on what machine state, why)")
    if a.run:
        run_all()
    if a.merge is not None:
        print(f"merged: {', '.join(merge_throughput(a.merge, a.note))}", file=sys.stderr)
    render()
