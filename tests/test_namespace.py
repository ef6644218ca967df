"""One import namespace: installing claims only ``stagefeed``; a user's own ``common`` package
changes nothing; the public API is curated; producers never load TensorFlow."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

import stagefeed
from tests.conftest import REPO, cli_env


def test_public_api_is_curated_sorted_and_resolvable():
    assert stagefeed.__all__ == sorted(stagefeed.__all__)
    for name in stagefeed.__all__:
        assert getattr(stagefeed, name) is not None, name
    with pytest.raises(AttributeError):
        stagefeed.no_such_thing  # noqa: B018


def test_import_stagefeed_and_the_producer_side_do_not_import_tensorflow():
    code = (
        "import sys, stagefeed, stagefeed.cli, stagefeed.launcher;"
        "import stagefeed.producer.worker, stagefeed.producer.pool, stagefeed.producer.sources;"
        "stagefeed.cli.build_parser(); stagefeed.Producers, stagefeed.WorkerBook;"
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True
    )
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_a_users_own_common_package_first_on_the_path_changes_nothing(tmp_path):
    for name in ("common", "producer", "consumer", "bench"):
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("raise ImportError('the user package was imported')\n")
        (package / "options.py").write_text("ProducerOptions = None\n")
    env = cli_env(PYTHONPATH=f"{tmp_path}:{REPO}")
    for args in (["--version"], ["produce", "--help"], ["train", "--help"]):
        out = subprocess.run(
            [sys.executable, "-m", "stagefeed.cli", *args],
            capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    assert f"stagefeed {stagefeed.__version__}" in subprocess.run(
        [sys.executable, "-m", "stagefeed.cli", "--version"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
    ).stdout  # fmt: skip


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name(tmp_path):
    # Built from a copy: setuptools builds in the source tree, and a stale build/ there could
    # leak into the wheel.
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info")
    shutil.copytree(REPO, source, ignore=skip)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), source],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("stagefeed-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert zf.read(top_level).decode().split() == ["stagefeed"]
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"stagefeed"}
    for layer in ("common", "producer", "consumer", "bench"):
        assert f"stagefeed/{layer}/__init__.py" in names
    assert wheel.name.startswith(f"stagefeed-{stagefeed.__version__}-")


def test_every_package_folder_is_in_pyprojects_package_list():
    """A package folder missing from ``[tool.setuptools] packages`` installs nothing: the
    editable checkout imports it all the same, so only the wheel would show it (the slow test
    above). Every folder with an ``__init__.py`` under the mapped folders is listed, and every
    listed package is a folder."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    found = set()
    for top, folder in folders.items():
        for init in pathlib.Path(REPO, folder).rglob("__init__.py"):
            relative = init.parent.relative_to(pathlib.Path(REPO, folder))
            found.add(".".join([top, *relative.parts]))
    listed = set(setuptools["packages"])
    assert found - listed == set(), "package folders missing from pyproject.toml's packages"
    assert listed - found == set(), "pyproject.toml lists packages that have no folder"


KERAS_RUN_MODULES = """
import sys
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer import trainers
from stagefeed.common.options import ObserveOptions
from stagefeed.common.tf_config import NO_CLUSTER
from stagefeed.consumer.observe.monitor import Monitor
from stagefeed.consumer.observe.summary import format_text, summarize
from tests.helpers.regression_models import SCHEMA

options = TrainerOptions(
    bind="tcp://127.0.0.1:*", schema=SCHEMA, model="tests.helpers.regression_models:build"
)
monitor = Monitor(ObserveOptions())
trainer = trainers.trainer(options, [monitor], place=NO_CLUSTER).start()
trainer.close()
format_text(summarize(trainer.report(), None, 1.0, interrupted=True))
graph_mode = "stagefeed.consumer.graph"  # the package: the feeding graph, its trainer, AlexNet
print(sorted(name for name in sys.modules if name.startswith(graph_mode)))
"""


@pytest.mark.slow
def test_a_keras_run_does_not_import_graph_mode():
    """Graph mode imports TensorFlow's private ``StagingArea``: a release that drops it must
    not fail Keras runs. What a Keras run imports (its trainer, monitor and summary) is
    imported by a real ``KerasTrainer``, started and closed, and its summary printed."""
    done = subprocess.run(
        [sys.executable, "-c", KERAS_RUN_MODULES], capture_output=True, text=True,
        timeout=120, cwd=REPO, env=cli_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


CUSTOM_LOOP_MODULES = """
import sys
import tensorflow as tf

def keras_modules():
    return {name for name in sys.modules if name == "keras" or name.startswith("keras.")}

with_tensorflow = keras_modules()  # TensorFlow 2.21 imports Keras itself (tf.keras)
import stagefeed
from stagefeed.common.schema import image_schema
from stagefeed.consumer.tf2.feed import Feed

assert stagefeed.Feed is Feed
feed = Feed(image_schema(batch_size=2), capacity=4, device="/cpu:0")
feed.dataset(("images", "labels"))
feed.close()
print(sorted(keras_modules() - with_tensorflow))
print(sorted(name for name in sys.modules if name.startswith("stagefeed.consumer.keras_fit")))
print(bool(with_tensorflow))
"""


@pytest.mark.slow
def test_a_custom_loop_with_feed_does_not_import_the_keras_path():
    """A custom ``tf.function`` loop wants ``Feed`` and its dataset only: importing it through
    ``stagefeed.Feed`` or its module, making one and its dataset load nothing of ``keras_fit``
    (the callback, the model check: Keras' ``fit`` path) and no Keras module that TensorFlow
    did not load itself. (TensorFlow 2.21's own import loads Keras, printed on the last line;
    the Keras helpers of ``Feed`` are imported by the methods that return them.)"""
    done = subprocess.run(
        [sys.executable, "-c", CUSTOM_LOOP_MODULES], capture_output=True, text=True,
        timeout=120, cwd=REPO, env=cli_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    added_keras, keras_path, _ = done.stdout.splitlines()[-3:]
    assert (added_keras, keras_path) == ("[]", "[]"), done.stdout
