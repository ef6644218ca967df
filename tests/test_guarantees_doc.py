"""The drop-reason tables of docs/guarantees.md ("Bad input") and docs/shm.md agree with the
code: every ``DropReason`` is in exactly one of them and no other name is, and the limits the
rows quote are the constants the code checks against (the header size, the protocol version,
the frame count, the sequence window, the connection and book limits).

The tables once said 4096 bytes (the limit was 16 KiB), "version other than 1" (protocol v2)
and ``label_range`` (the reason is ``value_range``): these tests keep them from drifting again.
"""

from __future__ import annotations

import pathlib
import re

from stagefeed.common import protocol
from stagefeed.common.errors import DropReason
from stagefeed.common.schema import MAX_ARRAYS
from stagefeed.consumer.books.ledger import MAX_ENTRIES, MAX_SEQ_AHEAD
from stagefeed.consumer.intake.dispatch import MAX_LIVE_CONNECTIONS
from tests.conftest import REPO


def reason_table(path: str, second_heading: str) -> dict[str, str]:
    """``{reason: the row's text}`` of the table in ``path`` whose header row is
    ``| reason | SECOND_HEADING...``; a first cell may name several reasons."""
    lines = (pathlib.Path(REPO) / path).read_text().splitlines()
    header = f"| reason | {second_heading}"
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        first, rest = line[1:].split("|", 1)
        for name in re.findall(r"`([a-z_]+)`", first):
            assert name not in rows, f"{path}: {name} listed twice"
            rows[name] = rest
    return rows


GUARANTEES = reason_table("docs/guarantees.md", "the message")
SHM = reason_table("docs/shm.md", "the descriptor")


def number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in {text!r}"
    return int(found.group(1).replace(",", ""))


def test_every_drop_reason_is_documented_once_and_nothing_else_is():
    documented = [*GUARANTEES, *SHM]
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == {reason.value for reason in DropReason}
    assert all(name.startswith("shm_") for name in SHM)


def test_the_header_limit_is_the_codes():
    row = GUARANTEES["header_size"]
    assert number(r"over (\d+) KiB", row) * 1024 == protocol.MAX_HEADER_BYTES
    assert number(r"\((\d+) bytes\)", row) == protocol.MAX_HEADER_BYTES
    text = (pathlib.Path(REPO) / "docs/guarantees.md").read_text()
    assert number(r"header is at most (\d+) KiB", text) * 1024 == protocol.MAX_HEADER_BYTES


def test_the_protocol_version_is_the_codes():
    assert number(r"version other than (\d+)", GUARANTEES["version"]) == protocol.PROTOCOL_VERSION


def test_the_limits_the_rows_quote_are_the_codes():
    parts = GUARANTEES["parts"]
    assert number(r"more than (\d+) frames", parts) == 1 + MAX_ARRAYS
    assert number(r"a header and (\d+) arrays", parts) == MAX_ARRAYS
    assert number(r"more than ([\d,]+) past", GUARANTEES["seq_range"]) == MAX_SEQ_AHEAD
    peers = GUARANTEES["peer_limit"]
    assert number(r"beyond the ([\d,]+) live", peers) == MAX_LIVE_CONNECTIONS
    assert number(r"the ([\d,]+) entries", peers) == MAX_ENTRIES
