"""The README and docs/ agree with the code they describe.

- README's "Every flag" table against the real parsers of ``stagefeed run``, ``train`` and
  ``produce`` (``stagefeed.cli.build_parser``): every flag has a row, every row a flag, and each
  row gives the default ``--help`` shows in each command and the choices the parser takes. (They
  once disagreed: ``run --help`` said batch 128 where the docs said 256 for every command, and
  ``--transport`` was ``tcp|ipc`` in ``run`` but ``zmq`` in ``train`` and ``produce``.)
- every ``stagefeed.X`` name in README.md and docs/*.md exists: a module, an attribute reached
  from one (the public package's included), or a logger the code names.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pathlib
import re

import pytest

from stagefeed import envflags, loopback
from stagefeed.cli import build_parser
from stagefeed.loopback import DEPRECATED_TRANSPORTS, undeprecate
from tests.conftest import REPO

COMMANDS = ("run", "train", "produce")
HEADER = "| flag | run | train | produce | what it does |"


def readme_rows() -> dict[str, tuple[list[str], dict[str, str | None]]]:
    """``{flag: (choices, {command: default or None where the cell is blank})}``."""
    lines = (pathlib.Path(REPO) / "README.md").read_text().splitlines()
    start = lines.index(HEADER)
    rows: dict[str, tuple[list[str], dict[str, str | None]]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        flag, *choices = cells[0].strip("`").replace("\\|", "|").split(" ", 1)
        defaults = {
            c: (cell.strip("`") or None) for c, cell in zip(COMMANDS, cells[1:4], strict=True)
        }
        assert flag not in rows, f"README: {flag} has two rows"
        rows[flag] = (choices[0].split("|") if choices else [], defaults)
    return rows


def parser_flags() -> dict[str, dict[str, argparse.Action]]:
    """``{flag: {command: its action}}`` of the real parsers."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags: dict[str, dict[str, argparse.Action]] = {}
    for command in COMMANDS:
        for action in sub.choices[command]._actions:
            # A deprecated alias (``--recv-threads``) is hidden from the help and the table.
            if action.option_strings and action.dest != "help" and action.help != argparse.SUPPRESS:
                flags.setdefault(action.option_strings[0], {})[command] = action
    return flags


def shown_default(action: argparse.Action) -> str:
    """The default ``--help`` shows (``off`` for a switch), as the README writes it."""
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    found = re.search(r"; default: (.*)\]$", action.help or "")
    assert found, action.help
    shown = found.group(1).replace("%(default)s", str(action.default))
    return "none" if shown == "None" else shown


def test_every_flag_has_a_readme_row_with_its_help_defaults_and_choices(monkeypatch):
    for name in [n for n in os.environ if n.startswith(envflags.PREFIX)]:
        monkeypatch.delenv(name)  # the defaults, not this shell's settings
    rows, flags = readme_rows(), parser_flags()
    assert sorted(rows) == sorted(flags), set(rows) ^ set(flags)
    for flag, by_command in flags.items():
        choices, defaults = rows[flag]
        for command in COMMANDS:
            action = by_command.get(command)
            documented = defaults[command]
            if action is None:
                assert documented is None, f"README: {command} has no {flag}"
                continue
            assert documented == shown_default(action), (flag, command, documented)
            taken = [c for c in action.choices or () if c not in DEPRECATED_TRANSPORTS]
            assert choices == taken, (flag, command, choices, taken)


def test_transport_is_one_vocabulary_and_runs_old_spellings_say_what_to_write(caplog):
    flags = parser_flags()["--transport"]
    assert {
        c: [x for x in a.choices if x not in DEPRECATED_TRANSPORTS] for c, a in flags.items()
    } == {c: ["zmq", "shm", "auto"] for c in COMMANDS}
    assert [flags[c].default for c in COMMANDS] == ["auto", "zmq", "zmq"]
    parser = build_parser()
    with caplog.at_level(logging.WARNING, logger="stagefeed"):
        args = parser.parse_args(["run", "--transport", "ipc"])
        undeprecate(args)
    assert (args.transport, args.bind) == (
        "zmq",
        f"ipc://{loopback.ipc_path()}",
    )
    assert "--transport ipc is deprecated: say --transport zmq --bind ipc://PATH" in caplog.text
    args = parser.parse_args(["run", "--transport", "tcp"])
    undeprecate(args)
    assert (args.transport, args.bind) == ("zmq", None)
    for command in ("train", "produce"):
        with pytest.raises(Exception, match="invalid choice: 'tcp'"):
            parser.parse_args([command, "--transport", "tcp"])


NAME = re.compile(r"\bstagefeed((?:\.[A-Za-z_]\w*)+)(?::(\w+))?")


def loggers() -> set[str]:
    names: set[str] = set()
    for package in ("common", "producer", "consumer", "stagefeed", "bench"):
        for path in (pathlib.Path(REPO) / package).rglob("*.py"):
            names.update(re.findall(r'getLogger\("(stagefeed[\w.]*)"\)', path.read_text()))
    return names


def resolves(dotted: str) -> bool:
    """``stagefeed.a.b.c``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.process  # resolves the TensorFlow-side names too
def test_every_stagefeed_name_in_the_docs_exists():
    known_loggers = loggers()
    missing = []
    for path in [
        pathlib.Path(REPO) / "README.md",
        *sorted((pathlib.Path(REPO) / "docs").glob("*.md")),
    ]:
        for found in NAME.finditer(path.read_text()):
            dotted = "stagefeed" + found.group(1).rstrip(".")
            if found.group(2):
                dotted += "." + found.group(2)
            if dotted not in known_loggers and not resolves(dotted):
                missing.append(f"{path.name}: {found.group(0)}")
    assert not missing, missing
