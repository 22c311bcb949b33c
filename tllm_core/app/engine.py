"""User-facing engine: vLLM's ``LLM`` with tllm consumers, and their counters afterwards
(README.md shows its use)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tllm_core.api.consumer import ConsumerConfig
from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.api.request_settings import SAMPLES_KEY
from tllm_core.api.results import asked_results, decode_results, merge_taken, with_missing
from tllm_core.app.default_model import default_model_path
from tllm_core.app.defaults import DEFAULT_DTYPE, default_kv_cache
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.model_config import read_model_config
from tllm_core.runtime.notes import NoteFile
from tllm_core.runtime.reports import merge_reports
from tllm_core.runtime.settings import ADDITIONAL_CONFIG_KEY, RuntimeSettings
from tllm_core.runtime.start_error import ENV as START_ERROR_ENV
from tllm_core.runtime.watchdog import Hung, read_note
from tllm_core.serving.keys import EngineConsumers, request_salt, validate_extra_args
from tllm_core.vllm_bridge import WORKER_EXTENSION
from tllm_core.vllm_bridge.engine_watch import LEFTOVER_GRACE_S, EngineDiedError, EngineWatch
from tllm_core.vllm_bridge.families import check_model
from tllm_core.vllm_bridge.lifecycle import (
    abort_unfinished,
    shutdown_engine,
    texts_so_far,
    unfinished_ids,
)
from tllm_core.vllm_bridge.nodes import announce_stop, leader_store
from tllm_core.vllm_bridge.offline import chat_with_salts
from tllm_core.vllm_bridge.parallel import bind_cpu_threads
from tllm_core.vllm_bridge.plugin import pid_space
from tllm_core.vllm_bridge.startup_interrupt import interrupts_reach_caller
from tllm_core.vllm_bridge.version import UnsupportedEngineError, check_version
from tllm_core.vllm_bridge.worker_ext import checked

log = logging.getLogger("tllm")

# Seconds to wait for the engine watch to name the dead process once vLLM said its engine
# is dead (vLLM may notice first, e.g. a dead worker reported by the engine core).
DEATH_NOTICE_S = 2.0
# Settings whose documented default is None (TllmLLM's); another's None is refused, as elsewhere.
NONE_IS_DEFAULT = ("callback_deadline_s", "background_deadline_s", "close_deadline_s")


@dataclass(frozen=True)
class CheckedConsumers:
    """Consumer specs checked once in the front end (:func:`validate_consumers`)."""

    specs: tuple[ConsumerSpec, ...]
    configs: tuple[ConsumerConfig, ...]  # each spec's config model
    registry: Registry
    model_path: str | None = None  # the folder they were dry-built against (None: not yet)

    def all_per_request(self) -> CheckedConsumers:
        """The same consumers, each acting only on requests that name it."""
        specs = tuple(s.model_copy(update={"per_request": True}) for s in self.specs)
        return replace(self, specs=specs)

    def settings(self, **kwargs: Any) -> RuntimeSettings:
        """The runtime settings sent to the engine with these consumers (see NONE_IS_DEFAULT)."""
        given = {k: v for k, v in kwargs.items() if v is not None or k not in NONE_IS_DEFAULT}
        return RuntimeSettings(consumers=list(self.specs), **given)


# A ``NAME[:JSON]`` string, a spec dict or a spec each, converted once by validate_consumers.
ConsumersArg = Sequence[str | ConsumerSpec | dict] | CheckedConsumers


def validate_consumers(
    specs: ConsumersArg, model_path: str | None = None, registry: Registry | None = None
) -> CheckedConsumers:
    """Check names and configs and, given the model folder, build every consumer on the meta
    device, before the engine starts. Passing the result back in adds only the dry build."""
    checked = specs
    if not isinstance(checked, CheckedConsumers):
        registry = registry or Registry()
        parsed = tuple(ConsumerSpec.coerce(c) for c in ConsumerSpec.listed(checked))
        checked = CheckedConsumers(parsed, tuple(registry.check(parsed)), registry)
    if model_path is None or checked.model_path == model_path or not checked.specs:
        return checked
    from tllm_core.runtime.dry_run import dry_build  # tests count its calls

    dry_build(checked.specs, checked.configs, model_path, checked.registry)
    return replace(checked, model_path=model_path)


class ConsumerDisabledError(RuntimeError):
    """A consumer was switched off during an offline run (``TllmLLM.generate``/``chat``:
    ``outputs``; ``close``: ``report``); ``errors``: each one's first error."""

    def __init__(
        self,
        errors: list[dict[str, Any]],
        outputs: Any = None,
        report: dict[str, Any] | None = None,
    ):
        parts = [
            f"consumer {e['consumer']!r} was disabled during the run; its first error: "
            f"{e['error']} (in {e['where']})"
            for e in errors
        ]
        super().__init__(
            "; ".join(parts) + ". Its callbacks were skipped from then on (outputs are in "
            "this exception's .outputs, the report in report['errors']); "
            "TllmLLM(..., raise_on_disabled=False) only reports it"
        )
        self.errors, self.outputs, self.report = errors, outputs, report


