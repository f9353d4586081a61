"""The fast tier's torch guard, whose hooks `tests/conftest.py` takes in (or `-p tests.torch_guard`): under
`make test-fast` (`BATCHGATE_FAST_TIER=1`) the run fails if torch was imported, and names where it first appeared:
before the session, while collecting a test module, or while running a test. Inert otherwise.

`make test-fast` runs under pytest-xdist, where a worker's session status never reaches the controller: the first
test to end with torch imported in its process fails at teardown with the message, in any process. In
`tests/conftest.py`, not `tests/unit/conftest.py`: a conftest's hooks see only the tests under its folder, and the
tier is `tests/unit` and `tests/contract`.
"""

from __future__ import annotations

import os
import sys

import pytest

FAST_TIER = os.environ.get("BATCHGATE_FAST_TIER") == "1"
_first_torch: list[str] = []  # where torch first appeared in sys.modules (one entry at most)


def _note(where: str) -> None:
    if FAST_TIER and not _first_torch and "torch" in sys.modules:
        _first_torch.append(where)


_note("before the tests were collected (a plugin or a conftest)")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note(f"collecting {report.nodeid}")


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _note(f"running {nodeid}")


_failed_one: list[bool] = []  # this process already failed a test for it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    if call.when != "teardown" or _failed_one:
        return
    _note(f"running {item.nodeid}")
    if (message := torch_message()) is not None:
        _failed_one.append(True)
        report = outcome.get_result()
        report.outcome, report.longrepr = "failed", message


def torch_message() -> str | None:
    """Why the fast tier fails, or None when it imported no torch."""
    if not FAST_TIER or "torch" not in sys.modules:
        return None
    where = _first_torch[0] if _first_torch else "somewhere in the session"
    return f"BATCHGATE_FAST_TIER: the fast tier imported torch (first seen {where}); it must stay torch-free"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if torch_message() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    message = torch_message()
    if message:
        terminalreporter.write_line(message, red=True, bold=True)
