"""Producer sources: the synthetic pool and user generators, checked before sending."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from stagefeed.common.errors import ConfigError
from stagefeed.common.spec import BatchSpec
from stagefeed.producer.sources import SyntheticSource, UserSource, open_source

SPEC = BatchSpec(batch_size=4, height=8, width=8, num_classes=10)


@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_synthetic_pool_is_reused_round_robin(dtype):
    spec = BatchSpec(batch_size=4, height=8, width=8, num_classes=10, image_dtype=dtype)
    source = SyntheticSource(spec, pool_size=3)
    batches = list(itertools.islice(iter(source), 7))
    addresses = [dict(b)["images"].ctypes.data for b in batches]
    assert addresses[:3] == addresses[3:6] and addresses[6] == addresses[0]
    assert len(set(addresses[:3])) == 3
    images, labels = dict(batches[0])["images"], dict(batches[0])["labels"]
    assert images.dtype == np.dtype(dtype) and images.shape == spec.image_shape
    assert labels.dtype == np.int32 and labels.min() >= 0 and labels.max() < 10
    assert images.std() > 0  # random, not zeros


def test_user_source_is_loaded_and_checked():
    source = open_source("tests.user_source:batches", SPEC, worker_index=3, pool_size=1, seed=0)
    arrays = dict(next(iter(source)))
    assert (arrays["labels"] == 3).all()


def test_user_source_with_wrong_shape_fails_naming_it():
    source = UserSource("tests.user_source:wrong_shape", SPEC, 0)
    with pytest.raises(ConfigError, match=r"wrong_shape.*images is float32\[1, 2, 3\]"):
        next(iter(source))


@pytest.mark.parametrize("ref", ["tests.nonexistent:f", "tests.user_source:nope"])
def test_unloadable_source_fails_naming_it(ref):
    with pytest.raises(ConfigError, match=ref):
        UserSource(ref, SPEC, 0)