class ConsumerHungError(EngineDiedError):
    """A consumer callback ran past its deadline (``hung``): the watchdog stopped the engine."""

    def __init__(self, death: Any, hung: Hung, outputs: Any = None) -> None:
        super().__init__(death, outputs)
        self.hung = hung
        self.args = (f"{hung.message()}, at {hung.where()}; the engine was stopped",)


def first_errors_of_disabled(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first error of each consumer that some error entry says was disabled."""
    off = {e["consumer"] for e in errors if e.get("disabled")}
    out: dict[str, dict[str, Any]] = {}
    for e in errors:
        if e["consumer"] in off:
            out.setdefault(e["consumer"], e)
    return list(out.values())


def raise_newly_disabled(errors: list[dict[str, Any]], raised: set[str], **where: Any) -> None:
    """:class:`ConsumerDisabledError` for the disabled consumers not in ``raised`` (added)."""
    new = [e for e in first_errors_of_disabled(errors) if e["consumer"] not in raised]
    if new:
        raised.update(e["consumer"] for e in new)
        raise ConsumerDisabledError(new, **where)


def _salted(prompt: Any, salt: str | None) -> Any:
    """A completion prompt carrying ``salt`` (a salt the caller set is kept)."""
    if salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    if isinstance(prompt, dict) and "cache_salt" not in prompt:
        return {**prompt, "cache_salt": salt}
    return prompt


def tell_run_failed(checked: CheckedConsumers, cause: str, started_at: float) -> None:
    """Each plugin's ``tllm_run_failed`` hook after a fault (one that fails: a warning)."""
    hook = checked.registry.pm.hook.tllm_run_failed
    for impl in hook.get_hookimpls():
        try:
            impl.function(consumers=list(checked.specs), cause=cause, started_at=started_at)
        except Exception as e:  # noqa: BLE001 - the run's own error is the one to see
            why = f"{type(e).__name__}: {e}"
            log.warning("tllm: plugin %r's tllm_run_failed failed (%s)", impl.plugin_name, why)


class TllmLLM:
    """A vLLM ``LLM`` whose engine runs tllm consumers, checked before the engine starts (extra
    keyword arguments go to ``vllm.LLM``)."""

    def __init__(
        self,
        model: str | None = None,
        consumers: ConsumersArg = (),
        *,
        queue_size: int = 64,
        overflow: str = "block",
        background_threads: int = 1,
        max_consecutive_failures: int = 3,
        raise_on_disabled: bool = True,
        callback_deadline_s: float | None = None,
        background_deadline_s: float | None = None,
        close_deadline_s: float | None = None,
        **llm_kwargs: Any,
    ):
        # Names, configs and settings first: a bad one fails in about a second, before vLLM
        # is imported (check_version) or the default model converted.
        checked = validate_consumers(consumers)
        self.settings = checked.settings(
            queue_size=queue_size,
            overflow=overflow,
            background_threads=background_threads,
            max_consecutive_failures=max_consecutive_failures,
            callback_deadline_s=callback_deadline_s,
            background_deadline_s=background_deadline_s,
            close_deadline_s=close_deadline_s,
        )
        additional = dict(llm_kwargs.pop("additional_config", None) or {})
        if ADDITIONAL_CONFIG_KEY in additional:  # else lost
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is set by TllmLLM from its "
                "consumers and settings arguments; give them there"
            )
        check_version()
        llm_kwargs.setdefault("dtype", DEFAULT_DTYPE)  # as `tllm run` and ConsumerKit
        if model is None:
            model = str(default_model_path())
        self.model_path = model
        self.raise_on_disabled = raise_on_disabled
        self._raised: set[str] = set()  # consumers already raised as disabled
        if os.path.isdir(model):  # a broken config.json is bad input, before vLLM starts
            read_model_config(model)
            checked = validate_consumers(checked, model)
        check_model(model, llm_kwargs.get("dtype"))  # known refusals, before vLLM starts
        self.consumers = EngineConsumers.of(checked.specs, checked.configs, checked.registry)
        self._checked = checked  # told if a fault stops the engine (tllm_run_failed)
        self._died: EngineDiedError | None = None  # the error a fault was reported as
        self._failure_told = False
        # The samples of the requests an interrupted or failed generate/chat left unfinished
        # (request id -> sample index -> (text so far, finished)), read before their abort.
        self.cut_short: dict[str, dict[int, tuple[str, bool]]] = {}
        note = NoteFile("tllm-start-")  # why the engine refused to start (start_error.py)
        self._fault_note = NoteFile("tllm-fault-")  # a hung callback's report (watchdog.py)
        # Removed with this object (or at exit) when no one calls close or shutdown.
        weakref.finalize(self, self._fault_note.close)
        import psutil  # vLLM's dependency

        sent: dict[str, Any] = {"start_error_file": note.path, "fault_file": self._fault_note.path}
        # Its engine processes stop themselves once this process is gone (plugin.py).
        sent["front_end"] = (os.getpid(), psutil.Process().create_time(), pid_space())
        additional[ADDITIONAL_CONFIG_KEY] = self.settings.model_copy(update=sent).model_dump()
        from vllm import LLM  # after check_version

        self._started_at = time.time()  # files older than this are not this run's
        # A multi-node leader tells its followers of a requested stop (nodes.announce_stop).
        nodes = ("nnodes", "node_rank", "master_addr", "master_port")
        self._followers_store = leader_store(*(llm_kwargs.get(k) for k in nodes))
        sizes = (llm_kwargs.get(k) or 1 for k in ("tensor_parallel_size", "pipeline_parallel_size"))
        bound = None
        try:
            # Inside the try that removes it (and closes the note): an error before vLLM
            # starts leaves no binding for a later engine of this process.
            bound = bind_cpu_threads(math.prod(int(n) for n in sizes))
            if bound is not None:
                log.info("tllm: VLLM_CPU_OMP_THREADS_BIND=%s (one core group per rank)", bound)
            # Ctrl-C while the engine starts stops it; the CPU KV cache is the CLI's default;
            # the engine processes note their first error for us.
            with (
                interrupts_reach_caller(),
                default_kv_cache(llm_kwargs),
                note.shared(START_ERROR_ENV),
            ):
                self.llm = LLM(
                    model=model,
                    additional_config=additional,
                    worker_extension_cls=WORKER_EXTENSION,
                    **llm_kwargs,
                )
        except Exception as e:
            self._fault_note.close()
            why = note.read()  # vLLM's own error says only "see root cause above"
            if why:
                raise UnsupportedEngineError(f"the engine refused to start: {why}") from e
            raise
        finally:
            note.close()
            if bound is not None:  # the workers are bound: leave the caller's env as it was
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        # From here on a dead engine process ends every wait on the engine (engine_watch).
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        self._watch = EngineWatch(core).start()
        self._closed_report: dict[str, Any] | None = None
        self._stopped = False  # shutdown() ran
        try:
            self.status = self._installed_status()
        except BaseException:  # a started engine is not left running (nor its device held)
            self.shutdown()
            raise

    def _installed_status(self) -> dict[str, Any]:
        with self._naming_a_dead_engine():
            statuses = self._workers("tllm_status")
        status = next((s for s in statuses if s.get("rank", {}).get("leader", True)), None)
        if status is None or not all(s.get("installed") for s in statuses):
            raise UnsupportedEngineError(
                "the tllm runtime was not installed in the engine: is the package installed "
                "(its vllm.general_plugins entry point 'tllm' must be visible) and not "
                "filtered out by VLLM_PLUGINS?"
            )
        return status

    def _rpc(self, method: str) -> Any:  # every rank's report, merged (docs/scaling.md)
        with self._naming_a_dead_engine():
            return merge_reports(self._workers(method))

    def _workers(self, method: str, *args: Any) -> list[Any]:
        """Every rank's answer to a tllm call; a rank's error raises ``EngineCallFailed``."""
        return checked(self.llm.collective_rpc(method, args=args))

    @contextlib.contextmanager
    def _naming_a_dead_engine(self):
        """A call on an engine with a dead process raises :class:`EngineDiedError` naming it."""
        try:
            self._watch.check()
            self._check_open()
            yield
        except Exception as e:
            vllm_says_dead = type(e).__name__ == "EngineDeadError"
            death = self._watch.wait_for_death(DEATH_NOTICE_S if vllm_says_dead else 0.0)
            if death is None:
                raise
            known = e if isinstance(e, EngineDiedError) else None
            error = e if isinstance(e, ConsumerHungError) else self._death_error(death, known)
            self._died = self._died or error  # the cause shutdown tells (tllm_run_failed)
            if error is e:
                raise
            raise error from e

    def generate(self, prompts, sampling_params=None, **kwargs):
        """``vllm.LLM.generate`` with row-localization tags (prompt index, n) added."""
        return self._run(prompts, sampling_params, chat=False, **kwargs)

    def chat(self, messages, sampling_params=None, **kwargs):
        """``vllm.LLM.chat`` (one conversation or a list of them), tagged like generate."""
        return self._run(messages, sampling_params, chat=True, **kwargs)

    def _check_open(self) -> None:
        if self._stopped:  # vLLM would say only "EngineCore encountered an issue"
            raise RuntimeError(
                "this TllmLLM is closed (close() or shutdown() stopped its engine); make a new one"
            )

    def _run(self, prompts, sampling_params, chat: bool, **kwargs):
        self._check_open()
        one = isinstance(prompts, (str, dict)) or (
            chat and len(prompts) > 0 and isinstance(prompts[0], dict)
        )
        items = [prompts] if one else list(prompts)
        if sampling_params is None:
            # As vllm.LLM does: the model's generation config (or vLLM's neutral defaults).
            sampling_params = self.llm.get_default_sampling_params()
        if isinstance(sampling_params, (list, tuple)):
            per = list(sampling_params)
            if len(per) != len(items):
                raise ValueError(
                    f"got {len(items)} prompts and {len(per)} sampling params; give one "
                    f"SamplingParams, or one per prompt"
                )
        else:
            per = [sampling_params] * len(items)
        tagged, salts = [], []
        # Only edits change KV: without edit layers, no request needs its own cache.
        edits = bool(self.status.get("edit_layers"))
        for i, sp in enumerate(per):
            # The one check of request keys the server also runs: before anything generates.
            validate_extra_args(sp.extra_args, self.consumers, where="extra_args", tags=True)
            sp = sp.clone()
            # A prompt index the caller set is kept; the sample count is always this n.
            sp.extra_args = {"tllm_prompt_index": i, **(sp.extra_args or {}), SAMPLES_KEY: sp.n}
            tagged.append(sp)
            salts.append(request_salt(sp.extra_args, can_change_kv=edits))
        self.cut_short = {}
        try:
            with self._naming_a_dead_engine():
                if chat:
                    outputs = chat_with_salts(self.llm, salts, items, tagged, **kwargs)
                else:
                    prompts = [_salted(p, s) for p, s in zip(items, salts, strict=True)]
                    outputs = self.llm.generate(prompts, tagged, **kwargs)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: stop the requests nobody waits for any more,
            # keeping the text their samples have so far.
            ids = None
            with contextlib.suppress(Exception):
                self.cut_short = texts_so_far(self.llm)
            with contextlib.suppress(Exception):
                ids = unfinished_ids(self.llm)
                # First mark them (their records then say "not finished"), then abort.
                self._workers("tllm_mark_aborted", ids)
            with contextlib.suppress(Exception):
                abort_unfinished(self.llm, ids)
            with contextlib.suppress(Exception):
                self._workers("tllm_end_batch")
            raise
        # generate() is synchronous: every request of this call is done.
        with self._naming_a_dead_engine():
            ends = self._workers("tllm_end_batch")
            if any(asked_results(sp.extra_args) for sp in tagged):
                self._attach_results(outputs, tagged)
        errors = [e for r in ends for e in (r or [])]
        self._raise_disabled(errors, outputs=outputs)
        return outputs

    def _attach_results(self, outputs: list[Any], params: list[Any]) -> None:
        """Set ``completion.tllm`` on each completion of a request that asked for results."""
        ids = [str(o.request_id) for o in outputs]
        wait = self.settings.results_wait_s
        got = merge_taken(self._workers("tllm_take_results", ids, wait))
        for out, sp in zip(outputs, params, strict=True):
            asked = asked_results(sp.extra_args)
            if not asked:
                continue
            mine = got.get(str(out.request_id), {})
            for c in out.outputs:
                c.tllm = decode_results(with_missing(asked, mine.get(str(c.index), {}), wait))

    def _raise_disabled(self, errors: list[dict[str, Any]], **where: Any) -> None:
        if self.raise_on_disabled:  # each disabled consumer once
            raise_newly_disabled(errors, self._raised, **where)

    def collect(self) -> dict[str, Any]:
        """Counters and results so far: ``runtime``, ``consumers``, ``results``, ``errors``."""
        return self._rpc("tllm_collect") if self._closed_report is None else self._closed_report

    def close(self) -> dict[str, Any]:
        """Flush consumers (exports finish writing), stop the engine processes, return the
        final report (again on later calls). ``with TllmLLM(...) as llm:`` closes at the end."""
        if self._closed_report is None:
            try:
                self._closed_report = self._rpc("tllm_close")
            finally:
                self.shutdown()
            self._raise_disabled(self._closed_report["errors"], report=self._closed_report)
        return self._closed_report

    def shutdown(self) -> None:
        """Stop the engine processes now (idempotent), not in vLLM's exit handler (which kills
        engines slower than 5 s)."""
        self._stopped = True
        self._watch.stop()  # processes that end from here on are stopped, not dead
        if self._watch.death is None:
            if self._followers_store is not None:  # before the engine (and its store) stops
                announce_stop(*self._followers_store)
                self._followers_store = None  # once
            shutdown_engine(self.llm)
        else:
            shutdown_engine(self.llm, timeout=LEFTOVER_GRACE_S)
            self._watch.clean_up()
            self._tell_run_failed()
        self._fault_note.close()

    def _death_error(self, death: Any, known: EngineDiedError | None = None) -> EngineDiedError:
        """The hung callback the engine's watchdog noted, else ``known`` or a new error."""
        hung = read_note(self._fault_note.path)
        if hung is not None:
            return ConsumerHungError(death, hung)
        return known or EngineDiedError(death)

    def _tell_run_failed(self) -> None:
        """:func:`tell_run_failed` once, when every engine process is gone after a fault."""
        if not self._failure_told:
            self._failure_told = True
            died = self._died or self._death_error(self._watch.death)
            tell_run_failed(self._checked, str(died), self._started_at)

    def __enter__(self) -> TllmLLM:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Failed or interrupted: still flush consumers if the engine answers (an export
        # stays readable), but the original error is what the caller sees.
        with contextlib.suppress(Exception):
            self.close()
        self.shutdown()
