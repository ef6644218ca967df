"""What a killed run leaves, and a ``--save`` typo (issue 28), through the real CLI.

A ``run`` killed with SIGKILL leaves its control socket ``TMP/stagefeed-PID.sock`` and its
pool socket's directory ``TMP/stagefeed-shm-PID/``; the next ``run`` on the host sweeps them
(only ``run``'s own names, only of processes that are gone, sockets nobody listens on) and
says so in one line. A ``--save`` whose parent does not exist is created, said in one line.

Covers common/ipc_file.py (``sweep_leftovers``) and common/paths.py. Each test has a short
private temp directory (``TMPDIR``; a Unix socket path is at most 107 bytes).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import Started, cli_env, run_cli
from tests.helpers.procs import log_text, wait_log

# The tiny regression (tests/helpers/regression_models.py): what a run leaves, and its --save,
# do not depend on the model, and AlexNet's --save writes some 60 million weights a run.
REGRESSION = [
    "--schema", "tests.helpers.regression_models:SCHEMA",
    "--model", "tests.helpers.regression_models:linear_fn",
    "--source", "tests.helpers.regression_models:sums",
]  # fmt: skip
QUICK = ["run", *REGRESSION, "--producers", "1", "--steps", "1", "--warmup-steps", "0",
         "--progress-s", "100"]  # fmt: skip
KILLED = ["run", *REGRESSION, "--producers", "1", "--steps", "0", "--rate", "5",
          "--progress-s", "100"]  # fmt: skip
TIMEOUT_S = 180


@pytest.fixture
def tmpdir_env():
    folder = tempfile.mkdtemp(prefix="sf-", dir="/tmp")
    yield folder, cli_env(TMPDIR=folder)
    shutil.rmtree(folder, ignore_errors=True)


def _ours(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("stagefeed-"))


def _swept_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "swept what killed runs left" in line]


def test_a_run_killed_with_sigkill_leaves_its_sockets_and_the_next_run_sweeps_them(
    tmpdir_env, tmp_path
):
    folder, env = tmpdir_env
    killed = Started(KILLED, env=env, log_path=tmp_path / "killed.log")
    if not wait_log(killed, r"producers -> ipc://", TIMEOUT_S):
        killed.kill_group()
        pytest.fail(log_text(killed)[-3000:])
    os.killpg(killed.proc.pid, signal.SIGKILL)  # not kill_group: it sweeps too
    killed.proc.wait(30)
    pid = killed.proc.pid
    left = [f"stagefeed-{pid}.sock", f"stagefeed-shm-{pid}"]
    assert _ours(folder) == left, _ours(folder)

    done = run_cli(QUICK, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_swept_lines(done.stderr)) == 1, done.stderr[-3000:]
    assert _swept_lines(done.stderr)[0].endswith(
        f"swept what killed runs left in {folder}: stagefeed-{pid}.sock, stagefeed-shm-{pid}/"
    )
    assert _ours(folder) == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _socket_file(path: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.bind(path)
    return sock


def test_the_sweep_leaves_live_runs_foreign_names_and_non_sockets_alone(tmpdir_env):
    folder, env = tmpdir_env
    dead = _dead_pid()
    live = _socket_file(os.path.join(folder, f"stagefeed-{os.getpid()}.sock"))
    live.listen(1)  # a live run's socket (this process stands in for it)
    _socket_file(os.path.join(folder, f"stagefeed-{dead}.sock")).close()  # a killed run's
    os.mkdir(os.path.join(folder, f"stagefeed-shm-{dead}"), 0o700)
    _socket_file(os.path.join(folder, f"stagefeed-shm-{dead}", "pools.sock"),
                 socket.SOCK_SEQPACKET).close()  # fmt: skip
    kept = [f"stagefeed-{dead}.sock.bak", f"stagefeed-bench-{dead}.sock"]
    for name in kept:
        _socket_file(os.path.join(folder, name)).close()
    with open(os.path.join(folder, f"stagefeed-{dead}0.sock"), "w"):  # not a socket
        kept.append(f"stagefeed-{dead}0.sock")
    try:
        done = run_cli(QUICK, timeout=TIMEOUT_S, env=env)
    finally:
        live.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split("left in ")[1] for line in _swept_lines(done.stderr)] == [
        f"{folder}: stagefeed-{dead}.sock, stagefeed-shm-{dead}/"
    ]
    assert _ours(folder) == sorted([f"stagefeed-{os.getpid()}.sock", *kept])


def test_a_save_whose_parent_does_not_exist_is_created_and_said_in_one_line(tmp_path):
    save = tmp_path / "typo" / "deeper" / "save"
    done = run_cli([*QUICK, "--save", str(save)], timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "did not exist" in line]
    assert len(said) == 1 and said[0].endswith(
        f"--save {str(save)!r}: {tmp_path / 'typo'} did not exist: created, with the folders "
        "below it (a typo?)"
    ), done.stderr[-3000:]
    assert (save / "state.json").is_file()
    quiet = run_cli([*QUICK, "--save", str(tmp_path / "fresh")], timeout=TIMEOUT_S)
    assert quiet.returncode == 0 and "did not exist" not in quiet.stderr, quiet.stderr[-3000:]
