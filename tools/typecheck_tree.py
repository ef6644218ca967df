"""Lay out the package as it installs, for the type checker: build/typecheck/stagefeed/...

pyproject.toml maps the layer folders (``common/``, ``producer/``, ...) to ``stagefeed.common``,
``stagefeed.producer``, ... (``[tool.setuptools.package-dir]``). The editable install serves that
map through an import hook, which no static checker runs, so mypy is pointed (``mypy_path``) at a
tree of symbolic links made here from the same table: ``stagefeed/`` holds a link to each module
of the ``stagefeed`` folder and one link per mapped folder. Folders are linked whole, so a module
added to one is seen without running this again; the tree is made afresh each time anyway.

Usage: ``python tools/typecheck_tree.py [TREE]`` (default ``build/typecheck``), from the
repository root.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

PACKAGE = "stagefeed"


def package_dirs(pyproject: Path) -> dict[str, str]:
    """The setuptools package-dir table: dotted package name -> folder, relative to the root."""
    with pyproject.open("rb") as f:
        table: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return table


def make_tree(root: Path, tree: Path) -> Path:
    """Make ``tree/stagefeed`` (replacing any old one) and return it."""
    dirs = package_dirs(root / "pyproject.toml")
    top = tree / PACKAGE
    if tree.exists():
        shutil.rmtree(tree)
    top.mkdir(parents=True)
    for module in sorted((root / dirs[PACKAGE]).glob("*.py")):
        os.symlink(os.path.relpath(module, top), top / module.name)
    for name, folder in sorted(dirs.items()):
        if name == PACKAGE:
            continue
        parent, _, leaf = name.rpartition(".")
        if parent != PACKAGE:
            raise SystemExit(f"typecheck_tree: package-dir {name!r} is not under {PACKAGE}")
        os.symlink(os.path.relpath(root / folder, top), top / leaf, target_is_directory=True)
    return top


def main(argv: list[str]) -> int:
    tree = Path(argv[1]) if len(argv) > 1 else Path("build/typecheck")
    make_tree(Path.cwd(), tree)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
