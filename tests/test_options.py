"""Options fail at construction with a message naming the bad value."""

from __future__ import annotations

import pytest
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ProducerOptions, TrainerOptions
from stagefeed.common.schema import image_schema


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"dtype": "float64"}, "float64"),
        ({"num_classes": -3}, "num_classes"),
    ],
)
def test_bad_spec_names_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        image_schema(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"connect": "localhost:5555"}, "localhost:5555"),
        ({"workers": 0}, "workers"),
        ({"inflight_mb": -1}, "inflight_mb"),
        ({"rate": -1}, "rate"),
        ({"source": "not a ref"}, "not a ref"),
    ],
)
def test_bad_producer_option_names_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        ProducerOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"bind": "tcp://*"}, "tcp://\\*"),
        ({"recv_threads": 0}, "recv_threads"),
        ({"steps": -1}, "steps"),
        ({"queue_mb": 1}, "queue_mb=1"),
        ({"stage_depth": 0}, "stage_depth"),
        ({"device": "tpu"}, "tpu"),
        ({"max_message_mb": 1}, "max_message_mb=1"),
    ],
)
def test_bad_trainer_option_names_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        TrainerOptions(**kwargs)


def test_byte_budgets_derive_message_counts():
    spec = image_schema()  # 158.9 MB float32 batch
    assert ProducerOptions(inflight_mb=512).max_unsent(spec) == 3
    assert ProducerOptions(inflight_mb=1).max_unsent(spec) == 1
    assert TrainerOptions(schema=spec, queue_mb=2048).queue_capacity == 13
    small = image_schema(batch_size=256, dtype="uint8")
    assert TrainerOptions(schema=small, queue_mb=2048).queue_capacity == 54
    assert TrainerOptions(schema=spec).max_message_bytes == spec.batch_bytes + 2**20
