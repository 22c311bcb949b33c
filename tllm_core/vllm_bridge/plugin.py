"""vLLM general plugin, run in every process vLLM starts: two switches that only read the
configuration, never raising (CONTRACT.md, "Installation path"); also a ``tllm`` plugin whose
``tllm_architectures`` hook describes vLLM's decoder families."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tllm_core.api.hookspecs import hookimpl
from tllm_core.runtime.environ import env_seconds
from tllm_core.runtime.start_error import record, watch_engine_start
from tllm_core.vllm_bridge.engine_settings import tllm_settings
from tllm_core.vllm_bridge.quiet import install_if_quiet

log = logging.getLogger("tllm")

_PATCHED_ATTR = "_tllm_patched"
CLI_PID_ENV = "TLLM_CLI_PID"


def register() -> None:
    if os.environ.get("TLLM_DISABLE_PLUGIN") == "1":
        return
    for setup in (command_process, _wrap_init_device, _patch_endpoint_plugins, watch_engine_start):
        try:
            setup()
        except Exception as e:  # noqa: BLE001 - never break plain vLLM from a plugin
            _not_available(setup.__name__, e)


def _not_available(what: str, e: Exception) -> None:
    log.warning(
        "tllm: %s failed (%s: %s); plain vLLM is unaffected, but tllm is not available in "
        "this process",
        what,
        type(e).__name__,
        e,
    )


def command_process() -> None:
    """Settings of processes started by the ``tllm`` command (a no-op elsewhere)."""
    cli_pid = os.environ.get(CLI_PID_ENV)
    if not cli_pid:
        return
    install_if_quiet()
    if cli_pid != str(os.getpid()) and threading.current_thread() is threading.main_thread():
        # An engine process: a terminal's Ctrl-C reaches the whole process group; the
        # command handles it (vLLM would stop the engine under the command's feet).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _stop_without(int(cli_pid))


def watch_front_end(front_end: list | tuple | None) -> None:
    """A ``TllmLLM``'s engine process stops itself once its front end, ``(pid, create_time,
    pid_space)`` from its settings, is gone, also when its pid was free before this process
    looked (a kill -9 while the engine started). Only in the front end's own pid space: not a
    same-numbered pid on another node, not this process (an in-process engine)."""
    if not front_end:
        return
    import psutil

    pid, created = int(front_end[0]), float(front_end[1])
    space = str(front_end[2]) if len(front_end) > 2 else ""  # "": unknown, act on a live one only
    if pid == os.getpid() or os.environ.get(CLI_PID_ENV) == str(pid):  # or command_process's
        return
    if space and space != pid_space():  # another node's (or container's) pid
        return
    try:
        # A second's slack: create_time adds the boot time, which moves with clock steps (a
        # larger step makes it another process: not watched, never stopped for).
        if abs(psutil.Process(pid).create_time() - created) <= 1.0:
            _stop_without(pid)
    except psutil.NoSuchProcess:
        if space:  # no such pid in its own pid space: the front end is gone
            log.warning("tllm: the TllmLLM process %d is gone; this engine process stops", pid)
            _stop_without(pid, gone=True)
    except psutil.Error:  # there, but not ours to read: cannot tell
        pass


def pid_space() -> str:
    """This machine's boot and pid namespace ("" where unknown): a pid names the same process
    only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _stop_without(pid: int, gone: bool = False) -> None:
    """SIGTERM this engine process once its front end ``pid`` (the command, a ``TllmLLM``) is
    gone without stopping it (a ``kill -9``; ``gone``: already): vLLM's
    engine core does not watch its parent, and would keep its device."""
    import psutil

    def alive(command: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):  # gone, or its pid reused: not running
            return command.is_running() and command.status() != psutil.STATUS_ZOMBIE
        return False

    def watch(command: psutil.Process | None) -> None:
        while command is not None and alive(command):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # vLLM's own stop; its workers follow
        time.sleep(env_seconds("TLLM_STOP_TIMEOUT_S", 120.0))  # a stop that hangs: the end
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        command = None if gone else psutil.Process(pid)
    except psutil.NoSuchProcess:  # gone before this process started
        command = None
    threading.Thread(target=watch, args=(command,), name="tllm-command", daemon=True).start()


@hookimpl  # tllm's own `vllm-bridge` entry point (pyproject.toml) registers this module
def tllm_architectures() -> list[object]:
    """vLLM's decoder families and the built-in tap sites (``layouts.py``)."""
    from tllm_core.vllm_bridge.layouts import ARCHITECTURES

    return list(ARCHITECTURES)


WORKER_BASE = "vllm.v1.worker.worker_base"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once, right after module ``name`` is first imported (by the
    finder that would load it anyway), then leaves ``sys.meta_path``; a spec only looked up
    (``importlib.util.find_spec``) patches nothing and leaves it in place."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        for finder in list(sys.meta_path):  # the others, in order (not through import: no loop)
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if finder is not self and find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self._patched)
                return spec
        return None

    def _patched(self, module: Any) -> None:
        # A new list, not an edit: another thread's import may be walking the old one.
        sys.meta_path = [f for f in sys.meta_path if f is not self]
        self.patch(module)


