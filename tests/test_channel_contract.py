"""The ``Channel`` protocol (producer/channel_contract.py): ``TrainerChannel`` and ``Fanout``,
the two channels ``make_channel`` makes, each keep every member of it with the protocol's
parameters, so the producer's main loop can take either."""

from __future__ import annotations

import inspect

import pytest

from stagefeed.common.options import ProducerOptions
from stagefeed.producer.channel import TrainerChannel
from stagefeed.producer.channel_contract import Channel
from stagefeed.producer.fanout import Fanout, make_channel

MEMBERS = sorted(
    name for name in vars(Channel) if not name.startswith("_") and name != "mro"
)
METHODS = [name for name in MEMBERS if not isinstance(vars(Channel)[name], property)]
PROPERTIES = [name for name in MEMBERS if isinstance(vars(Channel)[name], property)]


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_names_the_main_loops_calls():
    assert {"open", "send", "acquire_slot", "commit_slot", "send_descriptor", "discard_slot",
            "finish", "close"} <= set(METHODS)  # fmt: skip
    assert set(PROPERTIES) == {"endpoint", "welcome", "repositioned", "lane"}


@pytest.mark.parametrize("cls", [TrainerChannel, Fanout], ids=["TrainerChannel", "Fanout"])
@pytest.mark.parametrize("name", METHODS)
def test_each_channel_has_every_method_with_the_protocols_parameters(cls, name):
    assert _parameters(getattr(cls, name)) == _parameters(getattr(Channel, name))


@pytest.mark.parametrize(
    "connect", [("tcp://127.0.0.1:9",), ("tcp://127.0.0.1:9", "tcp://127.0.0.1:10")],
    ids=["one trainer", "fan-out"],
)  # fmt: skip
def test_the_channel_make_channel_makes_has_every_attribute(connect):
    channel = make_channel(ProducerOptions(connect=connect), "contract", None)
    try:
        assert isinstance(channel, Fanout if len(connect) > 1 else TrainerChannel)
        missing = [name for name in PROPERTIES if not hasattr(channel, name)]
        assert not missing, missing
        assert channel.welcome is None and channel.repositioned is None
        assert channel.endpoint == ", ".join(connect)
    finally:
        channel.close()
