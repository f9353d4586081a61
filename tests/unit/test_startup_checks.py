"""What a part checks on the machine as it starts (shared/startup_checks.py) and how the `batchgate` command
reports it: a port out of range or in use, a negative --drain-budget, an unusable files directory; each one line
naming the setting, exit status 2, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchgate.cli import main
from shared.config import Settings
from shared.errors import ConfigError
from shared.startup_checks import (
    check_file_store,
    files_dir_problem,
    host_problem,
    listen_problem,
    start_metrics_server,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket listens on (127.0.0.1 only)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# --- ports ------------------------------------------------------------------------------------------------------

def test_a_port_in_use_is_named_as_such(busy_port):
    assert listen_problem("127.0.0.1", busy_port) == f"127.0.0.1:{busy_port} is in use by another process"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert listen_problem("127.0.0.1", free) is None


def test_a_host_that_does_not_resolve_is_named(monkeypatch):
    def unknown(*_: object, **__: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    assert "'nowhere' is not a host name or address" in (host_problem("nowhere") or "")


def test_a_metrics_port_in_use_is_a_config_error_naming_the_variable(busy_port):
    with pytest.raises(ConfigError) as exc:
        start_metrics_server("BATCHGATE_WORKER_METRICS_PORT", busy_port)
    assert str(exc.value) == (f"BATCHGATE_WORKER_METRICS_PORT={busy_port}: 127.0.0.1:{busy_port} is in use by another "
                              "process; choose another port, or 0 for no /metrics listener")


@pytest.mark.parametrize("argv, says", [
    (["gateway", "--port", "83737"], "--port must be between 1 and 65535 (got 83737)"),
    (["gateway", "--port", "-1"], "--port must be between 1 and 65535 (got -1)"),
    (["gateway", "--port", "0"], "--port must be between 1 and 65535 (got 0)"),
    (["up", "--port", "70000"], "--port must be between 0 and 65535 (got 70000); 0 picks a free port"),
    (["worker", "--drain-budget", "-5"], "--drain-budget (seconds to finish the work in flight on SIGTERM) must be "
                                         ">= 0 (got -5)"),
    (["worker", "--drain-budget", "inf"], "must be a finite number >= 0 (got inf)"),
])
def test_a_bad_option_is_one_line_and_exit_2(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchgate: configuration error: ") and says in err and len(err.splitlines()) == 1


def test_the_gateway_needs_a_real_port(monkeypatch, capsys):
    monkeypatch.setenv("BATCHGATE_PORT", "0")
    assert main(["gateway"]) == 2
    assert "BATCHGATE_PORT must be between 1 and 65535 for `batchgate gateway` (got 0)" in capsys.readouterr().err


def test_a_gateway_port_in_use_is_refused_before_it_starts(busy_port, capsys):
    assert main(["gateway", "--host", "127.0.0.1", "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {busy_port}: 127.0.0.1:{busy_port} is in use by another process" in err


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "BATCHGATE_REDIS_URL": "redis://127.0.0.1:1/0", **env}
    return subprocess.run([sys.executable, "-m", "batchgate", *argv], env=full, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.spawns
def test_the_command_exits_2_without_a_traceback(busy_port):
    """As a user runs it: the gateway's port and the worker's metrics port in use (an echo model: no torch)."""
    done = _run(["gateway", "--host", "127.0.0.1", "--port", str(busy_port)])
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"--port {busy_port}" in done.stderr
    done = _run(["worker"], BATCHGATE_WORKER_METRICS_PORT=str(busy_port), BATCHGATE_MODELS="echo",
                BATCHGATE_MODEL__ECHO__TASK="generate", BATCHGATE_MODEL__ECHO__KIND="echo")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"batchgate: configuration error: BATCHGATE_WORKER_METRICS_PORT={busy_port}: ")
    done = _run(["gateway", "--port", "83737"])
    assert done.returncode == 2 and done.stderr.strip() == \
        "batchgate: configuration error: --port must be between 1 and 65535 (got 83737)"


# --- the files directory ----------------------------------------------------------------------------------------

def test_an_unusable_files_directory_is_named(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert files_dir_problem(str(a_file)) == f"{a_file} is not a directory"
    assert files_dir_problem(str(a_file / "sub")) == f"cannot write in {a_file / 'sub'} (Not a directory)"
    fine = tmp_path / "new" / "files"
    assert files_dir_problem(str(fine)) is None and fine.is_dir() and not list(fine.iterdir())


def test_a_files_directory_without_write_permission_is_named(tmp_path, monkeypatch):
    def refused(self: Path, data: bytes) -> int:  # root may write anywhere: stand in for a read-only directory
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_bytes", refused)
    with pytest.raises(ConfigError) as exc:
        check_file_store(Settings(files_dir=str(tmp_path)).validate())
    assert str(exc.value) == (f"BATCHGATE_FILES_DIR={tmp_path}: cannot write in {tmp_path} (Permission denied); name "
                              "a directory this process can write, or a bucket with BATCHGATE_FILES_S3_BUCKET")
    import shared.startup_checks as checks

    asked: list[str] = []
    monkeypatch.setattr(checks, "s3_bucket_problem", lambda client, bucket: asked.append(bucket))
    check_file_store(Settings(files_dir=str(tmp_path), files_s3_bucket="b").validate())  # S3: no directory
    assert asked == ["b"]  # the bucket is checked instead (tests/unit/test_files.py)


def test_the_gateway_and_batch_runner_refuse_an_unusable_files_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("BATCHGATE_FILES_DIR", str(tmp_path / "f"))
    assert main(["batches"]) == 2
    assert f"BATCHGATE_FILES_DIR={tmp_path / 'f'}: {tmp_path / 'f'} is not a directory" in capsys.readouterr().err


def test_a_worker_refuses_a_model_cache_it_cannot_build_the_built_ins_in(tmp_path, monkeypatch, capsys):
    """One line naming BATCHGATE_MODEL_CACHE and exit 2, not the model loader's traceback; a worker of its own
    models (read where they are) does not need it."""
    from shared.startup_checks import check_model_cache

    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("BATCHGATE_MODEL_CACHE", str(tmp_path / "f" / "models"))
    monkeypatch.setenv("BATCHGATE_MODELS", "tiny-llama")
    assert main(["worker"]) == 2
    err = capsys.readouterr().err
    assert f"BATCHGATE_MODEL_CACHE={tmp_path / 'f' / 'models'}: cannot write in" in err and "Traceback" not in err
    echo = Settings.from_environ({"BATCHGATE_MODEL_CACHE": str(tmp_path / "f" / "models"),
                                  "BATCHGATE_CONFIG_YAML": "models:\n  - {name: e, task: generate, kind: echo}\n"})
    check_model_cache(echo)  # no built-in: nothing to build, nothing refused


def test_a_gateway_refuses_a_tokenizer_path_that_holds_none(tmp_path, monkeypatch, capsys):
    """Else the gateway would count no tokens and leave every limit to the workers, with an info line only."""
    monkeypatch.setenv("BATCHGATE_CONFIG_YAML", "models:\n  - {name: m, task: generate, kind: echo, "
                                                "tokenizer: /nonexistent/tokenizer.json}\n")
    from shared.embedded_redis import free_port

    monkeypatch.setenv("BATCHGATE_PORT", str(free_port()))
    assert main(["gateway"]) == 2
    err = capsys.readouterr().err
    assert "model m: tokenizer '/nonexistent/tokenizer.json': no tokenizer.json there" in err, err
    from shared.startup_checks import check_tokenizers

    (tmp_path / "tokenizer.json").write_text("{}")
    for where in (tmp_path, tmp_path / "tokenizer.json"):  # a directory holding one, or the file
        check_tokenizers(Settings.from_environ({"BATCHGATE_CONFIG_YAML": "models:\n  - {name: m, task: generate, "
                                                f"kind: echo, tokenizer: '{where}'}}\n"}))


def test_a_host_that_is_not_this_machines_is_blamed_not_the_port(monkeypatch, capsys):
    from shared.embedded_redis import free_port

    monkeypatch.setenv("BATCHGATE_HOST", "192.0.2.1")  # TEST-NET-1: no machine's own address
    monkeypatch.setenv("BATCHGATE_PORT", str(free_port()))
    assert main(["gateway"]) == 2
    err = capsys.readouterr().err
    assert "BATCHGATE_HOST=192.0.2.1: 192.0.2.1 is not an address of this machine" in err, err


def test_up_refuses_a_taken_port_before_it_loads_anything(busy_port, capsys):
    """Named as the caller gave it (`--port`), at once, not after the whole stack loaded."""
    assert main(["up", "--host", "127.0.0.1", "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {busy_port}: 127.0.0.1:{busy_port} is in use by another process" in err, err


def test_a_read_only_model_cache_with_the_built_ins_built_already_is_fine(tmp_path, monkeypatch):
    """An image with tiny-llama built in, on a read-only mount: only read, so not refused; minilm (packaged) never
    needs the cache."""
    import shared.startup_checks as checks
    from shared.token_limits import model_dir

    monkeypatch.setattr(checks, "files_dir_problem", lambda directory: "read-only file system")
    settings = Settings.from_environ({"BATCHGATE_MODEL_CACHE": str(tmp_path), "BATCHGATE_MODELS": "tiny-llama"})
    with pytest.raises(ConfigError):
        checks.check_model_cache(settings)  # not built: it must be written
    built = model_dir(settings.models[0], str(tmp_path))
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    checks.check_model_cache(settings)
    checks.check_model_cache(Settings.from_environ({"BATCHGATE_MODEL_CACHE": str(tmp_path / "none"),
                                                    "BATCHGATE_MODELS": "minilm"}))
