"""ProducerOptions v2: an optional schema, and the held-batch bound derived from it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from stagefeed.common import protocol
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import MAX_UNSENT, MIB, ProducerOptions
from stagefeed.common.schema import ArraySpec, Schema, image_schema
from stagefeed.producer.session import message_bytes
from stagefeed.producer.worker import worker_info


def test_schema_defaults_to_the_trainers():
    assert ProducerOptions().schema is None


def test_schema_must_be_a_schema():
    with pytest.raises(ConfigError, match="schema must be a Schema or None, got dict"):
        ProducerOptions(schema={"batch_size": 4})


@pytest.mark.parametrize(
    ("inflight_mb", "expected"),
    [(512, 3), (302, 2), (301, 1), (1, 1)],  # 151 MiB a batch; one fits, however small the budget
)
def test_max_unsent_comes_from_the_schemas_batch_size(inflight_mb, expected):
    schema = image_schema()
    assert schema.batch_bytes / MIB == pytest.approx(150.96, abs=0.01)
    assert ProducerOptions(inflight_mb=inflight_mb).max_unsent(schema) == expected


def test_max_unsent_is_capped_for_tiny_batches():
    tiny = Schema((ArraySpec("x", "float32"),), batch_size=1)
    assert ProducerOptions().max_unsent(tiny) == MAX_UNSENT


def test_worker_info_shards_and_seeds_per_worker():
    options = ProducerOptions(workers=3, seed=10)
    infos = [worker_info(options, i) for i in range(3)]
    assert [(w.index, w.count, w.seed) for w in infos] == [(0, 3, 10), (1, 3, 11), (2, 3, 12)]
    assert len({w.producer_id for w in infos}) == 3


def test_message_bytes_counts_the_header_exactly():
    schema = image_schema(4, 8)
    arrays = [(n, np.zeros(s, d)) for n, d, s in schema.wire()]
    frames = protocol.encode_batch(2**63 - 1, arrays)
    assert message_bytes(schema) == sum(memoryview(f).nbytes for f in frames)


def test_the_producer_never_imports_tensorflow():
    code = (
        "import sys; import stagefeed.producer.pool, stagefeed.producer.worker; "
        "sys.exit('tensorflow' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


def test_connect_is_a_tuple_of_endpoints_and_one_string_is_one_endpoint():
    assert ProducerOptions().connect == ("tcp://127.0.0.1:5555",)
    assert ProducerOptions(connect="tcp://a:1").connect == ("tcp://a:1",)
    assert ProducerOptions(connect=["tcp://a:1", "tcp://b:1"]).connect == ("tcp://a:1", "tcp://b:1")


@pytest.mark.parametrize(
    ("connect", "message"),
    [
        (("tcp://a:1", "tcp://b"), r"connect 'tcp://b': the port is missing"),
        (("tcp://a:1", "tcp://a:1"), r"connect names 'tcp://a:1' twice"),
        ((), r"connect must name at least one endpoint"),
        ("tcp://a:1,tcp://b:1", r"one endpoint per string; give several as a tuple"),
    ],
)
def test_a_bad_endpoint_in_the_list_is_named(connect, message):
    with pytest.raises(ConfigError, match=message):
        ProducerOptions(connect=connect)


def test_heartbeat_timeout_is_checked():
    with pytest.raises(ConfigError, match="heartbeat_timeout_s must be a finite number >= 0"):
        ProducerOptions(heartbeat_timeout_s=float("nan"))
