"""A data source's run killed with SIGKILL mid-epoch and run again (docs/data.md, "Resume and
epochs"; docs/resume.md, "Another producer count"): ``stagefeed run --source
npy:ids.npy,x.npy`` shuffled over 2 epochs, killed after a checkpoint, resumed with the same
command, trains every record exactly once per epoch (a counter in the model). The data source
seeks: each shard starts at its batch of the epoch. Elastic: killed with 2 producers, resumed
with 3, killed again, resumed with 1, every record is still trained exactly once per epoch."""

from __future__ import annotations

import re

import numpy as np

from tests.helpers.procs import log_text, wait_log
from tests.helpers.resume_models import EPOCHS, ROWS, counts_in, miscounted

TIMEOUT_S = 120  # the kill at step 15 is mid-epoch: an epoch is ROWS / 4 = 24 steps


def npy_run(tmp_path, producers: int, rate: int) -> list[str]:
    """``stagefeed run`` of ``ids.npy``/``x.npy`` (ROWS records, seed 5) with ``producers``
    producers of ``rate`` batches a second each, saving to ``tmp_path/save`` every 4 steps."""
    np.save(tmp_path / "ids.npy", np.arange(ROWS, dtype=np.int32))
    np.save(tmp_path / "x.npy", np.ones(ROWS, np.float32))
    return [
        "run", "--producers", str(producers), "--batch-size", "4", "--seed", "5",
        "--rate", str(rate), "--source", f"npy:{tmp_path / 'ids.npy'},{tmp_path / 'x.npy'}",
        "--model", "tests.helpers.resume_models:row_counter", "--epochs", str(EPOCHS),
        "--steps", "0", "--warmup-steps", "0", "--checkpoint-every", "4", "--progress-s", "100",
        "--producer-timeout-s", "4", "--save", str(tmp_path / "save"),
    ]  # fmt: skip


def test_a_run_killed_with_2_producers_resumes_with_3_then_1_and_trains_every_record_once(
    spawn, tmp_path
):
    # The producers are slower than the trainer (--rate): each kill lands mid-epoch, with
    # seconds of the run left (the second: 20 of 48 steps at 9 batches a second).
    first = spawn(npy_run(tmp_path, 2, 3), "two")
    assert wait_log(first, r"step 8: checkpoint", TIMEOUT_S), log_text(first)[-3000:]
    first.kill_group()
    second = spawn(npy_run(tmp_path, 3, 3), "three")
    assert wait_log(second, r"step 28: checkpoint", TIMEOUT_S), log_text(second)[-3000:]
    second.kill_group()
    third = spawn(npy_run(tmp_path, 1, 30), "one")
    assert third.wait(TIMEOUT_S) == 0, log_text(third)[-4000:]
    for run, old, new in ((second, 2, 3), (third, 3, 1)):
        text = log_text(run)
        assert f"position of {old} shards is dealt out to {new}" in text, text[-3000:]
        assert "resuming from" in text, text[-3000:]
    assert re.search(r"resumed from step (28|32)\b", log_text(third)), log_text(third)[-3000:]
    assert not miscounted(counts_in(str(tmp_path / "save" / "model.ckpt"))), \
        log_text(third)[-3000:]


def test_a_killed_run_of_npy_files_resumes_and_trains_every_record_once_per_epoch(
    spawn, tmp_path
):
    np.save(tmp_path / "ids.npy", np.arange(ROWS, dtype=np.int32))
    np.save(tmp_path / "x.npy", np.ones(ROWS, np.float32))
    save = tmp_path / "save"
    args = [
        "run", "--producers", "2", "--batch-size", "4", "--seed", "5", "--rate", "10",
        "--source", f"npy:{tmp_path / 'ids.npy'},{tmp_path / 'x.npy'}",
        "--model", "tests.helpers.resume_models:row_counter", "--epochs", str(EPOCHS), "--steps",
            "0",
        "--warmup-steps", "0", "--checkpoint-every", "5", "--progress-s", "100",
        "--producer-timeout-s", "4", "--save", str(save),
    ]  # fmt: skip
    killed = spawn(args, "killed")
    assert wait_log(killed, r"step 15: checkpoint", TIMEOUT_S), log_text(killed)[-3000:]
    killed.kill_group()
    again = spawn(args, "again")
    assert again.wait(TIMEOUT_S) == 0, log_text(again)[-4000:]
    text = log_text(again)
    assert "resuming from" in text, text[-3000:]
    assert "resumed from step" in text, text[-3000:]
    assert re.search(r"shard \d of 2 from batch [1-9]", text), text[-3000:]  # sought to
    assert not miscounted(counts_in(str(save / "model.ckpt"))), text[-3000:]
