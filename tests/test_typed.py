"""The typed package (stagefeed/py.typed, [tool.mypy] in pyproject.toml, stagefeed/__init__.py's
``TYPE_CHECKING`` imports): a user's type checker sees the public API's real types, and mypy
checks the modules the public names come from."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

import stagefeed
from tests.conftest import REPO

INIT = os.path.join(REPO, "stagefeed", "__init__.py")


def _type_checking_imports() -> dict[str, str]:
    """name -> module of each import under ``if TYPE_CHECKING:`` in stagefeed/__init__.py."""
    with open(INIT) as f:
        tree = ast.parse(f.read())
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.unparse(imp)
                names.update({alias.name: imp.module for alias in imp.names})
    return names


def test_every_lazily_loaded_name_is_imported_for_the_type_checker():
    """A name served by the PEP 562 ``__getattr__`` is ``Any`` to a type checker unless an
    import under ``TYPE_CHECKING`` says what it is; each says it from the module it loads from."""
    assert _type_checking_imports() == stagefeed._LAZY


def test_mypy_checks_every_module_a_public_name_comes_from():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        checked = set(tomllib.load(f)["tool"]["mypy"]["modules"])
    eager = [getattr(stagefeed, n) for n in stagefeed.__all__ if n not in stagefeed._LAZY]
    sources = {"stagefeed", *stagefeed._LAZY.values()}
    sources |= {value.__module__ for value in eager if hasattr(value, "__module__")}
    assert checked == sources


USER_PROGRAM = """
import stagefeed
from stagefeed import ServedFeed, TrainerOptions

options = TrainerOptions()
reveal_type(stagefeed.Producers)
reveal_type(ServedFeed)
reveal_type(stagefeed.InputPosition.from_dict)
wrong: int = options
"""


@pytest.mark.slow
def test_a_users_program_is_type_checked_against_the_installed_wheel(tmp_path):
    """What a user's mypy sees of ``pip install stagefeed``: the wheel's py.typed makes it read
    the package (else: "missing library stubs or py.typed marker"), and the lazily loaded names
    have their classes' types (else ``Any``, and a misuse of them passes unseen)."""
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info")
    shutil.copytree(REPO, source, ignore=skip)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), source],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("stagefeed-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", site, wheel],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    (tmp_path / "user.py").write_text(USER_PROGRAM)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MYPY"))}
    env["PYTHONPATH"] = str(site)  # only the wheel's stagefeed: not this checkout's
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir",
         str(tmp_path / "cache"), "user.py"],
        capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = checked.stdout + checked.stderr
    assert "py.typed" not in out and "import-not-found" not in out, out
    assert 'Revealed type is "def (' in out and "stagefeed.producer.pool.Producers" in out, out
    assert "stagefeed.consumer.tf2.served_feed.ServedFeed" in out, out
    assert "stagefeed.common.position.InputPosition" in out, out
    assert 'user.py:9: error: Incompatible types in assignment (expression has type ' \
           '"TrainerOptions", variable has type "int")' in out, out  # fmt: skip
    assert "Found 1 error in 1 file" in out, out
