"""The `batchgate` command and `python -m gateway.dispatcher` as a user meets them when something is off: `--help`
and unknown arguments never start anything; options go before or after the arguments; `keys revoke --tenant T`
revokes only T's key; a bad Redis URL, a server that is not Redis, and a stale `up.json` are one line each.
No Redis here: the admin commands run against fakeredis."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest

from batchgate import cli
from batchgate.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[fakeredis.FakeServer]:
    """The admin commands' Redis: one in-memory server (each `make_redis` a client of it)."""
    server = fakeredis.FakeServer()
    monkeypatch.setattr("shared.redis_io.make_redis",
                        lambda url, **_: fakeredis.FakeAsyncRedis(server=server))
    monkeypatch.setenv("BATCHGATE_REDIS_URL", "redis://127.0.0.1:1/0")
    yield server


# --- entry points: --help and unknown arguments -------------------------------------------------------

def test_the_dispatcher_answers_help_and_refuses_unknown_arguments_without_starting(monkeypatch, capsys):
    from gateway import dispatcher

    def started(*_: object, **__: object) -> None:
        raise AssertionError("the dispatcher started")

    monkeypatch.setattr(dispatcher, "run", started)
    with pytest.raises(SystemExit) as exc:
        dispatcher.main(["--help"])
    assert exc.value.code == 0 and "usage: python -m gateway.dispatcher" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        dispatcher.main(["--redis-url", "redis://127.0.0.1:1/0"])
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.spawns
def test_python_m_gateway_dispatcher_help_exits_at_once():
    env = {**os.environ, "BATCHGATE_REDIS_URL": "redis://127.0.0.1:1/0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "gateway.dispatcher", "--help"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
    done = subprocess.run([sys.executable, "-m", "gateway.dispatcher", "extra"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unrecognized arguments: extra" in done.stderr


# --- options and positionals in any order ----------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["keys", "revoke", "--tenant", "acme", "bgk_x"], {"action": "revoke", "key": "bgk_x", "tenant": "acme"}),
    (["keys", "revoke", "bgk_x", "--tenant", "acme"], {"action": "revoke", "key": "bgk_x", "tenant": "acme"}),
    (["keys", "--tenant", "acme", "revoke", "bgk_x"], {"action": "revoke", "key": "bgk_x", "tenant": "acme"}),
    (["keys", "list"], {"action": "list", "key": None, "tenant": None}),
    (["webhooks", "thin", "--tenant", "t", "on"], {"action": "thin", "value": "on", "tenant": "t"}),
    (["webhooks", "--tenant", "t", "show"], {"action": "show", "value": None, "tenant": "t"}),
    (["tenants", "set", "--rate", "2", "acme"], {"action": "set", "tenant": "acme", "rate": 2.0}),
    (["tenants", "--burst", "3", "show", "acme"], {"action": "show", "tenant": "acme", "burst": 3}),
    (["worker", "--drain-budget", "5", "--models", "minilm"], {"drain_budget": 5.0, "models": "minilm"}),
])
def test_options_and_arguments_go_in_any_order(argv, expected):
    args = build_parser().parse_args(argv)
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize("argv", [["keys", "revoke", "a", "b"], ["keys", "frob"], ["webhooks", "thin", "maybe"],
                                  ["keys", "list", "--bogus"], ["gateway", "extra"]])
def test_what_does_not_parse_is_still_exit_2(argv, capsys):
    try:  # refused by argparse (SystemExit) or by the command's own check (its return), before any Redis
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2


def test_keys_revoke_needs_a_key_and_create_takes_none(fake_redis, capsys):
    assert main(["keys", "revoke", "--tenant", "acme"]) == 2
    assert main(["keys", "create", "bgk_x"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


# --- keys revoke --tenant ---------------------------------------------------------------------------

def test_keys_revoke_with_a_tenant_refuses_another_tenants_key(fake_redis, capsys):
    from shared.tenants import hash_key

    assert main(["keys", "create", "--tenant", "beta"]) == 0
    beta_key = capsys.readouterr().out.strip()
    for given in (hash_key(beta_key), beta_key):
        assert main(["keys", "revoke", "--tenant", "acme", given]) == 1
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and "beta" in err and "nothing revoked" in err
    assert main(["keys", "list", "--tenant", "beta"]) == 0
    assert capsys.readouterr().out.split() == [hash_key(beta_key)]  # still there
    assert main(["keys", "revoke", "--tenant", "beta", hash_key(beta_key)]) == 0  # its own tenant: revoked
    assert capsys.readouterr().out.strip() == "revoked a key of tenant beta"
    assert main(["keys", "list", "--tenant", "beta"]) == 0
    assert capsys.readouterr().out.split() == []
    assert main(["keys", "revoke", "--tenant", "beta", beta_key]) == 1  # gone
    assert capsys.readouterr().err.strip() == "batchgate: no such key"


def test_keys_revoke_without_a_tenant_still_revokes_any_key(fake_redis, capsys):
    assert main(["keys", "create", "--tenant", "beta"]) == 0
    key = capsys.readouterr().out.strip()
    assert main(["keys", "revoke", key]) == 0
    assert capsys.readouterr().out.strip() == "revoked a key of tenant beta"


# --- bad Redis URLs and servers that are not Redis ----------------------------------------------------

@pytest.mark.parametrize("argv, env", [
    (["keys", "list", "--redis-url", "garbage"], {}),
    (["tenants", "show", "acme", "--redis-url", "redis://127.0.0.1:notaport/0"], {}),
    (["keys", "list"], {"BATCHGATE_REDIS_URL": "http://x"}),
    (["gateway"], {"BATCHGATE_REDIS_URL": "http://x"}),
    (["up"], {"REDIS_URL": "garbage"}),
])
def test_a_malformed_redis_url_is_one_configuration_line_and_exit_2(argv, env, monkeypatch, capsys):
    monkeypatch.delenv("BATCHGATE_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    url = argv[-1] if "--redis-url" in argv else next(iter(env.values()))
    assert len(err) == 1 and err[0].startswith("batchgate: configuration error:") and repr(url) in err[0], err
    assert "is not a Redis URL" in err[0]


@pytest.fixture
def not_redis() -> Iterator[str]:
    """A server on loopback that answers like a web server, not like Redis."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    stop.set()
    listener.close()


def test_a_server_that_is_not_redis_is_one_line_and_exit_1(not_redis, monkeypatch, capsys):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("BATCHGATE_REDIS_URL", raising=False)
    assert main(["keys", "list", "--redis-url", not_redis]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not_redis in err[0] and "Redis" in err[0], err


def test_up_refuses_a_server_that_is_not_redis(not_redis):
    from batchgate.supervisor import redis_problem

    problem = redis_problem(not_redis)
    assert problem is not None and "not answer as Redis" in problem


# --- a stale up.json -------------------------------------------------------------------------------

@pytest.mark.spawns
def test_a_stale_state_file_is_refused_naming_it_not_replaced_by_another_redis(tmp_path, monkeypatch, capsys):
    """An `up` killed outright leaves its file: where its Redis was embedded (gone with it), the operations commands
    refuse (exit 1, one line) rather than write keys or limits to the default Redis, where that stack never looks;
    a Redis named, a live `up`'s, or the user's own Redis a dead `up` ran on, is used."""
    from batchgate.state import read_state, write_state

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv("BATCHGATE_STATE_DIR", str(tmp_path))
    for name in ("BATCHGATE_REDIS_URL", "REDIS_URL", "BATCHGATE_KEY_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    path = write_state(os.environ, {"redis_url": "redis://127.0.0.1:7777/0", "key_prefix": "upx"})
    path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {dead.pid}'))
    assert read_state(os.environ) is None
    assert cli.main(["keys", "list"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {dead.pid}" in err[0] and "not running" in err[0], err
    assert str(path) in err[0] and "--redis-url" in err[0]
    named = cli._admin_settings(build_parser().parse_args(["keys", "list", "--redis-url", "redis://127.0.0.1:7/0"]))
    assert named.redis_url == "redis://127.0.0.1:7/0" and capsys.readouterr().err == ""
    # an `up` that ran on the user's own Redis: that Redis outlives it, and still holds its data
    path.write_text(path.read_text().replace('"key_prefix"', '"redis": "external", "key_prefix"'))
    settings = cli._admin_settings(build_parser().parse_args(["keys", "list"]))
    assert (settings.redis_url, settings.key_prefix) == ("redis://127.0.0.1:7777/0", "upx")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not running; using the Redis it ran on, redis://127.0.0.1:7777/0" in err[0], err

    path.write_text(path.read_text().replace(f'"pid": {dead.pid}', f'"pid": {os.getpid()}'))  # a live one
    settings = cli._admin_settings(build_parser().parse_args(["keys", "list"]))
    assert (settings.redis_url, settings.key_prefix) == ("redis://127.0.0.1:7777/0", "upx")
    assert capsys.readouterr().err == ""
    # its Redis named outright: still its key prefix (the keys land where that stack looks); another Redis: not
    for url in ("redis://127.0.0.1:7777/0", "redis://localhost:7777", "redis://127.0.0.1:7777/"):
        assert cli._admin_settings(build_parser().parse_args(["keys", "list", "--redis-url", url])).key_prefix == "upx"
    for url in ("redis://127.0.0.1:7778/0", "redis://127.0.0.1:7777/1"):
        assert cli._admin_settings(build_parser().parse_args(["keys", "list", "--redis-url", url])).key_prefix == "bg"
    monkeypatch.setenv("BATCHGATE_KEY_PREFIX", "mine")  # a prefix set wins
    named = cli._admin_settings(build_parser().parse_args(["keys", "list", "--redis-url", "redis://127.0.0.1:7777/0"]))
    assert named.key_prefix == "mine"


# --- values the operations commands refuse -----------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["tenants", "set", "acme", "--rate", "-1"], "--rate"),
    (["tenants", "set", "acme", "--rate", "nan"], "--rate"),
    (["tenants", "set", "acme", "--rate", "inf"], "--rate"),
    (["tenants", "set", "acme", "--burst", "-3"], "--burst"),
    (["tenants", "set", "acme", "--burst", "0"], "--burst"),
    (["tenants", "set", "acme", "--max-backlog", "-1"], "--max-backlog"),
    (["tenants", "set", ""], "empty"),
    (["tenants", "show", "a b"], "'a b'"),
    (["keys", "create", "--tenant", ""], "empty"),
    (["keys", "list", "--tenant", "a:keys"], "':'"),
    (["webhooks", "show", "--tenant", ""], "empty"),
])
def test_an_invalid_limit_or_tenant_name_is_one_line_and_exit_2(argv, says, fake_redis, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("batchgate: ") and says in lines[0], err
    assert main(["tenants", "show", "acme"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["rate_per_s"], shown["burst"], shown["max_backlog"]) == (None, None, None)  # nothing was set


def test_tenants_set_prints_valid_json_with_what_it_set(fake_redis, capsys):
    assert main(["tenants", "set", "acme", "--rate", "0.5", "--burst", "2", "--max-backlog", "0"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["tenant"], shown["rate_per_s"], shown["burst"], shown["max_backlog"]) == ("acme", 0.5, 2, 0)
    # a value stored before such values were refused prints as JSON can carry it (unset), not as NaN
    fakeredis.FakeRedis(server=fake_redis).hset("bg:tenant:old", "rate_per_s", "nan")
    assert main(["tenants", "show", "old"]) == 0
    text = capsys.readouterr().out
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))["rate_per_s"] is None


# --- each operations command's --help is its own ----------------------------------------------------------

@pytest.mark.parametrize("command, words", [
    ("keys", ["create", "revoke", "list", "--tenant", "--redis-url"]),
    ("tenants", ["show", "set", "--rate", "--burst", "--max-backlog", "--thin-callbacks", "--redis-url"]),
    ("webhooks", ["show", "rotate", "drop-old", "thin", "disabled", "enable", "--tenant", "--redis-url"]),
])
def test_an_operations_commands_help_describes_its_own_actions_and_options_only(command, words, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--config" not in text and "--models" not in text and "model names to serve" not in text, text
    for word in words:
        assert word in text, f"{word} not in {command} --help:\n{text}"
    description = text.split("positional arguments:")[0].split("\n\n", 1)[1].lower()  # after the usage lines
    for action in words:
        if not action.startswith("--"):
            assert action in description, f"{action} is not described in {command} --help:\n{text}"


@pytest.mark.spawns
def test_a_stopped_worker_process_ends_with_its_exit_handlers_run_and_its_output_flushed(tmp_path):
    """`batchgate worker` ends through `quick_exit` (no interpreter teardown of torch's modules): what it printed and
    what its atexit handlers do still happen, and the exit code is the one given."""
    marker = tmp_path / "atexit"
    code = ("import atexit, sys\nfrom gpu_worker.main import quick_exit\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran'))\n"
            "sys.stdout.write('the last line, still in the buffer')\nquick_exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout == "the last line, still in the buffer", done.stderr
    assert marker.read_text() == "ran"


def test_tenants_set_for_a_tenant_without_keys_says_so(fake_redis, capsys):
    """Settings for a tenant with no API key are kept (set them before its first key), with a line on stderr: a
    mistyped name was taken in silence (an outside probe)."""
    assert main(["tenants", "set", "ghost", "--rate", "2"]) == 0
    out, err = capsys.readouterr()
    assert '"rate_per_s": 2.0' in out and "tenant 'ghost' has no API keys yet" in err
    assert "apply once it has one" not in err and "auth off" in err  # they apply without a key, where none is asked
    assert main(["keys", "create", "--tenant", "acme"]) == 0
    capsys.readouterr()
    assert main(["tenants", "set", "acme", "--rate", "2"]) == 0
    assert capsys.readouterr().err == ""


def test_a_webhook_secret_shown_for_a_tenant_without_keys_says_so(fake_redis, monkeypatch, capsys):
    """`webhooks show --tenant <typo>` made a signing secret for a tenant no key is, and said nothing."""
    monkeypatch.setenv("BATCHGATE_WEBHOOK_SECRET", "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert main(["webhooks", "show", "--tenant", "ghost"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("signing: whsec_") and "tenant 'ghost' has no API keys yet" in err
    assert main(["keys", "create", "--tenant", "acme"]) == 0
    capsys.readouterr()
    assert main(["webhooks", "show", "--tenant", "acme"]) == 0
    assert capsys.readouterr().err == ""
