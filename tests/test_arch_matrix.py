"""The architecture matrix (issue 27): every port of a tiny random model of each decoder family
equals transformers' on the same tokens, and so does a steering edit.

Per family, one in-process engine (eager, fp32) runs two greedy requests in one batch: one
plain, one steered (the built-in ``steer``, per request, adding a vector to the residual stream
after layer 0). A test consumer records ``layer.i``, ``attn.i``, ``mlp.i``, ``final`` and
``logits`` at every position, and the model as described to authors: ``ModelInfo.final_norm``
of the last layer's output and ``ModelInfo.lm_head`` of ``final`` (the LM head's contract:
soft-capping and logit scaling included); the reference is transformers' forward on the
generated tokens, with forward hooks reading the blocks and adding the same vector after
layer 0 (its final norm's output and its logits for the two).

A family vLLM or tllm cannot run must fail at engine start with an error naming the model class
(never capture something else): the test checks the message. Results (pass, max abs error per
port, or the start error) go to ``$TLLM_ARCH_RESULTS`` (default: a file in pytest's tmp folder);
``python tests/arch_table.py RESULTS.json`` renders ``docs/architectures.md`` from them, and the
last test checks that the committed table agrees with this run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from arch_table import COMMITTED, TABLE, load_results, render
from conftest import ENGINE_KW, MODEL_CACHE, registered_plugin
from tiny_models import MATRIX_ARCHS, build_tiny_model

from tllm_core import Bundle, Consumer, ConsumerConfig, Logits, Phase, hookimpl

pytestmark = pytest.mark.vllm

LAYERS = 2
HIDDEN = 128
PROMPTS = ["The quick brown fox jumps", "One two three"]
MAX_TOKENS = 3
TOL = 1e-4  # fp32 on both sides; the residual stream, blocks and logits agree to ~1e-6
# vLLM's CPU MLA kernel (AMX) takes bf16 weights only ("expect weight to be bfloat16..." at load
# in fp32): DeepSeek-V2 runs in bf16, compared with transformers' fp32 at bf16's precision.
DTYPE = {"deepseek_v2": "bfloat16"}
BF16_TOL = 1e-1  # bf16 keeps 8 bits of mantissa: the stream differs by up to ~4e-2
STEER_SCALE = 4.0
# Families vLLM (CPU build) or tllm cannot run, and the words their start error must contain
# (checked: the error must say why, naming the model class). Found by running the matrix.
REFUSED: dict[str, tuple[str, ...]] = {"jamba": ("selective_scan_fwd",)}
# Ports a family lacks (left out of its run), and for some of them the words of the start
# error when one is asked for (checked, one engine start each). The hybrid: layer 0 is a Mamba2
# layer (no attention block); every layer's feed-forward output is block_sparse_moe + shared_mlp
# added inline (no one module carries it).
SKIP: dict[str, set[str]] = {"granitemoehybrid": {"attn.0", "mlp.0", "mlp.1"}}
LACKING: dict[str, dict[str, tuple[str, ...]]] = {
    "granitemoehybrid": {
        "attn.0": ("GraniteMoeHybridMambaDecoderLayer", "no self-attention block"),
        "mlp.1": ("GraniteMoeHybridAttentionDecoderLayer", "shared_mlp"),
    },
}


class ProbeConfig(ConsumerConfig):
    ports: list[str]


class Probe(Consumer):
    """Test consumer: keeps every token port's rows and the logits, keyed by position."""

    name = "archprobe"
    Config = ProbeConfig

    def __init__(self, config, context):
        super().__init__(config, context)
        self.rows: dict[tuple[str, int], dict[int, dict[str, torch.Tensor]]] = {}

    def reads(self):
        parse = self.context.parse_port
        return [parse(p, Phase.ALL) for p in self.config.ports] + [Logits(Phase.ALL)]

    def on_bundle(self, bundle: Bundle) -> None:
        r = bundle.rows
        model = self.context.model
        # The model described for authors: final_norm of the last layer's output and lm_head
        # of the final state, compared with transformers' final norm output and logits.
        last = bundle.hidden.get(f"layer.{model.num_layers - 1}")
        normed = model.final_norm(last) if model.final_norm and last is not None else None
        final = bundle.hidden.get("final")
        head = model.lm_head(final) if final is not None else None
        for i, req in enumerate(r.requests):
            at = self.rows.setdefault((req.request_id, req.sample_index), {})
            row = at.setdefault(int(r.position[i]), {})
            for k, v in bundle.hidden.items():
                row[k] = v[i].float().cpu().clone()
            if normed is not None:
                row["final_norm"] = normed[i].float().cpu().clone()
            if head is not None:
                row["lm_head"] = head[i].float().cpu().clone()
        s, logits = bundle.sampled_rows, bundle.logits
        if s is not None and logits is not None:
            for i, req in enumerate(s.requests):
                at = self.rows.setdefault((req.request_id, req.sample_index), {})
                at.setdefault(int(s.position[i]), {})["logits"] = logits[i].float().cpu().clone()

    def result(self):
        return {"rows": self.rows}


