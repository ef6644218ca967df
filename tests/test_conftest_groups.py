"""Covers ``tests/conftest.py``'s xdist groups: every test module (or package) that shares a
started process through a module-, package- or session-scoped fixture is kept on one worker,
and the installed pytest and xdist honour such a group."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO, SHARED_PROCESS_GROUPS

SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](module|package|session)["']""")


def test_every_module_with_a_shared_fixture_is_one_xdist_group() -> None:
    tests = os.path.join(REPO, "tests")
    shared = set()
    for folder, _, files in os.walk(tests):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                if SHARED_SCOPE.search(f.read()):
                    shared.add(os.path.relpath(path, tests).split(os.sep)[0])
    shared.discard("compose")  # tests/compose runs under `make test-compose`, not xdist
    assert shared <= SHARED_PROCESS_GROUPS, sorted(shared - SHARED_PROCESS_GROUPS)


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
