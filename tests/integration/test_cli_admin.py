"""The operations CLI as a user meets it: `--help` names every command; `webhooks thin` prints no secret;
`keys list` with no tenant lists every tenant's key hashes (never a key); no Redis is one line."""

from __future__ import annotations

import pytest

from batchgate.cli import build_parser, main

pytestmark = [pytest.mark.redis]


def test_help_lists_every_subcommand_with_a_line(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in choices:
        line = next((raw for raw in out.splitlines() if raw.strip().startswith(name + " ")), "")
        assert len(line.split()) > 1, f"{name} has no description in --help:\n{out}"


def test_thin_on_prints_no_secret_and_keys_list_covers_every_tenant(redis_url, prefix, monkeypatch, capsys):
    monkeypatch.setenv("BATCHGATE_KEY_PREFIX", prefix)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("BATCHGATE_REDIS_URL", redis_url)
    assert main(["webhooks", "show", "--tenant", "t1"]) == 0
    secret = capsys.readouterr().out.split("signing: ")[1].split()[0]
    assert main(["webhooks", "thin", "on", "--tenant", "t1"]) == 0
    out = capsys.readouterr().out
    assert secret not in out and "on" in out
    keys = {}
    for tenant in ("t1", "t2"):
        assert main(["keys", "create", "--tenant", tenant]) == 0
        keys[tenant] = capsys.readouterr().out.strip()
    assert main(["keys", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines) == ["t1", "t2"]
    assert not any(k in "\n".join(lines) for k in keys.values())
    assert main(["keys", "list", "--tenant", "t2"]) == 0
    assert len(capsys.readouterr().out.split()) == 1


def test_unreachable_redis_is_one_line_and_exit_1(monkeypatch, capsys):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("BATCHGATE_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["keys", "list"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "redis://127.0.0.1:1/0" in err[0]
