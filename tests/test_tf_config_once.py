"""``TF_CONFIG`` is read once, where the trainer is made (issue 29): the launcher resolves the
trainer's ``ClusterPlace`` and hands it to the trainer factory, which passes it down; the
intake, the checkpoints and the cluster's strategy take it as a parameter. A trainer or a
``ServedFeed`` made from Python without a place resolves it in its constructor
(``trainer_base.trainer_place``, ``ServedFeed``), nowhere else. A check over the source (AST),
so that a new reader of the environment deep in the consumer fails here.

Covers consumer/ and stagefeed/ (who reads ``TF_CONFIG``), common/tf_config.py (``place``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What reads TF_CONFIG from the environment (common/tf_config.py), by name.
READERS = {"from_environ", "place", "apply_indexed_job", "is_chief", "in_cluster", "worker_place"}
# Where a trainer or a feed is made without a place from its caller: resolved there, once.
RESOLVE_HERE = {
    "consumer/trainer_base.py": {"place"},
    "consumer/tf2/served_feed.py": {"place"},
    "stagefeed/launcher.py": {"place", "apply_indexed_job"},
}
# The producer's --connect-tf-config (stagefeed/producer_flags.py): another process, no trainer.
PRODUCER_SIDE = {"stagefeed/producer_flags.py"}


def _sources() -> list[pathlib.Path]:
    return sorted([*(ROOT / "consumer").rglob("*.py"), *(ROOT / "stagefeed").glob("*.py")])


def _reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each call that reads ``TF_CONFIG``: a ``tf_config`` function named in
    ``READERS`` (imported by name or through the module), or the environment at a key that
    names it."""
    imported: set[str] = set()
    for node in ast.walk(tree):
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        if module.endswith(("tf_config", "cluster.strategy")):
            imported |= {a.asname or a.name for a in node.names if a.name in READERS}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in imported:
                found.append((node.lineno, func.id))
            elif (
                isinstance(func, ast.Attribute) and func.attr in READERS
                and isinstance(func.value, ast.Name) and func.value.id == "tf_config"
            ):  # fmt: skip
                found.append((node.lineno, func.attr))
        if isinstance(node, ast.Subscript | ast.Call) and "environ" in ast.unparse(node):
            text = ast.unparse(node)
            if "TF_CONFIG" in text or "tf_config.ENV" in text:
                found.append((node.lineno, text[:60]))
    return found


def test_tf_config_is_read_only_where_a_trainer_is_made():
    misplaced = []
    for path in _sources():
        name = path.relative_to(ROOT).as_posix()
        if name in PRODUCER_SIDE:
            continue
        allowed = RESOLVE_HERE.get(name, set())
        for line, what in _reads(ast.parse(path.read_text(), name)):
            if what not in allowed:
                misplaced.append(f"{name}:{line}: {what}")
    assert not misplaced, "TF_CONFIG read outside the places a trainer is made:\n" + "\n".join(
        misplaced
    )


@pytest.mark.parametrize(
    ("source", "read"),
    [
        ("from stagefeed.common import tf_config\nc = tf_config.from_environ()", "from_environ"),
        ("from stagefeed.common.tf_config import is_chief\nx = is_chief()", "is_chief"),
        ("import os\nx = os.environ.get('TF_CONFIG')", "TF_CONFIG"),
        ("import os\nx = os.environ[tf_config.ENV]", "TF_CONFIG"),
        ("from stagefeed.consumer.cluster.strategy import in_cluster\nx = in_cluster()",
         "in_cluster"),  # fmt: skip
    ],
)
def test_the_check_sees_each_way_of_reading_it(source, read):
    found = _reads(ast.parse(source))
    assert found and (read in found[0][1] or read == "TF_CONFIG"), found


def test_a_place_passed_down_is_not_a_read():
    source = "x = Checkpoints(options, model, chief=self.place.chief)\nif place.in_cluster: pass"
    assert _reads(ast.parse(source)) == []
