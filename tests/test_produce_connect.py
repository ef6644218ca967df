"""``stagefeed produce`` with several trainers: ``--connect`` repeated or a comma list,
``STAGEFEED_CONNECT``, ``--connect-tf-config PORT``; a bad endpoint fails at start in one line.

The command runs as a real process; the trainers are stand-ins (``tests.helpers.standin_trainer``):
real ROUTER sockets on loopback that read what arrives.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.producer_flags import DEFAULT, endpoints
from tests.conftest import cli_env, free_tcp_port, run_cli, wait_for
from tests.helpers.standin_trainer import StandInTrainer

SMALL = Schema((ArraySpec("x", "float32", (16,)), ArraySpec("y", "int32")), batch_size=4)
TWO_WORKERS = {
    "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.2:2222"]},
    "task": {"type": "worker", "index": 0},
}


def parsed(connect=None, tf_port=None) -> argparse.Namespace:
    return argparse.Namespace(connect=connect, connect_tf_config=tf_port)


def test_the_list_comes_from_the_flags_then_the_environment():
    env = {"STAGEFEED_CONNECT": " tcp://a:1, tcp://b:1", "TF_CONFIG": json.dumps(TWO_WORKERS)}
    assert endpoints(parsed(), {}) == (DEFAULT,)
    assert endpoints(parsed(), env) == ("tcp://a:1", "tcp://b:1")
    assert endpoints(parsed(["tcp://c:1", "tcp://d:1,tcp://e:1"]), env) == (
        "tcp://c:1", "tcp://d:1", "tcp://e:1",
    )  # fmt: skip
    assert endpoints(parsed(tf_port="5555"), env) == (
        "tcp://127.0.0.1:5555", "tcp://127.0.0.2:5555",
    )  # fmt: skip
    by_env = {"STAGEFEED_CONNECT_TF_CONFIG": "7000", "TF_CONFIG": env["TF_CONFIG"]}
    assert endpoints(parsed(), by_env) == ("tcp://127.0.0.1:7000", "tcp://127.0.0.2:7000")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (parsed(["tcp://a:1,tcp://b"]), {}, r"--connect 'tcp://b': the port is missing"),
        (parsed(["tcp://a:1", "tcp://a:1"]), {}, r"--connect names 'tcp://a:1' twice"),
        (parsed(), {"STAGEFEED_CONNECT": "tcp://a:1,"}, r"STAGEFEED_CONNECT .* an empty endpoint"),
        (parsed(["tcp://a:1"], "5555"), {}, r"--connect and --connect-tf-config both"),
        (parsed(tf_port="5555"), {}, r"--connect-tf-config 5555: TF_CONFIG is not set"),
        (parsed(tf_port="0"), {}, r"--connect-tf-config '0': expected the feed's port"),
        (
            parsed(tf_port="5555"),
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1", "h:2"]}, "task": {}})},
            r"TF_CONFIG task\.type None",
        ),
        (
            parsed(tf_port="5555"),
            {"TF_CONFIG": json.dumps({**TWO_WORKERS, "cluster": {"worker": ["h:1", "h:2"]}})},
            r"several training tasks on the host of tcp://h:5555, .* list them with --connect",
        ),
    ],
)
def test_a_bad_list_is_named(args, env, message):
    with pytest.raises(ConfigError, match=message):
        endpoints(args, env)


def test_a_bad_endpoint_in_the_list_fails_at_start_in_one_line_naming_it():
    done = run_cli(["produce", "--connect", "tcp://127.0.0.1:5555,tcp://trainer-1:99999"])
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "stagefeed: error: --connect 'tcp://trainer-1:99999': port 99999 is not in 1..65535"
    ], done.stderr


# Each stand-in grants credit for half the batches and no more, so both get some by
# construction: one that took them all while the other's welcome was slow (a loaded host) left
# the other with no batch and, never welcomed, no ``end`` (producer/fanout.py).
HALF = {"credit": 6, "regrant": False}


def _produce_to(trainers: list[StandInTrainer], *args: str, env: dict[str, str]) -> str:
    done = run_cli(["produce", "--max-batches", "12", *args], timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    for t in trainers:
        assert wait_for(lambda t=t: t.ends, 10), t.endpoint
        count = len(t.received)
        assert count > 0 and t.seqs() == list(range(count)) and t.ends[0][1] == count
    assert [len(t.received) for t in trainers] == [6] * len(trainers)
    return done.stdout + done.stderr


def test_stagefeed_connect_lists_trainers_separated_by_commas():
    with StandInTrainer(SMALL, **HALF) as a, StandInTrainer(SMALL, **HALF) as b:
        env = cli_env(STAGEFEED_CONNECT=f"{a.endpoint},{b.endpoint}")
        log = _produce_to([a, b], env=env)
    assert re.search(rf"-> {re.escape(a.endpoint)}, {re.escape(b.endpoint)}:", log), log


def test_connect_tf_config_reaches_every_worker_of_the_cluster():
    port = free_tcp_port()
    hosts = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.2:{port}"]
    with StandInTrainer(SMALL, hosts[0], **HALF) as a, StandInTrainer(SMALL, hosts[1], **HALF) as b:
        env = cli_env(TF_CONFIG=json.dumps(TWO_WORKERS))
        _produce_to([a, b], "--connect-tf-config", str(port), env=env)
