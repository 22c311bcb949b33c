"""Numbers and lists bounded to what float32 and memory hold (issue 26), one check for every
path: request keys (server and ``TllmLLM``) and consumer configs (command line, Python, server)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from tllm_core.api.consumer_spec import ConsumerSpec, ConsumerSpecError
from tllm_core.api.request_settings import F32_MAX, FiniteF32
from tllm_core.plugins.registry import Registry
from tllm_core.serving import EngineConsumers, validate_extra_args

RANGE = "within float32's range [-3.4028235e+38, 3.4028235e+38]"


@pytest.fixture(scope="module")
def engine() -> EngineConsumers:
    return EngineConsumers.from_settings(
        {
            "consumers": [
                {"name": "esamp", "per_request": True},
                {
                    "name": "steer",
                    "per_request": True,
                    "config": {"vectors": [{"layer": 1, "path": "v.safetensors"}]},
                },
                {"name": "sae", "per_request": True, "config": {"path": "no-such-sae"}},
                {"name": "stats"},
            ]
        }
    )


class Box(BaseModel):
    x: FiniteF32


@pytest.mark.parametrize("bad", [1e39, -1e39, 3.41e38, math.inf, -math.inf, math.nan, "Infinity"])
def test_finite_f32_rejects_what_float32_cannot_hold(bad):
    with pytest.raises(ValidationError, match=r"within float32's range") as e:
        Box(x=bad)
    assert repr(bad) in str(e.value) or str(bad) in str(e.value)  # the message names it


@pytest.mark.parametrize("good", [0.0, -0.0, 1e-45, F32_MAX, -F32_MAX, 3.4e38, "2.5", 7])
def test_finite_f32_accepts_float32_values(good):
    assert Box(x=good).x == float(good)


@pytest.mark.parametrize(
    "key, value, where",
    [
        ("tllm_steer_scale", 1e39, "['tllm_steer_scale']"),
        ("tllm_steer_scale", "-inf", "['tllm_steer_scale']"),
        ("tllm_sae_steer", '[{"feature": 1, "scale": 1e39}]', "['tllm_sae_steer'][0].scale"),
        ("tllm_sae_steer", '[{"feature": 1, "scale": Infinity}]', "['tllm_sae_steer'][0].scale"),
    ],
)
def test_request_numbers_past_float32_are_refused(engine, key, value, where):
    consumer = key.split("_")[1]
    extra = {"tllm_consumers": consumer, key: value}
    with pytest.raises(ValueError) as e:
        validate_extra_args(extra, engine)
    msg = str(e.value)
    assert msg.startswith(f"vllm_xargs{where} must be finite and {RANGE}"), msg
    assert "got " in msg


@pytest.mark.parametrize("beta", [1e39, "Infinity", 3e38, 1000.5])
def test_esamp_beta_past_its_bound_is_refused_in_the_config_and_the_request(engine, beta):
    """beta near float32's max made a row's logits NaN ((1+beta) x a logit overflows): one
    bound, 1000, for the config and a request's tllm_esamp_beta, named in both refusals."""
    with pytest.raises(ValueError, match=r"tllm_esamp_beta.*<= 1000"):
        validate_extra_args({"tllm_consumers": "esamp", "tllm_esamp_beta": beta}, engine)
    with pytest.raises(ConsumerSpecError, match=r"\n  beta: .*less than or equal to 1000"):
        Registry().validate(ConsumerSpec(name="esamp", config={"beta": beta}))


