"""Runtime settings: what travels to the engine in ``additional_config["tllm"]``, the consumers
among them as consumer specs (:class:`~tllm_core.api.consumer_spec.ConsumerSpec`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tllm_core.api.consumer_spec import ConsumerSpec

ADDITIONAL_CONFIG_KEY = "tllm"
MIB = 1024 * 1024
Seconds = Annotated[float, Field(gt=0, le=86400)]  # a bounded wait: at most a day
Bytes = Annotated[int, Field(ge=1024, le=2**31)]


class ServerSettings(BaseModel):
    """Settings of tllm's part of an OpenAI server (``tllm serve``/``vllm serve``), API-server side."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every wait bounded
    max_body_bytes: Bytes = Field(
        32 * MIB,
        description="largest request body accepted (HTTP 413 past it): a body is read whole "
        "to check its tllm keys before vLLM sees it",
    )
    counters_interval_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="GET /tllm/counters may answer with a read of the engine this many seconds "
        "old (0: only with a read that started after the request arrived); reads run one at "
        "a time and are shared by the requests waiting for them",
    )
    engine_answer_s: Seconds = Field(
        900.0,
        description="longest a /tllm/* route (or a completion's tllm marks) waits for the "
        "engine to answer (HTTP 504 past it); above the engine's own deadlines, so that a "
        "slow but healthy engine (a long result() under close_deadline_s) is not cut off",
    )
    show_paths: bool = Field(
        False,
        description="show server filesystem paths in /tllm/* responses (hidden by default: "
        "a server may face strangers)",
    )


class RuntimeSettings(BaseModel):
    """Engine-side runtime settings (JSON in ``additional_config["tllm"]``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every wait bounded
    consumers: list[ConsumerSpec] = Field(default_factory=list)
    server: ServerSettings = Field(
        default_factory=ServerSettings, description="the OpenAI server's limits (serving only)"
    )
    queue_size: int = Field(64, ge=1, description="bundles per background queue")
    max_result_bytes: Bytes = Field(
        16 * MIB,
        description="largest per-request result a consumer returns with a completion (JSON "
        "bytes; tllm_results): a larger one is replaced by an error saying so, and the server "
        "refuses (HTTP 400) a request whose result a consumer bounds past it",
    )
    results_wait_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="longest wait, after a request finished, for the per-request results it "
        "asked for (a background consumer may still be working on its last rows); past it the "
        "completion is returned with an error in place of each missing result",
    )
    overflow: Literal["block", "drop"] = Field(
        "block", description="full background queue: wait (block) or drop the bundle (counted)"
    )
    wait_timeout_s: Seconds = Field(
        120.0,
        description="longest wait for a background consumer to catch up (flush: reading "
        "results, closing) before going on without it (counted: flush_timeouts, close_timeouts)",
    )
    max_consecutive_failures: int = Field(
        3,
        ge=1,
        le=1_000_000,
        description="a consumer callback (edit, guide, on_bundle, ...) that raises this many "
        "times in a row switches its consumer off for the rest of the run (1: at the first "
        "error); fewer errors are counted (consumer_errors) and the consumer goes on",
    )
    background_threads: int = Field(
        1,
        ge=1,
        le=256,
        description="torch intra-op threads of each background consumer's thread (the "
        "engine's own threads already use the cores)",
    )
    callback_deadline_s: Seconds = Field(
        120.0,
        description="longest run of one consumer callback on the engine thread (edit, guide, "
        "on_bundle, on_request_finished): past it the watchdog names the consumer, the callback "
        "and its stack, and the engine stops (runtime/watchdog.py)",
    )
    background_deadline_s: Seconds = Field(
        300.0,
        description="longest run of one callback of a background consumer: past it that "
        "consumer is switched off and its queue dropped (counted); the engine goes on",
    )
    close_deadline_s: Seconds = Field(
        600.0,
        description="longest run of a consumer's close or result (writing what it holds): "
        "past it the watchdog names it and the engine stops",
    )
    hung_stop_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="seconds the engine goes on after a callback passed its deadline before it "
        "stops itself (0: at once, offline; a server first fails /health so that a load "
        "balancer drains it)",
    )
    fault_file: str | None = Field(
        None,
        description="a file the engine writes a hung callback's report into, for the front end "
        "to name it (runtime/watchdog.py)",
    )
    start_error_file: str | None = Field(
        None,
        description="a file the engine writes why tllm refused to start into, for the front "
        "end to report (runtime/start_error.py)",
    )
    front_end: tuple[int, float, str] | tuple[int, float] | None = Field(
        None,
        description="the (pid, psutil create_time, pid space) of the TllmLLM whose engine this "
        "is: its engine processes in its pid space stop themselves once it is gone (a kill -9)",
    )
