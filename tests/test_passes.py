"""Epochs that are passes (docs/resume.md, "Passes"): two producers, each a shard of a source
that makes one pass per call, through ``stagefeed run --epochs 3`` in graph mode.

The model (``tests/passes_models.py``) counts each row per pass and counts every batch trained
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

from tests.conftest import run_cli
from tests.passes_models import BATCH, PASSES, ROWS, model_state

PER_PASS = ROWS // BATCH  # steps of one epoch: every shard's pass


def test_every_epoch_is_every_shards_pass_and_each_row_is_trained_once_in_each(tmp_path):
    save = tmp_path / "out"
    done = run_cli([
        "run", "--producers", "2", "--schema", "tests.passes_models:SCHEMA",
        "--source", "tests.passes_models:rows", "--model", "tests.passes_models:pass_counter",
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
        assert stream["next"] == stream["end"] == half * PASSES
