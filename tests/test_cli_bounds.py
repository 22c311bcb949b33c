"""Engine and sampling options out of range are errors naming the value (issue 26), not
values vLLM or tllm silently replaces."""

from __future__ import annotations

import re

import pytest

from tllm_core.app.cli import build_parser


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
        (["run", "--max-num-batched-tokens", "-3"], "--max-num-batched-tokens: must be >= 1"),
        (
            ["run", "--top-k", "-5"],
            "argument --top-k: must be >= 0, got -5; allowed: int, >= 0 (0 disables top-k)",
        ),
        (["run", "--top-k", "x"], "argument --top-k: must be a whole number, got 'x'"),
        (["export", "--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
        (["run", "-n", "1.5"], "argument -n: must be a whole number, got '1.5'"),
        (
            ["steer", "compute", "--kv-cache-gib", "0"],
            "argument --kv-cache-gib: must be >= 1, got 0",
        ),
        (["steer", "compute", "--max-model-len", "-1"], "argument --max-model-len: must be >= 1"),
        (["serve", "--port", "70000"], "argument --port: must be <= 65535, got 70000"),
        (
            ["run", "--dtype", "foo"],
            "argument --dtype: invalid choice: 'foo' (choose from 'auto', 'bfloat16'",
        ),
        (["serve", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["serve", "--port", "0"], "argument --port: must be >= 1, got 0"),  # vLLM: any port
        # A setting in bytes given in MiB or KiB: its bounds in the flag's unit, the value as
        # typed (they were in bytes: "<= 2147483648, got 4294967296 (4096 x 1048576)").
        (
            ["serve", "--max-body-mib", "0"],
            "argument --max-body-mib: max_body_bytes in MiB must be >= 1, got 0; "
            "allowed: int, >= 1, <= 2048\n",
        ),
        (["serve", "--max-body-mib", "-1"], "max_body_bytes in MiB must be >= 1, got -1;"),
        (["serve", "--max-body-mib", "4096"], "max_body_bytes in MiB must be <= 2048, got 4096;"),
        (["serve", "--max-body-mib", "x"], "in MiB must be a whole number, got 'x'; allowed: int,"),
        (
            ["serve", "--max-result-kib", "3000000"],
            "argument --max-result-kib: max_result_bytes in KiB must be <= 2097152, got 3000000; "
            "allowed: int, >= 1, <= 2097152\n",
        ),
    ],
)
def test_out_of_range_options_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_in_range_options_reach_the_engine_unchanged():
    from tllm_core.app.cli_common import engine_kwargs

    args = build_parser().parse_args(["run", "--max-num-seqs", "1", "--top-k", "5"])
    assert engine_kwargs(args)["max_num_seqs"] == 1 and args.top_k == 5
    assert "max_num_seqs" not in engine_kwargs(build_parser().parse_args(["run"]))


def test_export_layers_entry_that_is_no_number_is_named():
    from consumers.export.consumer import ExportConfig

    ExportConfig(out="o", layers=["3", "-1", "final", "attn.2"])  # as `--layers` passes them
    with pytest.raises(ValueError, match="'--1'") as info:
        ExportConfig(out="o", layers=["--1"])
    assert "invalid literal" not in str(info.value)


def test_json_report_is_strict_json_with_nan_figures(capsys):
    import json

    from tllm_core.app.cli_common import print_report

    report = {"runtime": {}, "consumers": {"stats": {"mean": float("nan")}}, "results": {}}
    report["results"]["stats"] = {"loss": [float("inf"), 1.0]}
    print_report(["p"], [["t"]], report, as_json=True)
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(c))
    assert out["results"]["stats"]["loss"] == ["Infinity", 1.0]


