"""Endpoints are parsed at start: a bad one fails naming the field and the value."""

from __future__ import annotations

import pytest

from stagefeed.common.checks import check_endpoint
from stagefeed.common.endpoints import MAX_IPC_PATH_BYTES, Endpoint, parse
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ProducerOptions, TrainerOptions


@pytest.mark.parametrize(
    ("value", "bind", "expected"),
    [
        ("tcp://127.0.0.1:5555", False, Endpoint("tcp", "127.0.0.1", 5555)),
        ("tcp://trainer:1", False, Endpoint("tcp", "trainer", 1)),
        ("tcp://gpu-01.example.com.:65535", False, Endpoint("tcp", "gpu-01.example.com.", 65535)),
        ("tcp://[::1]:5555", False, Endpoint("tcp", "::1", 5555)),
        ("tcp://*:5555", True, Endpoint("tcp", "*", 5555)),
        ("tcp://127.0.0.1:*", True, Endpoint("tcp", "127.0.0.1", 0)),
        ("tcp://127.0.0.1:0", True, Endpoint("tcp", "127.0.0.1", 0)),
        ("ipc:///tmp/stagefeed.sock", False, Endpoint("ipc", path="/tmp/stagefeed.sock")),
        ("ipc://@abstract", False, Endpoint("ipc", path="@abstract")),
        ("ipc://*", True, Endpoint("ipc", path="*")),
        ("inproc://recv-1", False, Endpoint("inproc", path="recv-1")),
    ],
)
def test_good_endpoints_parse(value, bind, expected):
    endpoint = parse("f", value, bind=bind)
    assert endpoint == expected
    assert parse("f", str(endpoint), bind=bind) == endpoint  # str() is libzmq syntax again


def test_properties():
    assert parse("f", "tcp://[::1]:5", bind=False).ipv6
    assert not parse("f", "tcp://127.0.0.1:5", bind=False).ipv6
    assert parse("f", "tcp://h:*", bind=True).random
    assert parse("f", "ipc://*", bind=True).random
    assert str(parse("f", "tcp://h:0", bind=True)) == "tcp://h:*"


LONG_IPC = "ipc:///" + "x" * MAX_IPC_PATH_BYTES  # one byte over: the leading / counts


@pytest.mark.parametrize(
    ("value", "bind", "why"),
    [
        ("tcp://127.0.0.1:99999", True, "port 99999 is not in 1..65535"),
        ("tcp://127.0.0.1:65536", False, "port 65536 is not in 1..65535"),
        ("tcp://host:0", False, "port must be in 1..65535"),
        ("tcp://host:*", False, "port must be in 1..65535"),
        ("tcp://host:-1", False, "is not a number"),
        ("tcp://host:5555x", False, "is not a number"),
        ("tcp://host", False, "the port is missing"),
        ("tcp://:5555", True, "the host is missing"),
        ("tcp://*:5555", False, "host \\* only names every interface to bind"),
        ("tcp://999.0.0.1:5555", False, "not an IPv4 address"),
        ("tcp://::1:5555", False, "IPv6 address goes in brackets"),
        ("tcp://[::g]:5555", False, "not an IPv6 address"),
        ("tcp://[127.0.0.1]:5555", False, "not an IPv6 address"),
        ("tcp://bad_host-:5555", False, "not an IP address or a DNS name"),
        ("tcp://a b:5555", False, "not an IP address or a DNS name"),
        ("tcp://" + "a" * 64 + ":5555", False, "not an IP address or a DNS name"),
        ("ipc://", True, "needs a name"),
        ("ipc://*", False, "only names a random socket file to bind"),
        (LONG_IPC, True, f"is {MAX_IPC_PATH_BYTES + 1} bytes"),
        ("inproc://", False, "needs a name"),
        ("udp://host:5555", False, "expected tcp://HOST:PORT"),
        ("localhost:5555", False, "expected tcp://HOST:PORT"),
    ],
)
def test_bad_endpoints_name_the_field_and_the_value(value, bind, why):
    with pytest.raises(ConfigError, match=why) as raised:
        parse("connect", value, bind=bind)
    message = str(raised.value)
    assert message.startswith(f"connect {value!r}: ")
    assert "\n" not in message


def test_the_longest_ipc_path_is_accepted():
    parse("bind", "ipc:///" + "x" * (MAX_IPC_PATH_BYTES - 1), bind=True)


def test_a_bad_endpoint_built_directly_is_refused():
    with pytest.raises(ConfigError, match="port 70000"):
        Endpoint("tcp", "127.0.0.1", 70000)
    with pytest.raises(ConfigError, match="transport"):
        Endpoint("udp", "127.0.0.1", 1)


def test_options_use_the_parser_bind_fields_take_wildcards():
    check_endpoint("bind", "tcp://*:*")
    check_endpoint("STAGEFEED_BIND", "tcp://*:5555")  # stagefeed health's field
    with pytest.raises(ConfigError, match="--connect 'tcp://\\*:5555'"):
        check_endpoint("--connect", "tcp://*:5555")
    with pytest.raises(ConfigError, match="bind 'tcp://127.0.0.1:99999'"):
        TrainerOptions(bind="tcp://127.0.0.1:99999")
    with pytest.raises(ConfigError, match="connect 'tcp://host:0'"):
        ProducerOptions(connect="tcp://host:0")
    assert TrainerOptions(bind="tcp://127.0.0.1:*").bind == "tcp://127.0.0.1:*"
