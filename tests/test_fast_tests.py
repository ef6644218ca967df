"""``pytest --fast`` (make check; tests/helpers/fast_tests.py): the tests that start a process are
left
out, and one the scan missed fails, naming itself, instead of running slowly."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

CONFTEST = """
from tests.helpers.fast_tests import (
    mark,
    pytest_addoption,
    pytest_ignore_collect,
    pytest_make_collect_report,
    pytest_runtest_protocol,
)


def pytest_collection_modifyitems(config, items):
    mark(config, items)
"""

TESTS = '''
import subprocess
from os import system as quietly

import pytest


def test_pure():
    assert sum(range(4)) == 6


def test_named_in_its_code():
    subprocess.run(["true"], check=True)


def _helper():
    return subprocess.run(["true"], check=True)


def test_through_a_helper_of_its_module():
    _helper()


@pytest.mark.process
def test_marked():
    quietly("true")


def test_unseen_by_the_scan():
    quietly("true")
'''


def _pytest(tmp_path, *args: str, tests: str = TESTS) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_sample.py").write_text(tests)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONPATH"] = REPO
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(tmp_path), *args, "test_sample.py"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip


def test_fast_runs_only_what_starts_no_process_and_fails_a_test_the_scan_missed(tmp_path):
    done = _pytest(tmp_path, "--fast")
    assert "1 failed, 1 passed, 3 deselected" in done.stdout, done.stdout + done.stderr
    assert "FAILED test_sample.py::test_unseen_by_the_scan" in done.stdout, done.stdout
    assert "test_sample.py::test_unseen_by_the_scan starts a process (os.system)" in done.stdout


def test_without_fast_every_test_runs(tmp_path):
    done = _pytest(tmp_path)
    assert "5 passed" in done.stdout, done.stdout + done.stderr


# What a module does when it imports one that imports TensorFlow (a stand-in: no TensorFlow).
LOADS_TENSORFLOW = """
import sys
import types

sys.modules.setdefault("tensorflow", types.ModuleType("tensorflow"))


def test_pure():
    assert True
"""


def test_fast_refuses_a_module_whose_import_loads_tensorflow(tmp_path):
    done = _pytest(tmp_path, "--fast", tests=LOADS_TENSORFLOW)
    assert done.returncode != 0, done.stdout
    assert "test_sample.py loads TensorFlow when imported" in done.stdout, done.stdout
