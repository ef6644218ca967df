"""Producer flags: what producers send (``add_producer_flags``: ``produce`` and ``run``), and
``produce``'s trainers (``add_connect_flags``): ``--connect`` (repeated, or a comma-separated
list), ``--connect-tf-config PORT`` (every training task of ``TF_CONFIG``),
``--heartbeat-timeout-s``.

One producer may feed several trainer workers (MultiWorkerMirroredStrategy: each binds its
own feed): each batch goes to exactly one of them (``producer.fanout``, docs/scaling.md).

Where the list comes from, first found wins: ``--connect`` or ``--connect-tf-config`` on the
command line (not both), then ``STAGEFEED_CONNECT`` (a comma-separated list, as the Kubernetes
manifests set it) or ``STAGEFEED_CONNECT_TF_CONFIG`` (not both), then ``DEFAULT``. A bad
endpoint, an empty item or a repeated endpoint fails at start in one line naming it (exit 2).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping

from stagefeed import envflags
from stagefeed.common import tf_config
from stagefeed.common.checks import check_endpoints
from stagefeed.common.endpoints import MAX_PORT
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import SHORT_BATCH
from stagefeed.data_flags import add_data_flags

DEFAULT = "tcp://127.0.0.1:5555"
CONNECT_ENV = envflags.env_name("--connect")
TF_CONFIG_ENV = envflags.env_name("--connect-tf-config")


def add_producer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("producer")
    envflags.add(
        g, "--source", default="synthetic",
        help="'synthetic', module:function, or data: npy:PATH[,PATH], npz:PATH, images:DIR, "
        "parquet:PATH[,PATH] (docs/data.md)",
    )  # fmt: skip
    envflags.add(g, "--inflight-mb", type=float, default=512.0, help="unsent bytes per producer")
    envflags.add(g, "--rate", type=float, default=0.0, help="batches/s per producer (0: no limit)")
    envflags.add(g, "--max-batches", type=int, default=0, help="batches per producer (0: no limit)")
    envflags.add(
        g, "--short-batch", default="refuse", choices=SHORT_BATCH,
        help="a source's batch with fewer rows than --batch-size: refuse it (exit 2) or drop "
        "it (counted and logged; like tf.data's drop_remainder)",
    )  # fmt: skip
    envflags.add(
        g, "--seed", type=int, default=0,
        help="RNG seed of the synthetic source, or of a data source's order and transform",
    )  # fmt: skip
    add_data_flags(g)


def add_shard_group_flag(p: argparse.ArgumentParser) -> None:
    """``produce``'s ``--shard-group G/K`` (``run``'s producers are the only group)."""
    envflags.add(
        p, "--shard-group", type=parse_shard_group, default="0/1", metavar="G/K",
        help="these --workers are group G of K produce commands (one per trainer worker): "
        "worker i is shard G+i*K of K*workers, seed --seed+shard (docs/resume.md)",
    )  # fmt: skip


class ShardGroupSyntaxError(argparse.ArgumentTypeError, ValueError):
    """A ``--shard-group`` that is not ``G/K``. An ``ArgumentTypeError`` so that argparse
    shows its text (for a plain ``ValueError`` it only says "invalid value"), and a
    ``ValueError`` so that ``envflags`` reports it for ``STAGEFEED_SHARD_GROUP`` too."""


def parse_shard_group(text: str) -> tuple[int, int]:
    """``"G/K"`` as ``(G, K)``; ``ShardGroupSyntaxError`` unless it is two unsigned integers
    around one slash (the range is ``ProducerOptions``'s to check: it knows ``workers``)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None:
        raise ShardGroupSyntaxError(f"{text!r}: expected GROUP/GROUPS, such as 0/2")
    return int(match[1]), int(match[2])


def add_connect_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trainers", "Where batches go; each batch goes to one trainer.")
    g.add_argument(
        "--connect", action="append", default=None, metavar="ENDPOINT",
        help="a trainer's address; several trainer workers: repeat it or separate them with "
        f"commas [env {CONNECT_ENV}; default: {DEFAULT}]",
    )  # fmt: skip
    g.add_argument(
        "--connect-tf-config", type=str, default=None, metavar="PORT",
        help="connect to every training task in TF_CONFIG (the trainers' cluster), at this "
        f"feed port [env {TF_CONFIG_ENV}; default: none]",
    )  # fmt: skip
    envflags.add(
        g, "--heartbeat-timeout-s", type=float, default=0.0,
        shown_default="0: twice a batch's send time at 10 MiB/s, at least 10 s",
        help="a trainer connection silent this long is dropped and reported lost",
    )  # fmt: skip


def endpoints(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The trainers' endpoints the flags (then the environment) name; ``ConfigError`` naming
    the flag or variable and the bad value."""
    environ = os.environ if environ is None else environ
    if args.connect is not None and args.connect_tf_config is not None:
        raise ConfigError("--connect and --connect-tf-config both name the trainers: give one")
    if args.connect is not None:
        return _split("--connect", args.connect)
    if args.connect_tf_config is not None:
        return _from_tf_config("--connect-tf-config", args.connect_tf_config, environ)
    listed, port = environ.get(CONNECT_ENV, ""), environ.get(TF_CONFIG_ENV, "")
    if listed and port:
        raise ConfigError(f"{CONNECT_ENV} and {TF_CONFIG_ENV} are both set: give one")
    if listed:
        return _split(CONNECT_ENV, [listed])
    if port:
        return _from_tf_config(TF_CONFIG_ENV, port, environ)
    return (DEFAULT,)


def _split(field: str, values: list[str]) -> tuple[str, ...]:
    items = [item.strip() for value in values for item in value.split(",")]
    if not all(items):
        raise ConfigError(f"{field} {','.join(values)!r}: an empty endpoint between commas")
    return check_endpoints(field, items)


def _from_tf_config(field: str, port: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    if not tf_config.in_range(port, 1, MAX_PORT):
        shown = port if len(port) <= 20 else f"{port[:17]}... ({len(port)} characters)"
        raise ConfigError(f"{field} {shown!r}: expected the feed's port, a number in 1..{MAX_PORT}")
    config = tf_config.from_environ(environ)
    if config is None:
        raise ConfigError(f"{field} {port}: {tf_config.ENV} is not set (or names no cluster)")
    listed = tf_config.trainer_endpoints(config, int(port))
    repeated = sorted({e for e in listed if listed.count(e) > 1})
    if repeated:
        raise ConfigError(
            f"{field} {port}: {tf_config.ENV} has several training tasks on the host of "
            f"{repeated[0]}, and they cannot share one feed port: list them with --connect"
        )
    return check_endpoints(field, listed)
