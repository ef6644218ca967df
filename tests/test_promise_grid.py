"""The promise matrix's shape (tests/matrix/grid.py), without running it: every cell of every
promise and path is checked by a scenario or listed as not applying, with its reason, and
docs/guarantees.md shows the matrix as it is. A new path (a column) fails here until each of
its rows is one or the other; ``make test-matrix`` runs the cells."""

from __future__ import annotations

import fnmatch
import os

import pytest

from tests.conftest import REPO
from tests.matrix import grid, paths


@pytest.mark.parametrize("row", list(grid.PROMISES))
def test_every_cell_of_a_promise_is_checked_or_has_a_reason(row):
    cells = {c.id: grid.cell(row, c) for c in grid.COLUMNS}
    assert not [k for k, v in cells.items() if v == "MISSING"], cells


def test_each_reason_names_a_real_row_and_applies_somewhere():
    for (row, pattern), reason in grid.NOT_APPLICABLE.items():
        assert row in grid.PROMISES, row
        assert any(fnmatch.fnmatchcase(c.id, pattern) for c in grid.COLUMNS), pattern
        assert len(reason) > 40, reason


def test_each_scenario_checks_real_rows_on_some_column():
    for name, (rows, _) in grid.SCENARIOS.items():
        assert set(rows) <= set(grid.PROMISES), name
        assert grid.columns_of(name), name


def test_every_path_has_a_runner_and_every_runner_a_path():
    """A path in the grid that ``tests/matrix/paths.py`` cannot start would fail every cell
    at run time; one the runner knows and the grid lacks would never be checked."""
    assert set(grid.PATHS) == set(paths.RUNNERS), (set(grid.PATHS), set(paths.RUNNERS))


def test_a_path_without_a_scenario_or_a_reason_is_missing(monkeypatch):
    monkeypatch.setitem(grid.SCENARIOS, "chain", (grid.SCENARIOS["chain"][0], "graph_run-*"))
    assert grid.cell("stop_sigint", grid.Column("keras_run", "tcp", "fast")) == "MISSING"
    assert grid.cell("stop_sigint", grid.Column("graph_run", "tcp", "fast")) == "chain"


def test_docs_show_the_matrix_as_it_is():
    with open(os.path.join(REPO, "docs", "guarantees.md")) as f:
        text = f.read()
    assert grid.markdown() in text, grid.markdown()
