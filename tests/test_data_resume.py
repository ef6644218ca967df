"""A data source's run killed with SIGKILL mid-epoch and run again (docs/data.md, "Resume and
epochs"): ``stagefeed run --source npy:ids.npy,x.npy`` shuffled over 2 epochs, killed after
a checkpoint, resumed with the same command, trains every record exactly once per epoch (a
counter in the model). The data source seeks: each shard starts at its batch of the epoch."""

from __future__ import annotations

import re

import numpy as np

from tests.helpers.procs import log_text, wait_log
from tests.helpers.resume_models import EPOCHS, ROWS, counts_in, miscounted

TIMEOUT_S = 120  # the kill at step 15 is mid-epoch: an epoch is ROWS / 4 = 24 steps


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
