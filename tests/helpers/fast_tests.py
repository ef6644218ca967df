"""The fast tests (``make check``): those that start no process and load no TensorFlow.

``pytest --fast`` (what ``make check`` runs) leaves out the others. A test module that imports
TensorFlow, Keras, an example or a helper module about processes at its top (``HEAVY_MODULE``)
is not collected; of the rest, ``mark`` (called by tests/conftest.py) marks ``process`` and
deselects a ``slow`` or ``process`` test, and a test whose own code, whose fixtures' code or
whose module's functions it names (followed name by name inside its module) name something that
starts a process or loads TensorFlow (``STARTS``). The tests let through are held to the rule
as they run: an audit hook turns a process started or TensorFlow imported by one into its
failure, naming what to mark; a module whose import loads TensorFlow all the same fails the
collection, named. A miss of the scan is a red ``make check``, never a silently slow one.
Without ``--fast`` nothing here runs.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# What starts a process or loads TensorFlow, as a test's source names it.
STARTS = re.compile(
    r"\b(subprocess|Popen|run_cli|Started|start_cli|spawn|Spawner|multiprocessing|procs|"
    r"shm_procs|tensorflow|keras|tf|Producers|ServedFeed|Feed|Trainer|KerasTrainer|"
    r"ClusterTrainer|model_ref|trainer|run_trainer|cli|os\.fork|os\.system)\b"
)
# A module whose top imports these loads TensorFlow at collection, or is about processes.
HEAVY_MODULE = re.compile(
    r"^(import|from) (tensorflow|keras|examples|stagefeed\.consumer|"
    r"tests(\.helpers\.|\.helpers import |\.)"
    r"(model_fit|procs|shm_procs|peer|standin_trainer|cluster_child|cluster_workers|dataset_mirrored_child|"
    r"regression_models|resume_models|passes_models|model_kinds|run_length_models|hostile))\b",
    re.MULTILINE,
)
PROCESS_EVENTS = {
    "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
    "os.exec",
}  # fmt: skip


class NotFast(RuntimeError):
    """A test run by ``--fast`` started a process or imported TensorFlow."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast", action="store_true",
        help="only the tests that start no process and load no TensorFlow (make check)",
    )  # fmt: skip


def _heavy(path: Path) -> bool:
    try:
        return bool(HEAVY_MODULE.search(path.read_text()))
    except OSError:
        return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``--fast``, a test module that loads TensorFlow or process helpers at its top is
    not even imported (collecting it would load TensorFlow)."""
    if not config.getoption("fast"):
        return None
    is_test = collection_path.name.startswith("test_") and collection_path.suffix == ".py"
    if collection_path.name == "matrix" or (is_test and _heavy(collection_path)):
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[pytest.CollectReport]:
    """Under ``--fast``, a test module whose import loads TensorFlow fails the collection, named:
    ``HEAVY_MODULE`` must leave it out (it would cost every ``make check`` TensorFlow's import,
    and let its tests use TensorFlow unseen by the audit hook)."""
    loaded = "tensorflow" in sys.modules
    report: pytest.CollectReport = yield
    fast = collector.config.getoption("fast")
    if fast and isinstance(collector, pytest.Module) and not loaded and "tensorflow" in sys.modules:
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid} loads TensorFlow when imported: make check "
                           "leaves such modules out (HEAVY_MODULE in "
                           "tests/helpers/fast_tests.py)")  # fmt: skip
    return report


@functools.cache
def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


@functools.cache
def _helpers(module: Any) -> dict[str, str]:
    """The functions and classes ``module`` defines: name -> source."""
    return {
        name: _source(value)
        for name, value in vars(module).items()
        if (inspect.isfunction(value) or inspect.isclass(value))
        and getattr(value, "__module__", None) == module.__name__
    }


def _starts(item: pytest.Function) -> bool:
    helpers = _helpers(item.module) if item.module else {}
    seen: set[str] = set()
    todo = [_source(item.function)]
    for name in item.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            todo.append(_source(fixturedef.func))
    while todo:
        text = todo.pop()
        if STARTS.search(text):
            return True
        for name in re.findall(r"\b[A-Za-z_]\w*\b", text):
            if name in helpers and name not in seen:
                seen.add(name)
                todo.append(helpers[name])
    return False


def mark(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--fast``, mark ``process`` the tests that are not fast and deselect them."""
    if not config.getoption("fast"):
        return
    slow = []
    heavy: dict[Path, bool] = {}
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        path = Path(str(item.path))
        if path not in heavy:
            heavy[path] = _heavy(path)
        marked = item.get_closest_marker("slow") or item.get_closest_marker("process")
        if heavy[path] or marked or _starts(item):
            item.add_marker(pytest.mark.process)
            slow.append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        chosen = set(map(id, slow))
        items[:] = [item for item in items if id(item) not in chosen]


_running: list[str] = []  # the node id of the test run under --fast, while it runs
_hooked: list[bool] = []  # [True] once the audit hook is in


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _running:
        return
    if event in PROCESS_EVENTS:
        what = f"starts a process ({event})"
    elif event == "import" and str(args[0]).split(".")[0] in ("tensorflow", "keras"):
        if args[0] in sys.modules:
            return
        what = f"imports {args[0]}"
    else:
        return
    test = _running[0]
    del _running[:]  # once: the failure's own report must not trip it again
    raise NotFast(f"{test} {what}: make check runs only fast tests; mark it "
                  "@pytest.mark.process (or name what it calls in "
                  "tests/helpers/fast_tests.py STARTS)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not item.config.getoption("fast"):
        return (yield)
    if not _hooked:
        sys.addaudithook(_audit)  # for good (a hook cannot be removed): idle between tests
        _hooked.append(True)
    _running[:] = [item.nodeid]
    try:
        return (yield)
    finally:
        del _running[:]
