"""Covers ``tests/conftest.py``'s xdist groups: every test that shares a started process
through a module-, package- or session-scoped fixture of the suite is kept on one worker with
the rest of its module (package), and the installed pytest and xdist honour such a group."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

# Prints each collected test's xdist group ("-" for none) after the conftest marked them.
REPORT_GROUPS = '''
def pytest_collection_finish(session):
    for item in session.items:
        groups = [mark.args[0] for mark in item.iter_markers("xdist_group")]
        print("group", item.nodeid, ",".join(groups) or "-", sep="\\t")
'''


def _groups(tmp_path, *paths: str) -> dict[str, str]:
    (tmp_path / "report_groups.py").write_text(REPORT_GROUPS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "report_groups", *paths],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("\t")[1:] for line in done.stdout.splitlines() if line.startswith("group\t")]
    return {nodeid: group for nodeid, group in rows}


def test_a_module_is_grouped_when_its_tests_share_a_fixture_of_the_suites_own(tmp_path) -> None:
    groups = _groups(tmp_path, "tests/test_shm_hostile.py", "tests/test_shm_hostile_nested.py",
                     "tests/hostile_input/test_arrays.py", "tests/test_leftovers.py")  # fmt: skip
    by_file: dict[str, set[str]] = {}
    for nodeid, group in groups.items():
        by_file.setdefault(nodeid.split("::")[0], set()).add(group)
    assert by_file == {
        "tests/test_shm_hostile.py": {"test_shm_hostile.py"},
        # Borrows test_shm_hostile's module fixture (``live = test_shm_hostile.live``): a module
        # fixture of its own, so a group of its own.
        "tests/test_shm_hostile_nested.py": {"test_shm_hostile_nested.py"},
        # The package's one trainer (hostile_input/conftest.py, scope="package").
        "tests/hostile_input/test_arrays.py": {"hostile_input"},
        # tmp_path_factory (pytest's, session-scoped) starts nothing: no group.
        "tests/test_leftovers.py": {"-"},
    }, groups


GROUPED = '''
import os
import pytest

@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("case", range(8))
def test_case(case):
    with open(os.path.join(os.path.dirname(__file__), f"worker-{case}"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
'''


def test_the_installed_pytest_and_xdist_keep_a_group_on_one_worker(tmp_path) -> None:
    # pytest 9.2 with xdist 3.8 dropped every group silently (pytest-dev/pytest-xdist#1386): each
    # worker then started its own copy of a module's shared trainers (pyproject.toml: pytest<9.2).
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = {path.read_text() for path in tmp_path.glob("worker-*")}
    assert len(list(tmp_path.glob("worker-*"))) == 8 and len(workers) == 1, workers
