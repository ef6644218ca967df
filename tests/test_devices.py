"""One device resolver for every trainer (``consumer/devices.py``)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.consumer.devices import is_gpu, training_device

NO_GPU = pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")), reason="a GPU is present"
)


@NO_GPU
def test_auto_is_the_cpu_without_a_gpu_and_gpu_is_refused_naming_it():
    assert training_device("auto") == training_device("cpu") == "/cpu:0"
    with pytest.raises(ConfigError, match="device 'gpu' requested but TensorFlow sees no GPU"):
        training_device("gpu")


@pytest.mark.parametrize("name", ["/cpu:0", "/gpu:1", "/device:GPU:0"])
def test_a_device_name_is_kept_as_given(name):
    assert training_device(name) == name


@pytest.mark.parametrize("bad", ["", None, 3])
def test_anything_else_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="device must be"):
        training_device(bad)


def test_gpu_names_are_told_from_cpu_names():
    assert [is_gpu(d) for d in ("/gpu:0", "/gpu:1", "/device:GPU:0", "/cpu:0")] == [
        True, True, True, False,
    ]  # fmt: skip
