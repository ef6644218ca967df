"""Covers ``tests/conftest.py``'s xdist groups: every test module (or package) that shares a
started process through a module-, package- or session-scoped fixture is kept on one worker."""

from __future__ import annotations

import os
import re

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
