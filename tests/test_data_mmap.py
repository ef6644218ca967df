"""A memory-mapped ``.npy`` of 1 GiB read by two producers (``stagefeed produce --workers 2``
against a stand-in trainer): each producer maps the file and reads only the pages of the
records it sends, so it never loads the file (issue 30).

Measured per producer: its private memory (``RssAnon``: what loading the file would grow)
and its peak RSS (``VmHWM``), which also counts the file's pages it has mapped: page cache,
shared by the producers and given back under pressure. Here the kernel maps a whole
page-cache folio around each page read, about 1.3 MiB for each 256 KiB record read at
random, so the peak RSS grows with what is read, not with the file (measured: about 350 MiB
after 40 batches of 4 records, private memory 24 MiB throughout).
"""

from __future__ import annotations

import re
import time

import numpy as np
import psutil

from stagefeed.common.schema import ArraySpec, Schema
from tests.conftest import Started
from tests.helpers.procs import workers_of
from tests.helpers.standin_trainer import StandInTrainer

RECORD = 65536  # float32 values: 256 KiB a record
RECORDS = 4096  # 1 GiB
SCHEMA = Schema((ArraySpec("x", "float32", (RECORD,)),), batch_size=4)
BATCHES = 25  # per producer: 25 MiB of records each


def memory_mib(proc: psutil.Process) -> dict[str, float]:
    """``VmHWM`` (peak RSS) and ``RssAnon`` (private memory now) of ``proc``, in MiB."""
    with open(f"/proc/{proc.pid}/status") as f:
        text = f.read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) / 1024
            for k in ("VmHWM", "RssAnon")}  # fmt: skip


def test_two_producers_of_a_mapped_1_gib_npy_each_stay_far_below_its_size(tmp_path):
    path = tmp_path / "x.npy"  # the array x (named by the stem)
    data = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(RECORDS, RECORD))
    data[:, 0] = np.arange(RECORDS)  # the rest stays a hole of the sparse file
    data.flush()
    del data
    size_mib = path.stat().st_size / 2**20
    assert size_mib > 1024
    firsts: list[int] = []
    with StandInTrainer(SCHEMA, regrant=True,
                        inspect=lambda seq, a: firsts.extend(a["x"][:, 0].tolist())) as trainer:
        started = Started(["produce", "--connect", trainer.endpoint, "--workers", "2",
                           "--source", f"npy:{path}", "--max-batches", str(BATCHES),
                           "--rate", "10"],  # fmt: skip
                          log_path=tmp_path / "produce.log")
        try:
            workers = workers_of(started, 2)
            peaks = {w.pid: {"VmHWM": 0.0, "RssAnon": 0.0} for w in workers}
            while started.proc.poll() is None:
                for w in workers:
                    try:
                        now = memory_mib(w)
                    except (FileNotFoundError, ProcessLookupError, AttributeError):
                        continue  # it has exited
                    peaks[w.pid] = {k: max(peaks[w.pid][k], now[k]) for k in now}
                time.sleep(0.1)
        finally:
            started.kill_group()
    log = started.output()
    assert started.proc.returncode == 0, log[-3000:]
    assert len(trainer.received) == 2 * BATCHES, log[-3000:]
    assert len(set(firsts)) == len(firsts) == 2 * BATCHES * 4  # distinct records, from the file
    for peak in peaks.values():
        assert 0 < peak["RssAnon"] < size_mib / 10, peaks  # never loaded: ~24 MiB of 1024
        assert 0 < peak["VmHWM"] < size_mib / 3, peaks  # the pages read, mapped
