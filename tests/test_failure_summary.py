"""A failed ``make test`` says why in its last lines: ``conftest.pytest_terminal_summary``."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import cli_env

FAILING = '''
import pytest

def test_a_name_long_enough_to_fill_the_whole_width_of_a_terminal_line_in_the_short_summary():
    assert {"trained": 3} == {"trained": 4}, "the books disagree"

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_with_a_broken_fixture(broken):
    pass
'''


def test_the_last_lines_name_each_failed_test_and_its_first_assertion(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_terminal_summary\n")
    (tmp_path / "test_failing.py").write_text(FAILING)
    # Without CI's variables: there pytest prints whole messages in its short summary (so the
    # lines below are last but one section); the hook matters where it cuts them.
    env = {k: v for k, v in cli_env().items() if k not in ("CI", "BUILD_NUMBER", "PYTEST_ADDOPTS")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    tail = done.stdout.strip().splitlines()[-8:]
    assert any(
        "test_a_name_long_enough" in line and "AssertionError: the books disagree" in line
        and "test_failing.py:5" in line for line in tail
    ), tail  # fmt: skip
    assert any(
        "test_with_a_broken_fixture (in setup): RuntimeError: the fixture broke" in line
        for line in tail
    ), tail