def test_quiet_sets_logging_only_and_the_engine_environment_is_set_apart(monkeypatch):
    """``quiet`` quiets; the engine processes' settings (command pid, worker shutdown time,
    KV cache size, preload) come from ``prepare_engine_processes``, with ``--kv-cache-gib``."""
    import os

    from tllm_core import cli_common

    names = ("TLLM_CLI_PID", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setattr(os, "environ", {**os.environ, "TLLM_NO_PRELOAD": "1"})  # a copy
    for k in names:
        os.environ.pop(k, None)
    args = build_parser().parse_args(["run", "-v", "--kv-cache-gib", "3"])  # -v: no filters
    cli_common.quiet(args)
    assert not any(k in os.environ for k in names)
    cli_common.prepare_engine_processes(args)
    assert [os.environ[k] for k in names] == [str(os.getpid()), "30", "3"]
    del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    cli_common.set_cpu_kv_cache(None)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"


@pytest.mark.parametrize("command", ["run", "serve", "export"])
def test_a_model_folder_without_config_json_is_named_before_anything_starts(
    command, tmp_path, capsys, restored_environ
):
    """One check for ``--model`` on every command (and a clear error from ``TllmLLM``), not a
    ``FileNotFoundError`` traceback from the dry build."""
    from tllm_core.app.cli import main
    from tllm_core.app.engine import TllmLLM

    extra = ["--out", str(tmp_path / "exp"), "--layers", "0"] if command == "export" else []
    assert main([command, "--model", str(tmp_path / "none"), *extra]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main([command, "--model", str(tmp_path), *extra]) == 2
    assert f"--model {str(tmp_path)!r} has no config.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no config.json"):
        TllmLLM(str(tmp_path), ["stats"])


@pytest.mark.parametrize(
    "host, why",
    [
        ("not..a..host", "is not a host name or IP address"),
        ("999.1.1.1", "is not a host name or IP address"),
        ("192.0.2.1", "is not an address of this machine"),  # TEST-NET-1: no machine's own
    ],
)
def test_a_serve_host_it_cannot_listen_on_is_refused_before_the_engine(capsys, host, why):
    """``--host`` went to vLLM unchecked: a bad one failed in its bind, after the engine had
    loaded (a minute). Refused when parsed, naming the value and what is allowed; a ``--host``
    after ``--`` (vLLM's, which wins) by the same check, before the engine too."""
    from tllm_core.app.cli_common import CliError
    from tllm_core.app.serve_command import listen_host

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--host", host])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --host: {host!r} {why} (" in err, err
    assert "; allowed: an IP address or name of this machine" in err
    with pytest.raises(CliError, match=f"^--host: {re.escape(repr(host))} {why}"):
        listen_host(build_parser().parse_args(["serve", "--", f"--host={host}"]))


def test_a_serve_host_the_resolver_never_answers_for_is_refused_within_the_bound(
    capsys, monkeypatch
):
    """A name lookup that hangs (a resolver that does not answer) ends at HOST_LOOKUP_S with
    the value named, not when the resolver gives up."""
    import threading

    from tllm_core.app import cli_common

    never = threading.Event()
    monkeypatch.setattr(cli_common, "HOST_LOOKUP_S", 0.5)

    def hangs(*args, **kwargs):
        never.wait(60)
        raise OSError("the resolver gave up")  # after the test: no real lookup

    monkeypatch.setattr(cli_common.socket, "getaddrinfo", hangs)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--host", "slow.example"])
    never.set()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "'slow.example' was not resolved within 0.5 s" in err, err
    # A lookup that fails unexpectedly is said at once, not taken for a silent resolver.
    monkeypatch.setattr(cli_common, "HOST_LOOKUP_S", 30.0)
    monkeypatch.setattr(cli_common.socket, "getaddrinfo", lambda *a, **k: 1 / 0)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--host", "odd.example"])
    err = capsys.readouterr().err
    assert "'odd.example' could not be looked up (ZeroDivisionError" in err, err


def test_a_serve_host_of_this_machine_is_listened_on_and_named_in_its_url():
    from tllm_core.app.serve_command import listen_host, server_url

    for host in ("127.0.0.1", "localhost", "0.0.0.0", ""):
        assert listen_host(build_parser().parse_args(["serve", "--host", host])) == host
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--", "--host", "localhost"])
    assert listen_host(args) == "localhost"  # vLLM's --host wins: the URL names it
    assert server_url("0.0.0.0", 8000) == server_url("", 8000) == "http://127.0.0.1:8000"
    assert server_url("::", 80) == "http://[::1]:80" and server_url("::1", 80) == "http://[::1]:80"


@pytest.mark.parametrize("extra", [["--host"], ["--host", "--port", "8001"], ["--nnodes"]])
def test_a_vllm_flag_after_the_separator_without_its_value_is_named(extra):
    """``tllm serve -- --host`` read the missing value as "" (every interface)."""
    from tllm_core.app.cli_common import CliError
    from tllm_core.app.serve_command import followers_store, listen_host

    args = build_parser().parse_args(["serve", "--", *extra])
    with pytest.raises(CliError, match=f"^{extra[0]} \\(after --\\) expects a value, got none$"):
        listen_host(args) if extra[0] == "--host" else followers_store(extra)


def test_a_seed_past_vllms_bound_is_refused_at_parsing(capsys):
    """vLLM takes seeds in [-2**63, 2**64 - 1]; a larger one failed in the engine, after its
    start (the run ended as an engine death)."""
    assert build_parser().parse_args(["run", "--seed", str(2**64 - 1)]).seed == 2**64 - 1
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "--seed", "99999999999999999999"])
    assert e.value.code == 2
    assert "<= 18446744073709551615, got 99999999999999999999" in capsys.readouterr().err


def test_a_port_given_after_the_separator_is_the_one_named_and_checked():
    """``tllm serve -- --port 9000``: vLLM listens on 9000, so that is where the command
    says it is ready and reads its counters; a bad one is refused naming it."""
    from tllm_core.app.cli_common import CliError
    from tllm_core.app.serve_command import listen_port

    parse = build_parser().parse_args
    assert listen_port(parse(["serve", "--port", "8001"])) == 8001
    assert listen_port(parse(["serve", "--port", "8001", "--", "--port", "9000"])) == 9000
    assert listen_port(parse(["serve", "--", "--port=9001"])) == 9001
    with pytest.raises(CliError, match="--port: .*70000"):
        listen_port(parse(["serve", "--", "--port", "70000"]))


def test_a_steer_vector_out_that_is_a_folder_is_refused_before_the_run(tmp_path):
    from consumers.steer.command import check_out

    (tmp_path / "v.npy").mkdir()
    with pytest.raises(ValueError, match="is a directory; give a file name"):
        check_out(tmp_path / "v.npy")


def test_a_model_cache_folder_that_cannot_be_made_is_named(tmp_path, monkeypatch):
    """``TLLM_CACHE_DIR`` under a file: a one-line error naming the folder, not a traceback."""
    from tllm_core.app import default_model

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TLLM_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(default_model.DefaultModelUnavailable, match="cannot be made.*TLLM_CACHE"):
        default_model.default_model_path()


def test_what_killed_conversions_left_is_removed_before_the_next(tmp_path):
    from tllm_core.app import default_model

    left = tmp_path / f".{default_model.MODEL_DIRNAME}.tmp-abc123"
    (left / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    assert default_model.remove_stale_conversions(tmp_path) == [left]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_a_prompts_file_that_is_not_utf8_is_named(tmp_path):
    from tllm_core.app.cli_common import read_prompt_file

    bad = tmp_path / "p.txt"
    bad.write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match=r"--prompts file .*p.txt is not UTF-8 text \(byte 3"):
        read_prompt_file(bad, "--prompts file")
