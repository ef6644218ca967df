"""The TF 2 feed under MirroredStrategy over 2 logical CPUs, in a fresh process (real TF)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, cli_env


@pytest.fixture(scope="module")
def mirrored() -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.dataset_mirrored_child"],
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(),
        cwd=REPO,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_each_replica_gets_its_batch_on_its_device_and_the_books_name_it(mirrored):
    books = mirrored["books"]
    assert mirrored["replicas"] == 2 and books["per_step"] == 2
    assert [d.rsplit("/", 1)[-1] for d in books["devices"]] == ["device:CPU:0", "device:CPU:1"]
    booked = [step["booked"] for step in books["steps"]]
    assert [step["seen"] for step in books["steps"]] == booked
    flat = [seq for seqs in booked for seq in seqs]
    assert flat == list(range(flat[0], flat[0] + 8))  # two whole batches a step, in order
    assert books["filled"], "not 2 batches ahead with the queue full within 60 s (FILL_WAIT_S)"
    assert 2 <= books["ahead"] <= 10  # per-replica device buffers hold batches ahead
    assert books["balanced"] and books["trained"] == 10


@pytest.mark.slow
def test_the_custom_loop_example_learns_on_two_replicas(mirrored):
    loop = mirrored["custom_loop"]
    losses = loop["losses"]
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) / 2
    assert loop["replicas"] == 2 and loop["trained"] == 2 * len(losses) and loop["balanced"]


@pytest.mark.slow
def test_fit_under_mirrored_learns_and_books_two_batches_a_step(mirrored):
    fit = mirrored["fit"]
    assert all(math.isfinite(v) for v in fit["loss"]) and fit["loss"][-1] < fit["loss"][0]
    assert fit["trained_history"] == [8.0, 16.0, 24.0]
    assert fit["balanced"] and fit["abandoned"] >= 1
