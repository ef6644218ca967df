"""The examples run, learn, keep exact books, and what they save restores the same: the TF 2
ones (a, b, d) and the seed's AlexNet in graph mode (c)."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from examples import alexnet_graph, custom_loop, keras_images, save_reload
from tests.conftest import REPO, cli_env


def balanced(figures) -> bool:
    return figures.enqueued == figures.trained + figures.abandoned + figures.queued


def test_keras_images_learns_colours_from_uint8_images_cast_in_the_model():
    result = keras_images.train(steps_per_epoch=6, epochs=3)
    losses = result.history["loss"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert result.history["stagefeed_trained"] == [6.0, 12.0, 18.0]
    assert result.model.inputs[0].dtype == "uint8"  # the wire dtype reaches the model
    gc.collect()  # Keras' epoch iterator sits in a reference cycle
    figures = result.feed.figures()
    assert figures.trained == 18 and balanced(figures)


def test_custom_loop_regression_loss_falls_and_every_step_is_booked():
    result = custom_loop.train(steps=30)
    losses = result.losses
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) / 2
    figures = result.feed.figures()
    assert result.replicas == 1 and figures.trained == 30
    assert balanced(figures) and figures.unaccounted == 0


def test_save_reload_predicts_exactly_the_same(tmp_path):
    result = save_reload.save_and_reload(str(tmp_path), steps_per_epoch=3)
    assert os.path.getsize(result.path) > 0
    assert result.equal and result.max_difference == 0.0


def test_alexnet_graph_trains_from_a_producer_process_and_its_checkpoint_restores(tmp_path):
    result = alexnet_graph.train(str(tmp_path), steps=3)
    assert len(result.losses) == 4 and all(math.isfinite(v) for v in result.losses)
    (books,) = result.books.values()  # one producer process, every step's batch from it
    assert books["trained"] == 4 and books["dropped"] == {}
    assert result.restored_equal and (tmp_path / "model.ckpt.index").is_file()


@pytest.mark.slow
def test_an_example_runs_as_a_module_from_the_repository_root(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "examples.save_reload", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "predictions equal True" in done.stderr
    assert (tmp_path / "small_cnn.keras").is_file()
