"""The trainer's malloc policy: freed batch buffers are reused instead of faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env

PROBE = """
import resource, sys
import numpy as np
from stagefeed.consumer.malloc_policy import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(2):  # warm up: the first batch always faults in
    np.ones(40 * 2**20, np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    np.ones(40 * 2**20, np.uint8)  # 40 MiB: above glibc's largest mmap threshold
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=REPO, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_kept_memory_avoids_page_faults_per_batch():
    default = _faults("default")
    kept = _faults("keep")
    # Measured here: ~530 faults per 40 MiB batch by default (the kernel maps several pages
    # per fault), none with the policy.
    assert default >= 10 * 100  # every batch unmapped on free and faulted in afresh
    assert kept * 50 < default


SERVED_PROBE = """
import ctypes, sys
import numpy as np
from stagefeed import ServedFeed, TrainerOptions
from stagefeed.common.schema import image_schema

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=image_schema(2, 195), queue_mb=4,
                         keep_freed_memory=sys.argv[1] == "keep")
ServedFeed(options).close()
before = mallinfo2().hblkhd
batch = np.ones(40 * 2**20, np.uint8)  # above glibc's largest mmap threshold
print(mallinfo2().hblkhd - before)
"""


@pytest.mark.slow
def test_a_served_feed_applies_the_policy_its_options_ask_for():
    """The TF 2 trainer side does as the graph trainer: by default a batch-sized buffer comes
    from the heap (no mmap of its own, so reused once freed); with the option off, glibc maps
    it afresh."""

    def mapped(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", SERVED_PROBE, mode],
            capture_output=True, text=True, cwd=REPO, check=True, env=cli_env(),
        )  # fmt: skip
        return int(out.stdout.strip().splitlines()[-1])

    assert mapped("keep") == 0
    assert mapped("default") >= 40 * 2**20
