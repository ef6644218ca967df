"""STAGEFEED_* variables are checked for the command that runs, not for every command.

One environment serves every command in a container: compose sets STAGEFEED_TRANSPORT for the
trainer, whose healthcheck then runs `stagefeed health` (no such flag) in that same environment;
and `ipc`, a deprecated spelling `run` still takes, was never a transport of `train` or `produce`.
"""

from __future__ import annotations

import pytest

from stagefeed import envflags
from stagefeed.cli import build_parser
from stagefeed.common.errors import ConfigError
from tests.conftest import cli_env, free_tcp_port, run_cli


def test_a_value_valid_for_one_command_is_an_error_only_for_the_others(monkeypatch):
    monkeypatch.setenv("STAGEFEED_TRANSPORT", "ipc")
    parser = build_parser()
    run = parser.parse_args(["run"])
    envflags.check(run)
    assert run.transport == "ipc"  # taken, then said to be deprecated (test_docs_flags.py)
    for command in ("train", "produce"):
        args = parser.parse_args([command])
        with pytest.raises(ConfigError, match=r"STAGEFEED_TRANSPORT='ipc' must be one of zmq, sh"):
            envflags.check(args)


def test_one_transport_vocabulary_for_every_command(monkeypatch):
    monkeypatch.setenv("STAGEFEED_TRANSPORT", "zmq")
    parser = build_parser()
    for command in ("run", "train", "produce"):
        args = parser.parse_args([command])
        envflags.check(args)
        assert args.transport == "zmq", command


def test_a_bad_value_names_itself_even_when_the_flag_is_given(monkeypatch):
    monkeypatch.setenv("STAGEFEED_QUEUE_MB", "lots")
    monkeypatch.setenv("STAGEFEED_RETURN_FREED_MEMORY", "maybe")
    args = build_parser().parse_args(["train", "--queue-mb", "64"])
    with pytest.raises(ConfigError, match=r"STAGEFEED_QUEUE_MB='lots' is not a valid --queue-mb"):
        envflags.check(args)
    assert envflags.check(build_parser().parse_args(["produce"])) is None


def test_the_healthcheck_runs_in_the_trainer_containers_environment():
    """`stagefeed health` beside STAGEFEED_TRANSPORT=zmq: answers (unhealthy, nothing listens),
    instead of failing at start with exit 2 on a flag it does not have."""
    port = free_tcp_port()
    done = run_cli(
        ["health", "--connect", f"tcp://127.0.0.1:{port}", "--timeout-s", "1"],
        timeout=60,
        env=cli_env(STAGEFEED_TRANSPORT="zmq"),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "connection refused" in done.stdout