def test_request_lists_are_bounded(engine):
    entries = [{"feature": i, "scale": 1.0} for i in range(1024)]
    extra = {"tllm_consumers": "sae", "tllm_sae_steer": json.dumps(entries)}
    validate_extra_args(extra, engine)
    extra["tllm_sae_steer"] = json.dumps([*entries, {"feature": 0, "scale": 1.0}])
    with pytest.raises(ValueError, match=r"at most 1024 entries \(got 1025\)") as e:
        validate_extra_args(extra, engine)
    assert len(str(e.value)) < 1000  # the message does not echo the whole request
    with pytest.raises(ValueError, match=r"tllm_group'\] has 5000 characters; allowed: at most"):
        validate_extra_args({"tllm_group": "g" * 5000}, engine)
    many = ",".join(["esamp"] * 1000)
    with pytest.raises(ValueError, match=r"tllm_consumers'\] has 5999 characters; allowed"):
        validate_extra_args({"tllm_consumers": many}, engine)
    with pytest.raises(ValueError, match="nested too deeply"):
        validate_extra_args(
            {"tllm_consumers": "sae", "tllm_sae_steer": "[" * 30_000 + "]" * 30_000}, engine
        )
    with pytest.raises(ValueError, match=r"200000 characters; allowed: at most 65536"):
        validate_extra_args(  # longer: refused before it is parsed
            {"tllm_consumers": "sae", "tllm_sae_steer": "[" * 100_000 + "]" * 100_000}, engine
        )


@pytest.mark.parametrize(
    "name, config, field",
    [
        ("esamp", {"lr": math.inf}, "lr"),
        ("esamp", {"eps": 1e39}, "eps"),
        ("esamp", {"grad_clip": math.inf}, "grad_clip"),
        ("steer", {"vectors": [{"layer": 1, "vector": [1.0, 1e39]}]}, "vectors.0.vector.1"),
        ("steer", {"vectors": [{"layer": 1, "path": "v.pt", "scale": 1e39}]}, "vectors.0.scale"),
        ("sae", {"path": "p", "steer": [{"feature": 0, "clamp": 1e39}]}, "steer.0.clamp"),
        ("sae", {"path": "p", "steer": [{"feature": 2**40, "scale": 1}]}, "steer.0.feature"),
    ],
)
def test_config_numbers_past_float32_are_refused(name, config, field):
    with pytest.raises(ConsumerSpecError) as e:
        Registry().validate(ConsumerSpec(name=name, config=config))
    msg = str(e.value)
    assert f"\n  {field}: " in msg, msg
    if field != "steer.0.feature":
        assert RANGE in msg and ", got " in msg, msg


# -- property: any JSON value under any key is accepted or refused with a ValueError ---------
KEYS = [
    "tllm_consumers",
    "tllm_group",
    "tllm_esamp_beta",
    "tllm_steer_scale",
    "tllm_sae_steer",
    "tllm_sae_record",
    "tllm_sae_window",
    "tllm_prompt_index",
    "tllm_nope",
    "other",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["esamp", "steer,sae", "sae", "1e39", "-0", "Infinity", "NaN", " "]),
    st.sampled_from(["last_prompt", "generated[0:3]", "prompt[-9" + "9" * 5000 + ":]", "guide"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
steer_entry = st.fixed_dictionaries(
    {"feature": st.one_of(st.integers(-5, 2**70), scalars)},
    optional={"scale": json_values, "clamp": json_values, "x": json_values},
)
steer_text = st.lists(st.one_of(steer_entry, json_values), max_size=4).map(
    lambda v: json.dumps(v, allow_nan=True)
)
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e40, max_value=1e40),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(min_value=-1e40, max_value=1e40).map(repr),
)
values = st.one_of(numbers, json_values)
# Keys these consumers read, with their consumers switched on: most such requests pass the
# key and consumer checks, so the values themselves are what is tested.
focused = st.fixed_dictionaries(
    {"tllm_consumers": st.just("esamp,steer,sae")},
    optional={
        "tllm_esamp_beta": values,
        "tllm_steer_scale": values,
        "tllm_sae_steer": st.lists(
            st.fixed_dictionaries({"feature": st.integers(0, 3), "scale": values}), max_size=3
        ).map(lambda v: json.dumps(v, allow_nan=True)),
        "tllm_group": values,
        "other": values,
    },
)
anything = st.dictionaries(
    st.one_of(st.sampled_from(KEYS), st.text(max_size=12).map(lambda t: "tllm_" + t)),
    st.one_of(values, steer_text),
    max_size=6,
).map(lambda d: {"tllm_consumers": "esamp,steer,sae", **d} if len(d) % 2 else d)
requests = st.one_of(focused, anything)