class _ProbePlugin:
    @hookimpl
    def tllm_consumers(self):
        return [Probe]


@pytest.fixture(scope="module")
def probe_registered():
    with registered_plugin(_ProbePlugin(), "arch-probe"):
        yield


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out: dict[str, dict] = {}
    yield out
    path = Path(
        os.environ.get("TLLM_ARCH_RESULTS") or tmp_path_factory.mktemp("arch") / "results.json"
    )
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"\narchitecture matrix results: {path}")


def _steer_vector() -> torch.Tensor:
    v = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    return v / v.norm() * STEER_SCALE


def _ports(arch: str) -> list[str]:
    ports = [f"{kind}.{i}" for kind in ("attn", "mlp") for i in range(LAYERS)]
    ports = [p for p in ports if p not in SKIP.get(arch, set())]
    return [str(i) for i in range(LAYERS)] + ports + ["final"]


@torch.no_grad()
def _reference(path: str, token_ids: list[int], steer: torch.Tensor | None) -> dict:
    """transformers' ``layer.i`` (layer outputs), ``attn.i`` / ``mlp.i`` (block outputs),
    ``final`` (the final norm's output) and ``logits`` at every position; with ``steer``
    added to layer 0's output by a forward hook."""
    model = _hf(path)
    decoder = _text_decoder(model)
    layers = decoder.layers
    got: dict[str, torch.Tensor] = {}

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    def keep(name):
        return lambda _m, _i, o: got.__setitem__(name, first(o)[0].clone())

    def add(_m, _i, o):
        h = first(o) + steer
        return (h, *o[1:]) if isinstance(o, tuple) else h

    handles = []
    if steer is not None:
        handles.append(layers[0].register_forward_hook(add))
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(keep(f"layer.{i}")))
        for kind in ("attn", "mlp"):
            child = _child(layer, kind)
            if child is not None:
                handles.append(child.register_forward_hook(keep(f"{kind}.{i}")))
    handles.append(decoder.norm.register_forward_hook(keep("final")))
    try:
        got["logits"] = model(torch.tensor([token_ids])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return got


def _child(layer: torch.nn.Module, kind: str) -> torch.nn.Module | None:
    """transformers' block module (the reference's own names, not tllm's lookup)."""
    names = {"attn": ("self_attn",), "mlp": ("mlp", "block_sparse_moe", "feed_forward")}
    for n in names[kind]:
        if isinstance(getattr(layer, n, None), torch.nn.Module):
            return getattr(layer, n)
    return None


def _text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' decoder (``layers``, ``norm``): a vision-language model's text model."""
    inner = model.model
    return getattr(inner, "text_model", None) or getattr(inner, "language_model", None) or inner


_HF: dict[str, torch.nn.Module] = {}


def _hf(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if path not in _HF:
        _HF.clear()
        vision = "vision_config" in json.loads((Path(path) / "config.json").read_text())
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        # eager attention: the plain softmax(QK^T)V reference (soft-capping, sliding windows)
        _HF[path] = auto.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _HF[path]


def _compare(path: str, outs, rows: dict, steered_index: int, tol: float) -> dict[str, float]:
    """Max abs error per port kind over both requests and every position; asserts each."""
    worst: dict[str, float] = {}
    for idx, o in enumerate(outs):
        seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        by_pos = rows[(o.request_id, 0)]
        # every fed position (all but the last token) was captured, with logits where sampled
        assert sorted(by_pos) == list(range(len(seq) - 1)), (o.request_id, sorted(by_pos))
        ref = _reference(path, seq, _steer_vector() if idx == steered_index else None)
        for pos, got in by_pos.items():
            for key, value in got.items():
                name = key.split(".")[0]
                # ModelInfo's final_norm / lm_head against transformers' norm and logits.
                want = ref[{"final_norm": "final", "lm_head": "logits"}.get(key, key)][pos]
                if key in ("logits", "lm_head"):
                    value = value[: want.shape[-1]]
                err = float((value - want).abs().max())
                worst[name] = max(worst.get(name, 0.0), err)
                torch.testing.assert_close(
                    value,
                    want,
                    rtol=tol,
                    atol=tol,
                    msg=lambda m, at=f"{o.request_id} pos {pos} {key}": f"{at}: {m}",
                )
        n_logits = sum("logits" in g for g in by_pos.values())
        assert n_logits == MAX_TOKENS, f"{o.request_id}: logits of {n_logits} rows"
    return worst


@pytest.mark.parametrize("arch", MATRIX_ARCHS)
def test_architecture_matches_transformers(arch, engines, probe_registered, results):
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    path = str(build_tiny_model(MODEL_CACHE, arch=arch, num_layers=LAYERS, hidden=HIDDEN))
    consumers = [
        {"name": "archprobe", "config": {"ports": _ports(arch)}},
        {
            "name": "steer",
            "config": {"vectors": [{"layer": 0, "vector": _steer_vector().tolist()}]},
            "per_request": True,
        },
    ]
    model_class = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    kw = {**ENGINE_KW, "dtype": DTYPE.get(arch, ENGINE_KW["dtype"])}
    entry: dict = {"model_class": model_class, "dtype": kw["dtype"]}
    results[arch] = entry
    try:
        llm = engines.get(
            ("arch", arch),
            lambda: TllmLLM(path, consumers, enable_prefix_caching=False, **kw),
        )
    except Exception as e:  # noqa: BLE001 - a refusal is a result; the assert says if expected
        engines.close()
        entry.update(status="refused", error=f"{type(e).__name__}: {e}".splitlines()[0][:400])
        assert arch in REFUSED, f"{arch} ({model_class}) failed at start: {entry['error']}"
        for word in (model_class, *REFUSED[arch]):
            assert word in str(e), f"start error of {arch} does not name {word!r}: {e}"
        _committed_agrees(arch, entry)
        return
    assert arch not in REFUSED, f"{arch} now starts: move it out of REFUSED"
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, extra_args={"tllm_consumers": "steer"}),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    report = llm.close()
    engines.close()
    assert not report.get("errors"), report["errors"]
    assert report["runtime"]["rows_edited.layer.0"] > 0
    tol = TOL if kw["dtype"] == "float32" else BF16_TOL
    rows = report["results"]["archprobe"]["rows"]
    entry["max_abs_error"] = _compare(path, outs, rows, 1, tol)
    entry["status"] = "pass"
    _committed_agrees(arch, entry)
    if arch in LACKING:
        entry["lacking"] = _check_lacking(arch, path, model_class, engines)


def _committed_agrees(arch: str, entry: dict) -> None:
    """The committed matrix (``docs/architectures.json``) says what this run found for ``arch``
    (checked per family, so that it holds whichever worker or order runs the families)."""
    committed = load_results(COMMITTED).get(arch, {}).get("status")
    assert committed == entry["status"], (
        f"{arch}: this run says {entry['status']}, docs/architectures.json says {committed}: "
        "re-render the table (tests/arch_table.py)"
    )


def _check_lacking(arch: str, path: str, model_class: str, engines) -> dict[str, str]:
    """Asking for a port the family lacks fails at start, naming the layer and why."""
    from tllm_core.app.engine import TllmLLM

    errors = {}
    for port, words in LACKING[arch].items():
        spec = [{"name": "archprobe", "config": {"ports": [port]}}]
        with pytest.raises(Exception) as info:
            engines.get(("arch-lacking", arch, port), lambda s=spec: TllmLLM(path, s, **ENGINE_KW))
        engines.close()
        msg = str(info.value)
        for word in (port.split(".")[0], *words):
            assert word in msg, f"{arch} {port}: start error does not name {word!r}: {msg}"
        errors[port] = msg.splitlines()[0][:600]
    return errors


def test_mla_outside_the_cpu_kernel_is_refused_before_vllm_starts(results, tmp_path):
    """vLLM's CPU MLA kernels fail in the first forward with messages naming neither the model
    nor the remedy: with AMX tiles (bf16 weights only) on fp32, without them ("Unsupported
    block size: 16") on any latent but 512 + 64. tllm refuses first, naming both. Which one
    this machine takes is vLLM's choice; the other is checked on its config below."""
    from tllm_core.app.engine import TllmLLM
    from tllm_core.vllm_bridge.errors import UnsupportedEngineError
    from tllm_core.vllm_bridge.families import _cpu_has_amx

    path = build_tiny_model(MODEL_CACHE, arch="deepseek_v2", num_layers=LAYERS)
    if _cpu_has_amx():
        with pytest.raises(UnsupportedEngineError, match=r"DeepseekV2ForCausalLM .*bfloat16") as e:
            TllmLLM(str(path), [], **ENGINE_KW)
        if "deepseek_v2" in results:
            results["deepseek_v2"]["float32"] = str(e.value)
        return
    cfg = json.loads((path / "config.json").read_text()) | {"kv_lora_rank": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # refused before any weight is read
    with pytest.raises(UnsupportedEngineError, match=r"kv_lora_rank=256.*kv_lora_rank=512") as e:
        TllmLLM(str(tmp_path), [], **{**ENGINE_KW, "dtype": "bfloat16"})
    if "deepseek_v2" in results:
        results["deepseek_v2"]["latent"] = str(e.value)


@pytest.mark.parametrize(
    ("amx", "fields", "dtype", "refused"),
    [
        (True, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, "float32", "bf16 weights only"),
        (True, {"kv_lora_rank": 256, "qk_rope_head_dim": 64}, "bfloat16", None),
        (False, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, "float32", None),
        (False, {"kv_lora_rank": 256, "qk_rope_head_dim": 64}, "bfloat16", "kv_lora_rank=256"),
        (False, {"kv_lora_rank": 512, "qk_rope_head_dim": 32}, "float32", "qk_rope_head_dim=32"),
        (False, {}, "float32", None),  # no MLA
    ],
)
def test_cpu_mla_check_follows_vllms_backend_choice(
    monkeypatch, tmp_path, amx, fields, dtype, refused
):
    from tllm_core.vllm_bridge import families
    from tllm_core.vllm_bridge.errors import UnsupportedEngineError

    monkeypatch.setattr(families, "_cpu_has_amx", lambda: amx)
    monkeypatch.setattr(families, "_on_cpu", lambda: True)
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], **fields}
    cfg |= {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}  # read_model_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if refused is None:
        families.check_model(str(tmp_path), dtype)
    else:
        with pytest.raises(UnsupportedEngineError, match=refused):
            families.check_model(str(tmp_path), dtype)


def test_cli_refusal_is_one_line_naming_the_model_class(capfd):
    """``tllm run`` on a refused family: exit 2 and tllm's one line, no traceback. The
    command's ``main`` runs in this process (the refusal comes in the front end, before
    any engine process; a subprocess spent ~10 s importing vLLM for it); ``capfd`` reads
    file descriptor 2, so vLLM's own log handlers are read too."""
    from tllm_core.app import cli

    path = str(build_tiny_model(MODEL_CACHE, arch="jamba", num_layers=LAYERS))
    status = cli.main(["run", "--model", path, "--prompt", "Hi", "--max-tokens", "2"])
    err = capfd.readouterr().err
    assert status == 2, err[-3000:]
    assert "tllm: JambaForCausalLM has Mamba (v1) layers" in err
    assert "Traceback" not in err


def test_committed_table_matches_this_run(results):
    """Runs last (file order): the committed matrix (``docs/architectures.json``) says what this
    run found; re-render with ``tests/arch_table.py`` when a family's status changes."""
    if set(results) != set(MATRIX_ARCHS):
        pytest.skip("the matrix did not run in full")
    committed = load_results(COMMITTED)
    for arch, entry in results.items():
        assert committed.get(arch, {}).get("status") == entry.get("status"), (
            f"{arch}: this run says {entry.get('status')}, docs/architectures.json says "
            f"{committed.get(arch, {}).get('status')}: re-render the table"
        )


def test_docs_table_is_rendered_from_the_committed_results():
    assert TABLE.read_text() == render(load_results(COMMITTED)), "run tests/arch_table.py"


# -- the site lookup on stand-in layers (no engine) -----------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)


def _buffers():
    from tllm_core.vllm_bridge.sites import TapBuffers

    one = torch.zeros(1, dtype=torch.long)
    return TapBuffers(torch.zeros(4, 2), None, one, one.clone(), one.clone())


@pytest.mark.parametrize(
    ("children", "site", "found", "why"),
    [
        ({"self_attn": _Block}, "attn", "self_attn", None),
        ({"attn": _Block}, "attn", "attn", None),  # gpt-oss
        ({"mamba": _Block}, "attn", None, "no self-attention block module"),
        ({"feed_forward": _Block}, "mlp", "feed_forward", None),  # Jamba
        ({"block_sparse_moe": _Block, "shared_mlp": _Block}, "mlp", None, "shared_mlp"),
    ],
)
def test_block_lookup_by_name_and_refusal(children, site, found, why):
    from tllm_core.vllm_bridge.errors import UnsupportedEngineError
    from tllm_core.vllm_bridge.sites import OutputTap, install_tap

    layer = torch.nn.Module()
    for name, cls in children.items():
        setattr(layer, name, cls())
    layers = torch.nn.ModuleList([layer])
    if found is None:
        with pytest.raises(UnsupportedEngineError, match=why) as info:
            install_tap(layers, site, 0, _buffers(), model="ToyForCausalLM")
        assert "ToyForCausalLM" in str(info.value) and "decoder layer 0" in str(info.value)
    else:
        install_tap(layers, site, 0, _buffers())
        assert isinstance(getattr(layer, found), OutputTap)


def test_raw_attention_kernel_is_not_taken_for_the_block():
    """Jamba's layer holds vLLM's ``Attention`` kernel as ``attn`` and projects itself: the
    kernel's output is not the block's output, so the site is refused, not misread."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from tllm_core.vllm_bridge.errors import UnsupportedEngineError
    from tllm_core.vllm_bridge.sites import install_tap

    class Kernel(torch.nn.Module, AttentionLayerBase):
        def get_attn_backend(self):
            return None

        def get_kv_cache_spec(self, vllm_config):
            return None

    layer = torch.nn.Module()
    layer.attn = Kernel()
    with pytest.raises(UnsupportedEngineError, match="no self-attention block"):
        install_tap(torch.nn.ModuleList([layer]), "attn", 0, _buffers())


@pytest.mark.parametrize("convention", ["sum", "tensor", "stream_first"])
def test_residual_tap_reads_and_edits_each_layer_convention(convention):
    from tllm_core.api.edits import EditBuffers
    from tllm_core.vllm_bridge.layouts import STREAM_FIRST_LAYERS
    from tllm_core.vllm_bridge.sites import install_tap

    h, r = torch.randn(3, 2), torch.randn(3, 2)
    stream = {"sum": h + r, "tensor": h, "stream_first": h}[convention]

    class Layer(torch.nn.Module):
        def forward(self):
            return h if convention == "tensor" else (h, r)

    name = next(iter(STREAM_FIRST_LAYERS)) if convention == "stream_first" else "ToyLayer"
    layer = type(name, (Layer,), {})()
    buffers = _buffers()
    buffers.capture = torch.zeros(3, 2)
    add = torch.tensor([[1.0, 2.0]]).expand(3, 2)
    buffers.edit = EditBuffers(3, 2, torch.float32, torch.device("cpu"))
    layers = torch.nn.ModuleList([layer])
    install_tap(layers, "residual", 0, buffers)
    buffers.edit.mask[:2] = True
    buffers.edit.add[:2] = add[:2]
    out = layers[0]()
    torch.testing.assert_close(buffers.capture[:2], stream[:2] + add[:2])
    torch.testing.assert_close(buffers.capture[2], stream[2])
    # the edited stream is what the next layer / final norm will see
    seen = out if convention == "tensor" else (out[0] if convention == "stream_first" else sum(out))
    torch.testing.assert_close(seen, buffers.capture)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["granite", "granitemoehybrid"])
def test_compiled_export_of_other_layer_conventions(arch, tmp_path):
    """The single-tensor (Granite) and stream-first (hybrid) residual taps traced by
    torch.compile (``tllm export`` in vLLM's default multiprocess layout) equal transformers."""
    from conftest import cli_json, run_cli

    from consumers.export import read_export

    path = str(build_tiny_model(MODEL_CACHE, arch=arch, num_layers=LAYERS, hidden=HIDDEN))
    ports = _ports(arch)
    out = tmp_path / "x"
    args = ["export", "--model", path, "--layers", ",".join(ports), "--out", str(out)]
    args += ["--max-tokens", "3", "--no-chat", "--json", "--max-model-len", "512", "--compile"]
    cli_json(run_cli(*args, "--prompt", PROMPTS[0], timeout=900))
    records = list(read_export(out, verify=True))
    assert records
    for rec in records:  # one per sample (the command's default n)
        ref = _reference(path, rec.token_ids.tolist(), None)
        for name in ports:
            key = f"layer.{name}" if name.isdigit() else name
            want = ref[key][rec.positions]
            torch.testing.assert_close(rec.hidden[key], want, rtol=TOL, atol=TOL, msg=key)
