"""Epochs that are passes (docs/resume.md, "Passes"): two producers, each a shard of a source
that makes one pass per call, through ``stagefeed run --epochs 3`` in graph mode.

The model (``tests/helpers/passes_models.py``) counts each row per pass and counts every batch
trained
after a batch of a later pass (``disorder``). An epoch is every shard's pass if and only if
the final checkpoint has every row once in every pass, ``disorder`` 0 (every batch of pass
``k`` trained before any of pass ``k + 1``), and the trainer's epochs end at the pass
boundaries (the log's ``epoch k/3 done: S steps`` with S the batches of one pass). Shard 0 is
slower: without passes the other shard would run ahead into its next pass.
"""

from __future__ import annotations

import json
import re

import numpy as np

from tests.conftest import run_cli, wait_for
from tests.helpers.passes_models import BATCH, PASSES, ROWS, model_state
from tests.helpers.procs import log_text

PER_PASS = ROWS // BATCH  # steps of one epoch: every shard's pass


def test_every_epoch_is_every_shards_pass_and_each_row_is_trained_once_in_each(tmp_path):
    save = tmp_path / "out"
    done = run_cli([
        "run", "--producers", "2", "--schema", "tests.helpers.passes_models:SCHEMA",
        "--source", "tests.helpers.passes_models:rows", "--model",
            "tests.helpers.passes_models:pass_counter",
        "--epochs", str(PASSES), "--steps", "0", "--warmup-steps", "0", "--progress-s", "100",
        "--save", str(save),
    ], timeout=240)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    counts, disorder = model_state(str(save / "model.ckpt"))
    assert disorder == 0.0, out[-4000:]
    assert np.array_equal(counts, np.ones((PASSES, ROWS), np.float32)), {
        "pass, row not trained once": [(int(p), int(r)) for p, r in np.argwhere(counts != 1)][:20]
    }  # fmt: skip
    epochs = re.findall(r"epoch (\d+)/(\d+) done: (\d+) steps", out)
    expected = [(str(k), str(PASSES), str(PER_PASS)) for k in range(1, PASSES + 1)]
    assert epochs == expected, out[-4000:]
    with open(save / "state.json") as f:
        state = json.load(f)
    assert state["step"] == PASSES * PER_PASS
    half = PER_PASS // 2
    for stream in state["input"]["streams"].values():  # where each pass ended, per shard
        assert stream["passes"] == [half * k for k in range(1, PASSES + 1)]
        assert stream["next"] == half * PASSES
        # Its `end` is booked unless the final save came first: the run drained once the
        # other shard's end and this one's last end_pass were in (seen in 1 of 6 runs).
        assert stream["end"] in (None, half * PASSES)


def test_a_run_with_passes_killed_mid_pass_resumes_with_every_row_once_in_each_pass(
    spawn, tmp_path
):
    """Killed with SIGKILL (the whole process group) in its second pass, re-run with the same
    command: the resumed run works out its epoch from the pass ends in the position, the
    producers start that pass where it was, and every row is still trained once in each pass,
    in pass order."""
    save = tmp_path / "out"
    command = [
        "run", "--producers", "2", "--schema", "tests.helpers.passes_models:SCHEMA",
        "--source", "tests.helpers.passes_models:rows", "--model",
            "tests.helpers.passes_models:pass_counter",
        "--epochs", str(PASSES), "--steps", "0", "--warmup-steps", "0", "--progress-s", "100",
        "--checkpoint-every", "7", "--rate", "10", "--save", str(save),
    ]  # fmt: skip
    first = spawn(command, "first")
    killed_in = PER_PASS + PER_PASS // 2  # a checkpoint in the middle of the second pass
    checkpoint = re.compile(r"step (\d+): checkpoint")

    def far_enough() -> bool:
        return any(int(n) >= killed_in for n in checkpoint.findall(log_text(first)))

    assert wait_for(far_enough, 240), log_text(first)[-3000:]
    first.kill_group()
    again = spawn(command, "again")
    assert again.wait(240) == 0, log_text(again)[-4000:]
    text = log_text(again)
    assert "resuming from" in text and "resumed from step" in text, text[-3000:]
    counts, disorder = model_state(str(save / "model.ckpt"))
    assert disorder == 0.0, text[-3000:]
    assert np.array_equal(counts, np.ones((PASSES, ROWS), np.float32)), {
        "pass, row not trained once": [(int(p), int(r)) for p, r in np.argwhere(counts != 1)][:20]
    }  # fmt: skip


def test_keras_fit_epochs_follow_the_passes(tmp_path):
    """``fit``'s epochs end at the pass boundaries (``PassCut``), not by a guessed
    ``--steps-per-epoch``: three epochs of 60 steps, each every shard's pass."""
    done = run_cli([
        "run", "--producers", "2", "--schema", "tests.helpers.passes_models:SCHEMA",
        "--source", "tests.helpers.passes_models:rows", "--model",
            "tests.helpers.passes_models:keras_linear",
        "--epochs", str(PASSES), "--steps", "0", "--warmup-steps", "0", "--progress-s", "100",
    ], timeout=240)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    epochs = re.findall(r"epoch (\d+)/(\d+) done: (\d+) steps", out)
    expected = [(str(k), str(PASSES), str(PER_PASS)) for k in range(1, PASSES + 1)]
    assert epochs == expected, out[-3000:]
    # Every epoch but the last is cut at its boundary; the last one ends there too, either
    # by its cut or, when its last batch trained before the producers' ``end_pass`` was
    # booked (seen in CI), by the end of the data: its epoch line above says it was whole.
    cut = re.findall(r"fit's epoch (\d+) ended at its pass boundary", out)
    assert cut[: PASSES - 1] == [str(k) for k in range(1, PASSES)], out[-3000:]
    assert f"steps {PASSES * PER_PASS} timed" in done.stdout, done.stdout
