"""The trainer's malloc policy: freed batch buffers are reused instead of faulted in again."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env, run_cli

PROBE = """
import resource, sys
import numpy as np
from stagefeed.consumer.memory.malloc_policy import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(2):  # warm up: the first batch always faults in
    np.ones(40 * 2**20, np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    np.ones(40 * 2**20, np.uint8)  # 40 MiB: above glibc's largest mmap threshold
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, probe: str = PROBE) -> int:
    """The last line the probe printed, run with ``mode``."""
    out = subprocess.run(
        [sys.executable, "-c", probe, mode], capture_output=True, text=True, cwd=REPO, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_kept_memory_avoids_page_faults_per_batch():
    default = _faults("default")
    kept = _faults("keep")
    # Measured here: ~530 faults per 40 MiB batch by default (the kernel maps several pages
    # per fault), none with the policy.
    assert default >= 10 * 100  # every batch unmapped on free and faulted in afresh
    assert kept * 50 < default


# Bytes of blocks glibc mapped apart from its heaps (mallinfo2's hblkhd).
MAPPED = """
from stagefeed.consumer.memory.heap import read as heap_read
mapped_apart = lambda: heap_read().mapped_apart
"""

THREAD_PROBE = MAPPED + """
import sys, threading
import numpy as np
from stagefeed.consumer.memory.malloc_policy import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
mapped = []
def batch():  # as ZeroMQ's I/O thread and the enqueue threads do
    before = mapped_apart()
    block = np.empty(100 * 2**20, np.uint8)  # more than a thread arena's 64 MiB heap holds
    mapped.append(mapped_apart() - before)
    del block
thread = threading.Thread(target=batch)
thread.start()
thread.join()
print(mapped[0])
"""


def test_kept_memory_holds_in_other_threads_for_blocks_over_64_mib():
    """A thread allocates from its own arena, whose heaps cannot hold a 158 MB batch: without
    the one-arena limit glibc maps such a block afresh (and faults it in) every time, whatever
    the mmap setting. Its mapped bytes are counted by ``HeapBytes.mapped_apart`` (mallinfo2)."""
    assert _faults("keep", THREAD_PROBE) == 0
    assert _faults("default", THREAD_PROBE) >= 100 * 2**20


LATE_PROBE = """
import logging, sys, threading
from stagefeed.consumer.memory.malloc_policy import keep_freed_memory
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
allocated, stop = threading.Event(), threading.Event()
def worker_main():
    block = bytes(200_000)  # over pymalloc's limit: glibc gives this thread an arena
    allocated.set()
    stop.wait()
worker = threading.Thread(target=worker_main)
worker.start()
allocated.wait()
try:
    assert keep_freed_memory(64 * 2**20)  # fits a thread arena: late does not matter
    print("MARK", file=sys.stderr, flush=True)
    assert keep_freed_memory(158 * 10**6)  # does not: says so
    assert keep_freed_memory(158 * 10**6)  # once per process: no second line
finally:
    stop.set()
    worker.join()
"""


def test_policy_applied_late_says_so_once_for_blocks_a_thread_arena_cannot_hold():
    out = subprocess.run(
        [sys.executable, "-c", LATE_PROBE], capture_output=True, text=True, cwd=REPO, check=True,
        env={k: v for k, v in cli_env().items() if k != "MALLOC_ARENA_MAX"},
    )  # fmt: skip
    after_small = out.stderr.split("MARK\n", 1)[1]
    assert out.stderr.count("WARNING") == after_small.count("WARNING"), out.stderr
    lines = [line for line in after_small.splitlines() if line.startswith("WARNING")]
    assert len(lines) == 1, out.stderr
    assert re.match(r"WARNING malloc policy applied when 2 malloc arenas existed", lines[0])
    assert "stagefeed.keep_freed_memory()" in lines[0] and "MALLOC_ARENA_MAX=1" in lines[0]


SERVED_PROBE = MAPPED + """
import sys
import numpy as np
from stagefeed import ServedFeed, TrainerOptions
from stagefeed.common.schema import image_schema
options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=image_schema(2, 195), queue_mb=4,
                         keep_freed_memory=sys.argv[1] == "keep")
ServedFeed(options).close()
before = mapped_apart()
batch = np.ones(40 * 2**20, np.uint8)  # above glibc's largest mmap threshold
print(mapped_apart() - before)
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


@pytest.mark.parametrize(
    ("batch_size", "one_arena"), [(128, True), (2, False)], ids=["79MB-images", "tiny"]
)
def test_the_command_line_applies_the_policy_first_and_one_arena_for_large_arrays(
    batch_size, one_arena
):
    """Where an array is over 64 MiB (128 float32 227x227x3 images: 79 MB), ``stagefeed
    train`` applies the policy with its one-arena limit before any other thread has an arena
    (no late warning), before its start-up checks; smaller batches get it when the trainer
    starts. ``--return-freed-memory``: not applied at all. A bad flag stops each run at start,
    before TensorFlow."""
    flags = ["train", "--batch-size", str(batch_size), "--log-level", "debug",
             "--metrics-port", "0", "--metrics-bind", "10.0.0.256"]  # fmt: skip
    done = run_cli(flags, timeout=120)
    assert done.returncode == 2 and "10.0.0.256" in done.stderr, done.stderr
    assert ("malloc: freed batch buffers are kept for reuse" in done.stderr) == one_arena
    assert ("malloc: one arena" in done.stderr) == one_arena, done.stderr
    assert "malloc policy applied when" not in done.stderr
    done = run_cli([*flags, "--return-freed-memory"], timeout=120)
    assert done.returncode == 2 and "malloc:" not in done.stderr, done.stderr
