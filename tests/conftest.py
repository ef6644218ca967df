"""Shared test helpers: real processes, real sockets on loopback, no mocks."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import pytest

from tests.helpers import fast_tests
from tests.helpers.fast_tests import (  # noqa: F401 - pytest's hooks: --fast (make check)
    pytest_addoption,
    pytest_ignore_collect,
    pytest_make_collect_report,
    pytest_runtest_protocol,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small batches of the seed's image size (AlexNet needs >= 195x195): 1.2 MB per float32 batch.
TINY = ["--batch-size", "2"]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": REPO,
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    for key in [k for k in env if k.startswith("STAGEFEED_")]:
        del env[key]
    env.update(extra)
    return env


def tmp_dir_of(env: dict[str, str] | None) -> str | None:
    """The temp directory a CLI process with ``env`` uses (None: this process's)."""
    return (env or {}).get("TMPDIR") or None


def cli(*args: str) -> list[str]:
    """Command line running the stagefeed CLI with this interpreter."""
    return [sys.executable, "-m", "stagefeed.cli", *args]


def free_tcp_port() -> int:
    """A loopback port nobody listens on, from below the ephemeral range. A port the OS gave
    to ``bind(0)`` is in that range, which every outgoing connection and every ``tcp://...:0``
    of the other tests draws from: one of them took a cluster worker's gRPC port during that
    worker's TensorFlow import (a fresh clone beside a CPU hog: "Could not start gRPC server").
    Below it, only another pick here can take the port."""
    low = _ephemeral_low()
    if low <= 21000:  # no room below the range on this host: the OS's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 20000-{low - 1}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def run_cli(
    args: Sequence[str], timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``stagefeed ARGS`` to completion; stdout and stderr captured as text."""
    return subprocess.run(
        cli(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=REPO,
        check=False,
    )


class Started:
    """A CLI process started in its own process group, so the test can signal all of it."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, log_path=None):
        self.env = env
        self.log_path = log_path
        self._log = open(log_path, "w+") if log_path else subprocess.PIPE  # noqa: SIM115
        self.proc = subprocess.Popen(
            cli(*args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env or cli_env(),
            cwd=REPO,
            start_new_session=True,
        )

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        if self.log_path:
            with open(self.log_path) as f:
                return f.read()
        out, _ = self.proc.communicate(timeout=30)
        return out

    def kill_group(self) -> None:
        """SIGKILL the group, then remove what a killed ``run`` leaves in the temp directory
        (its socket files: ``common.ipc_file.sweep_leftovers``), as its next run would."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        from stagefeed.common.ipc_file import sweep_leftovers

        sweep_leftovers(tmp_dir_of(self.env), only={self.proc.pid})


@pytest.fixture
def spawn(tmp_path) -> Iterator:
    """A ``tests.helpers.procs.Spawner`` logging to the test's folder; every group it started
    is ended at teardown (a module may define its own ``spawn``)."""
    from tests.helpers import procs  # it imports this module

    spawner = procs.Spawner(tmp_path)
    yield spawner
    spawner.kill_all()


@pytest.fixture
def start_cli(tmp_path) -> Iterator:
    """``start_cli(args, name=...)`` -> Started; every group is killed at teardown."""
    started: list[Started] = []

    def _start(args: Sequence[str], name: str = "proc", env: dict[str, str] | None = None):
        proc = Started(args, env=env, log_path=tmp_path / f"{name}-{len(started)}.log")
        started.append(proc)
        return proc

    yield _start
    for proc in started:
        proc.kill_group()


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def shared_process_group(item: pytest.Item) -> str | None:
    """The xdist group of ``item``: its module (its package, under ``tests/hostile_input/``)
    when it uses a module-, package- or session-scoped fixture of the suite's own (one that
    starts a trainer once for several tests), else None. Read from pytest's resolution of the
    item's fixtures, so a module that borrows another's fixture is grouped too: a hand-kept
    list missed ``test_shm_hostile_nested``'s ``live = test_shm_hostile.live``, and each worker
    that ran one of its tests started a canary trainer and three producers of its own."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's resolution, on test functions only
    if info is None:
        return None
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope != "function" and defs[-1].func.__module__.startswith("tests."):
            return os.path.relpath(str(item.path), os.path.join(REPO, "tests")).split(os.sep)[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the marks into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep what shares a started process on one xdist worker (``make test`` runs four, with
    ``--dist loadgroup``): a module's tests share its module-scoped trainers, and a package's
    (``hostile_input/``) share one trainer and run in the order its conftest sets. Every
    other test goes to whichever worker is free (a whole module on one worker left the other
    idle at the end of the run). Without xdist the mark does nothing. Under ``--fast`` (make
    check), the tests that are not fast are marked ``process`` and left out
    (tests/helpers/fast_tests.py)."""
    fast_tests.mark(config, items)
    for item in items:
        group = shared_process_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """End a failed run with why each test failed: its id, the first line of what it raised and
    where, in full. (pytest's short summary cuts that line to the terminal's width, and a CI
    log has none: a long test id leaves only the name.) A log read from the end explains itself.
    """
    failed = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
    if not failed:
        return
    terminalreporter.section("why each test failed", sep="-")
    for report in failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            first = (crash.message.strip().splitlines() or ["(no message)"])[0]
            path = str(crash.path)
            inside = path.startswith(REPO + os.sep)
            where = f"{os.path.relpath(path, REPO) if inside else path}:{crash.lineno}"
        else:  # a collection error or a skip-like report: its text's last line
            first, where = str(report.longrepr).strip().splitlines()[-1], report.location[0]
        phase = "" if report.when == "call" else f" (in {report.when})"
        terminalreporter.write_line(f"{report.nodeid}{phase}: {first[:500]}  [{where}]")


@pytest.fixture
def pair() -> Iterator:
    """A producer's ``SlotPool`` and the trainer's ``MappedPool`` of it
    (tests.helpers.shm_pairs)."""
    from tests.helpers.shm_pairs import pairs

    yield from pairs()
