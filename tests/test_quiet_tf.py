"""TensorFlow's load-time lines through ``consumer/quiet_tf``: what reaches stderr at each
``TF_CPP_MIN_LOG_LEVEL``, written to the real file descriptor 2 as TensorFlow's C++ does.

The end-to-end checks (a real trainer and the public API, oneDNN forced on) are in
``test_run_length.py``.
"""

from __future__ import annotations

import os

import pytest

from stagefeed.consumer.quiet_tf import StartupLineFilter, filtered_stderr, min_log_level

NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = b"I0000 00:00:1796174725.055525    3285 port.cc:153] oneDNN custom operations are on."
ONEDNN_AGAIN = b"I0000 00:00:1796174729.882551    3285 port.cc:153] oneDNN custom operations are on."  # noqa: E501
WARNED = b"W0000 00:00:1796174730.000001    3285 cuda_dnn.cc:8] no GPU"
FAILED = b"E0000 00:00:1796174730.000002    3285 loader.cc:7] could not load libfoo.so"
PLAIN = b"a line of the program's own"
LOAD_TIME = [NOTICE, ONEDNN, PLAIN, NOTICE, ONEDNN_AGAIN, WARNED, FAILED, FAILED]


def write_through(level: int, lines: list[bytes], capfd) -> list[str]:
    with filtered_stderr(StartupLineFilter(level)):
        for line in lines:
            os.write(2, line + b"\n")
    return capfd.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        (0, [NOTICE, ONEDNN, PLAIN, WARNED, FAILED]),
        (1, [PLAIN, WARNED, FAILED]),
        (2, [PLAIN, FAILED]),
        (3, [PLAIN]),
    ],
)
def test_each_level_drops_what_it_hides_and_every_repeat(level, shown, capfd):
    assert write_through(level, LOAD_TIME, capfd) == [line.decode() for line in shown]


def test_a_line_split_across_writes_and_a_last_line_without_newline_pass_whole(capfd):
    with filtered_stderr(StartupLineFilter(2)):
        os.write(2, ONEDNN[:20])
        os.write(2, ONEDNN[20:] + b"\n" + PLAIN[:5])
        os.write(2, PLAIN[5:])
    assert capfd.readouterr().err == PLAIN.decode()


def test_stderr_is_the_same_file_again_afterwards(capfd):
    before = os.fstat(2)
    write_through(2, [PLAIN], capfd)
    after = os.fstat(2)
    assert (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino)
    os.write(2, ONEDNN + b"\n")  # no filter any more
    assert capfd.readouterr().err == ONEDNN.decode() + "\n"


@pytest.mark.parametrize(("value", "level"), [(None, 0), ("2", 2), ("3", 3), ("loud", 0)])
def test_the_level_is_read_as_tensorflow_reads_it(value, level):
    environ = {} if value is None else {"TF_CPP_MIN_LOG_LEVEL": value}
    assert min_log_level(environ) == level
