"""consumer.memory.heap: malloc's bytes in use and freed-but-kept, which tell what the trainer holds
from what its allocator keeps (the fault tests bound them apart)."""

from __future__ import annotations

import json
import subprocess
import sys

from stagefeed.consumer.memory import heap
from tests.conftest import cli_env

MIB = 2**20

# With the malloc policy, a freed 200 MiB block stays resident and is counted as free: RSS
# less the free figure returns to what it was before the block.
KEPT_PROBE = """
import json, sys
import numpy as np
import psutil
from stagefeed.consumer.memory import heap
from stagefeed.consumer.memory.malloc_policy import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
rss = lambda: psutil.Process().memory_info().rss
figures = []
def sample():
    h = heap.read()
    figures.append({"rss": rss(), "in_use": h.in_use, "free": h.free})
sample()
block = np.ones(200 * 2**20, np.uint8)  # touched: every page resident
sample()
del block
sample()
print(json.dumps(figures))
"""


def _probe(mode: str) -> list[dict[str, int]]:
    out = subprocess.run(
        [sys.executable, "-c", KEPT_PROBE, mode], env=cli_env(), capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_a_block_counts_in_use_until_freed() -> None:
    before = heap.read()
    assert before is not None  # glibc >= 2.33 on these machines
    block = bytearray(64 * MIB)
    during = heap.read()
    del block
    after = heap.read()
    assert during.in_use - before.in_use >= 64 * MIB
    assert during.in_use - after.in_use >= 64 * MIB


def test_with_the_policy_a_freed_block_stays_resident_and_counts_as_free() -> None:
    start, held, freed = _probe("keep")
    assert held["in_use"] - start["in_use"] >= 200 * MIB
    assert freed["rss"] - start["rss"] >= 190 * MIB  # kept: not returned to the OS
    assert freed["free"] - start["free"] >= 199 * MIB  # the block, less what it reused
    # What the process holds is back where it was, within a few MiB of Python's own objects.
    held_before = start["rss"] - start["free"]
    held_after = freed["rss"] - freed["free"]
    assert abs(held_after - held_before) < 8 * MIB, (held_before, held_after)


def test_without_the_policy_the_block_goes_back_to_the_os() -> None:
    start, held, freed = _probe("default")
    assert held["rss"] - start["rss"] >= 190 * MIB
    assert freed["rss"] - start["rss"] < 16 * MIB  # glibc mmap'd it and unmapped it on free
    assert freed["free"] - start["free"] < 16 * MIB