class _PatchingLoader:
    """``loader``, then ``patch`` on the module it ran (the rest asked of ``loader``)."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self.loader, self.patch = loader, patch

    def __getattr__(self, name: str) -> Any:  # create_module, get_source, ...
        return getattr(self.loader, name)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # as if never wrapped
        try:
            self.patch(module)
        except Exception as e:  # noqa: BLE001 - never break plain vLLM from a plugin
            _not_available(f"wrapping {module.__name__}", e)


def _wrap_init_device() -> None:
    """Wrap vLLM's ``WorkerWrapperBase.init_device``, once vLLM's worker module is loaded:
    importing it here would cost ~5 s in a process that never runs a worker (an API server)."""
    module = sys.modules.get(WORKER_BASE)
    if module is not None:
        _patch_init_device(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):  # register() again
        sys.meta_path.insert(0, _AfterImport(WORKER_BASE, _patch_init_device))


def _patch_init_device(module: Any) -> None:
    WorkerWrapperBase = module.WorkerWrapperBase
    orig = WorkerWrapperBase.__dict__.get("init_device")
    if orig is None:
        raise AttributeError("vllm WorkerWrapperBase has no init_device")
    if getattr(orig, _PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def init_device(self, *args, **kwargs):
        config = getattr(self, "vllm_config", None)
        settings = tllm_settings(getattr(config, "additional_config", None))
        if settings is None:
            out = orig(self, *args, **kwargs)
            _same_on_every_node(config, None)
            return out
        from tllm_core.runtime.cpus import note_allowed_cpus
        from tllm_core.vllm_bridge import worker_setup

        note_allowed_cpus()  # before vLLM pins this process's threads (side threads widen to it)
        worker_setup.before_device(settings, _nodes(config))
        out = orig(self, *args, **kwargs)
        _same_on_every_node(config, settings)
        watch_front_end(settings.get("front_end"))  # checked settings by now
        worker_setup.attach(self.worker, settings)
        return out

    setattr(init_device, _PATCHED_ATTR, True)
    WorkerWrapperBase.init_device = init_device


def _nodes(config: Any) -> int:
    return int(getattr(getattr(config, "parallel_config", None), "nnodes", 1) or 1)


def _same_on_every_node(config: Any, settings: dict | None) -> None:
    """Multi-node engines (plain ones too: a plain rank compares with a leader that has tllm):
    refuse settings that differ between the nodes, then bad ones (every node has the same)."""
    if _nodes(config) <= 1:
        return
    from tllm_core.vllm_bridge import nodes, worker_setup

    try:
        nodes.check_same_settings(config, settings)
        if settings is not None:
            worker_setup.check_settings(settings)
    except Exception as e:
        record((settings or {}).get("start_error_file"), str(e))
        raise


class EndpointGate:
    """vLLM endpoint plugin (API server only) that is inert unless the tllm switch is on."""

    name = "tllm"
    required_tasks = None

    def __init__(self) -> None:
        self.active = False
        self.engine = None  # EngineConsumers, built once in attach_router
        self.nodes = None  # the command's NodeWatch (`tllm serve`), else a new one

    def attach_router(self, app) -> None:
        cfg = tllm_settings(getattr(getattr(app.state, "args", None), "additional_config", None))
        if cfg is None:
            return
        from tllm_core.runtime.settings import RuntimeSettings
        from tllm_core.serving.keys import EngineConsumers
        from tllm_core.vllm_bridge.nodes import NodeWatch
        from tllm_core.vllm_bridge.server_entry import CHECKED
        from tllm_core.vllm_bridge.serving import attach_routes

        self.active = True
        settings = RuntimeSettings.model_validate(cfg)
        pre = CHECKED.get()
        # The command reports the lost node its NodeWatch records.
        self.nodes = pre.nodes if pre is not None else NodeWatch()
        if pre is not None and pre.settings == cfg:
            self.engine = pre.engine  # `tllm serve` checked these in this process
        else:  # `python -m vllm...api_server --additional-config ...`: the front end's check
            self.engine = EngineConsumers.from_settings(settings)
        attach_routes(
            app, self.engine, settings.server, settings.fault_file, settings.results_wait_s
        )

    async def init_state(self, engine_client, state, args) -> None:
        # vLLM calls it on the plugins it attached (CONTRACT.md); the render server has none.
        if engine_client is None:
            return
        if not self.active:
            if tllm_settings(engine_client.vllm_config.additional_config) is not None:
                raise RuntimeError(
                    "tllm: vLLM set up an endpoint plugin's state without attaching its routes "
                    "first (unsupported vLLM; see tllm_core/vllm_bridge/CONTRACT.md, Serving)"
                )
            return
        from tllm_core.vllm_bridge.serving import init_state

        await init_state(engine_client, state, self.engine, self.nodes)


def _patch_endpoint_plugins() -> None:
    """Append :class:`EndpointGate` to what ``load_endpoint_plugins`` returns, so that
    ``--additional-config`` alone is the switch (not ``VLLM_PLUGINS``)."""
    import vllm.plugins as vp

    orig = getattr(vp, "load_endpoint_plugins", None)
    if orig is None:
        raise AttributeError(
            "vllm.plugins.load_endpoint_plugins is missing: serving would run without tllm's "
            "request checks and /tllm endpoints"
        )
    if getattr(orig, _PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def load_endpoint_plugins(*args, **kwargs):
        return [*orig(*args, **kwargs), EndpointGate()]

    setattr(load_endpoint_plugins, _PATCHED_ATTR, True)
    vp.load_endpoint_plugins = load_endpoint_plugins
