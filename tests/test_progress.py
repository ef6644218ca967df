"""Progress: the line's content, log lines off a terminal, a rewritten line on a real pty."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import threading

import pytest

from stagefeed.consumer.observe.progress import (
    CLEAR_LINE,
    TTY_INTERVAL_S,
    Progress,
    format_line,
    size_text,
)
from tests.conftest import REPO, TINY, cli, cli_env
from tests.helpers.figures_util import window


def test_line_shows_the_issue_figures() -> None:
    f = window(
        seconds=2,
        steps=10,
        wait_s=1.0,
        step_s=3.0,
        queue_batches=3,
        capacity=434,
        per_producer={"a": 10, "b": 0},
    )
    assert format_line(f, steps_planned=100) == (
        "step 10/100  400 ms/step  10 examples/s  stall 25%  queue 3/434 (3.5 MiB)  "
        "5.9 MiB/s in  producers 1/2"
    )


def test_line_until_stopped_without_steps_and_with_drops() -> None:
    f = window(seconds=2, steps=0, dropped={"dtype": 2, "parts": 1})
    line = format_line(f, steps_planned=0)
    assert line.startswith("step 0/-  - ms/step  0 examples/s  stall -%  ")
    assert line.endswith("  dropped 3 (dtype 2, parts 1)")


def test_off_a_terminal_lines_go_to_the_log(caplog) -> None:
    stream = io.StringIO()
    progress = Progress(interval_s=7.0, stream=stream)
    assert not progress.tty and progress.interval_s == 7.0
    caplog.set_level(logging.INFO, logger="stagefeed.progress")
    progress.show(window(), steps_planned=30)
    progress.finish()
    assert [r.message for r in caplog.records] == [format_line(window(), 30)]
    assert stream.getvalue() == ""


def _read_all(master: int) -> bytes:
    """Everything written to the pty: one read may return part of it; EIO once the writer closed."""
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_on_a_terminal_the_line_is_rewritten_in_place() -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=True) as stream:
            progress = Progress(interval_s=7.0, stream=stream)
            assert progress.tty and progress.interval_s == TTY_INTERVAL_S
            progress.show(window(steps=10), steps_planned=30)
            progress.show(window(steps=20), steps_planned=30)
            progress.break_line()
            progress.finish()  # nothing left open: no second newline
        out = _read_all(master).decode()
    finally:
        os.close(master)
    first, second = format_line(window(steps=10), 30), format_line(window(steps=20), 30)
    # The pty turns "\n" into "\r\n".
    assert out == CLEAR_LINE + first + CLEAR_LINE + second + "\r\n"


@pytest.mark.slow
def test_a_real_run_on_a_terminal_shows_the_live_line() -> None:
    master, slave = os.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    proc = subprocess.Popen(
        cli("run", *TINY, "--producers", "1", "--steps", "6"),
        stdout=subprocess.PIPE,
        stderr=slave,
        env=cli_env(),
        cwd=REPO,
        start_new_session=True,
    )
    os.close(slave)
    reader = threading.Thread(target=drain, name="pty-reader")
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
        os.close(master)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, terminal[-3000:]
    lines = [part for part in terminal.split(CLEAR_LINE)[1:]]
    assert lines, terminal[-3000:]
    last = lines[-1].split("\r\n")[0]
    assert last.startswith("step 8/8  "), last
    fields = (" ms/step  ", " examples/s  ", "  stall ", "  queue ", " MiB/s in  ", "producers 1/1")
    for field in fields:
        assert field in last, last
    assert b"advice: " in stdout


def test_sizes_keep_their_digits_small_batches_included():
    """Issue 20 item 9: a text classifier's batches must not all read ``0.0 MiB``."""
    assert [size_text(m) for m in (158.0, 3.52, 0.25, 8 / 1024, 100 / 2**20, float("nan"))] == [
        "158 MiB", "3.5 MiB", "256 KiB", "8 KiB", "100 B", "- MiB",
    ]  # fmt: skip