def _fits_f32(v) -> bool:
    return v is None or (math.isfinite(float(v)) and abs(float(v)) <= F32_MAX)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(extra=requests)
def test_any_request_value_is_accepted_or_a_clean_error(engine, extra):
    try:
        validate_extra_args(extra, engine)
    except ValueError as e:
        assert str(e) and len(str(e)) < 4000  # a message, not an echo of the request
        return
    # Accepted: every number a consumer reads fits float32.
    for name in ("esamp", "steer", "sae"):
        if not engine.active(name, extra):
            continue
        from tllm_core.api.request_settings import parse_request_settings

        got = parse_request_settings(name, engine.models[name], extra)
        for v in got.model_dump().values():
            if isinstance(v, float):
                assert _fits_f32(v)
            if isinstance(v, list):
                for entry in v:
                    assert _fits_f32(entry.get("scale")) and _fits_f32(entry.get("clamp"))


# -- property: any JSON config is a config or a ConsumerSpecError -----------------------------
def _fields(name: str) -> list[str]:
    return list(Registry().get(name).Config.model_fields)


def _floats_fit(value) -> bool:
    if isinstance(value, float):
        return _fits_f32(value)
    if isinstance(value, dict):
        return all(_floats_fit(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_floats_fit(v) for v in value)
    return True


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_config_is_valid_or_a_clean_error(data):
    name = data.draw(st.sampled_from(["esamp", "steer", "sae"] * 3 + ["stats", "export"]))
    keys = st.one_of(st.sampled_from(_fields(name)), st.text(max_size=8))
    steer_vectors = st.lists(
        st.fixed_dictionaries(
            {"layer": st.integers(-3, 3)},
            optional={"vector": st.lists(numbers, max_size=3), "path": st.just("v.pt")},
        )
        | json_values,
        max_size=3,
    )
    # Mostly configs whose structure is right, so that the numbers are what is tested.
    focused = {
        "esamp": st.fixed_dictionaries(
            {}, optional={f: numbers for f in ("beta", "lr", "eps", "grad_clip", "fit_decay")}
        ),
        "steer": st.fixed_dictionaries(
            {
                "vectors": st.lists(
                    st.fixed_dictionaries(
                        {"layer": st.just(1), "vector": st.lists(numbers, min_size=1, max_size=3)},
                        optional={"scale": numbers},
                    ),
                    min_size=1,
                    max_size=2,
                )
            }
        ),
        "sae": st.fixed_dictionaries(
            {
                "steer": st.lists(
                    st.fixed_dictionaries(
                        {"feature": st.integers(0, 3)}, optional={"scale": numbers}
                    ),
                    max_size=3,
                )
            }
        ),
    }.get(name, st.fixed_dictionaries({}))
    anything = st.dictionaries(keys, st.one_of(values, steer_vectors), max_size=5)
    config = data.draw(st.one_of(focused, focused, focused, anything), label="config")
    if name == "sae":
        config.setdefault("path", "p")
    try:
        validated = Registry().validate(ConsumerSpec(name=name, config=config))
    except ConsumerSpecError as e:
        assert str(e)
        return
    assert _floats_fit(validated.model_dump())


def test_row_tags_given_to_tllmllm_are_checked(engine):
    # TllmLLM's callers may number their prompts (tllm_prompt_index); a string or a negative
    # index used to reach the engine and kill it.
    validate_extra_args({"tllm_prompt_index": 3, "tllm_n": 2}, engine, tags=True)
    for bad in ("x", -1, 1.5, True, 2**40):
        with pytest.raises(ValueError, match=r"extra_args\['tllm_prompt_index'\] must be a whole"):
            validate_extra_args({"tllm_prompt_index": bad}, engine, "extra_args", tags=True)
    with pytest.raises(ValueError, match="tllm_n'] must be a whole number in"):
        validate_extra_args({"tllm_n": 0}, engine, tags=True)
    with pytest.raises(ValueError, match="unknown tllm key"):  # server clients: not theirs
        validate_extra_args({"tllm_prompt_index": 3}, engine)
