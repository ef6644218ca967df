"""``TF_CONFIG``: the cluster a trainer worker belongs to, parsed and checked before TensorFlow.

TensorFlow's multi-worker strategies read the cluster from the ``TF_CONFIG`` environment
variable, a JSON object::

    {"cluster": {"worker": ["trainer-0.trainer:2222", "trainer-1.trainer:2222"]},
     "task": {"type": "worker", "index": 1}}

TensorFlow checks it late and tersely; ``parse`` checks it at start, with TensorFlow's own
rules (``tensorflow/python/distribute/multi_worker_util.py``, ``_validate_cluster_spec``):
task types are ``chief``, ``worker``, ``ps`` and ``evaluator``; at most one chief and one
evaluator; the task's type is in the cluster (an evaluator need not be) and its index is in
range. Every address must be ``HOST:PORT`` (``[IPv6]:PORT``). A bad value is a ``ConfigError``
of one line naming it. No TensorFlow here: producers and the CLI use this module too.

Who is who, under MultiWorkerMirroredStrategy: every ``chief`` and ``worker`` task trains, and
each binds its own feed (``worker_hosts``, ``trainer_endpoints``: what producers connect to).
The *chief* writes the cluster's files (``is_chief``): the ``chief`` task, or worker 0 of a
cluster without one. (TensorFlow also calls an evaluator "chief" of its own summaries; an
evaluator trains nothing here, so it writes no checkpoint.)

A trainer's place (``ClusterPlace``: in a cluster or not, its index, the count, chief or not)
is resolved once, where the trainer is made (``place``: the launcher, or a trainer or
``ServedFeed`` made from Python without one), and passed down: the intake, the checkpoints
and the cluster's strategy take it as a parameter and never read the environment.

Two ways a Kubernetes trainer gets its ``TF_CONFIG`` (docs/kubernetes.md):

- a Kubeflow ``TFJob``: the training operator sets it;
- an Indexed Job behind a headless Service: ``derive_for_indexed_job`` builds it from the
  pod's ``JOB_COMPLETION_INDEX`` and the ``STAGEFEED_TRAINER_*``/``STAGEFEED_TF_PORT``
  variables (``INDEXED_JOB_VARIABLES``); ``stagefeed train`` calls ``apply_indexed_job``
  before TensorFlow loads, when ``TF_CONFIG`` is unset.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

from stagefeed.common.endpoints import MAX_PORT, Endpoint, host_problem
from stagefeed.common.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "TF_CONFIG"
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
TRAINING_TYPES = ("chief", "worker")  # the tasks that train under MultiWorkerMirroredStrategy
_ONE_AT_MOST = ("chief", "evaluator")

# An Indexed Job's variables: the pod's index (set by Kubernetes), then ours.
JOB_INDEX = "JOB_COMPLETION_INDEX"
WORKERS = "STAGEFEED_TRAINER_WORKERS"  # trainer workers: the Job's completions
JOB = "STAGEFEED_TRAINER_JOB"  # the Job's name: pod I's hostname is JOB-I
SERVICE = "STAGEFEED_TRAINER_SERVICE"  # the headless Service: the pods' subdomain
TF_PORT = "STAGEFEED_TF_PORT"  # TensorFlow's own port between workers (not the feed's)
INDEXED_JOB_VARIABLES = (WORKERS, JOB, SERVICE, TF_PORT)
# Kubernetes caps an Indexed Job's completions at 100000 (batch/v1 JobSpec.completions).
MAX_WORKERS = 100_000

_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")  # RFC 1123, as Kubernetes


@dataclasses.dataclass(frozen=True)
class TfConfig:
    """A checked ``TF_CONFIG``: ``cluster`` maps each task type to its ``HOST:PORT`` addresses."""

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int

    def worker_hosts(self) -> tuple[str, ...]:
        """The addresses of the tasks that train: the chief (if any), then the workers."""
        return tuple(a for kind in TRAINING_TYPES for a in self.cluster.get(kind, ()))

    @property
    def num_workers(self) -> int:
        """How many tasks train (``worker_hosts``)."""
        return len(self.worker_hosts())

    @property
    def is_chief(self) -> bool:
        """Whether this task writes the cluster's files (see the module docstring)."""
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and "chief" not in self.cluster

    def to_json(self) -> str:
        return json.dumps(
            {
                "cluster": {kind: list(addresses) for kind, addresses in self.cluster.items()},
                "task": {"type": self.task_type, "index": self.task_index},
            }
        )


def parse(text: str | None) -> TfConfig | None:
    """``text`` (a ``TF_CONFIG`` value) checked; None when it describes no cluster (unset,
    empty, or ``{}``: TensorFlow then runs one local worker)."""
    if text is None or not text.strip():
        return None
    try:
        config = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{ENV} is nested too deeply to be a cluster: {_short(text)}") from None
    except ValueError as exc:
        raise ConfigError(f"{ENV} is not JSON: {_short(str(exc))} in {_short(text)}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{ENV} must be a JSON object, got {_short(text)}")
    cluster_value, task_value = config.get("cluster"), config.get("task")
    if not cluster_value and task_value is None:
        return None
    cluster = _cluster(cluster_value)
    task_type, task_index = _task(task_value, cluster)
    return TfConfig(cluster, task_type, task_index)


def from_environ(environ: Mapping[str, str] | None = None) -> TfConfig | None:
    """``parse`` of ``TF_CONFIG`` in ``environ`` (default: this process's environment)."""
    return parse((os.environ if environ is None else environ).get(ENV))


@dataclasses.dataclass(frozen=True)
class ClusterPlace:
    """Where a trainer stands (see the module docstring). ``index`` counts the chief first
    (0..count-1), as the strategy numbers its workers; ``chief``: it writes the cluster's
    files; ``named``: ``TF_CONFIG`` names a cluster (of one trainer or more). The default is
    no cluster: one trainer, its own chief."""

    index: int = 0
    count: int = 1
    chief: bool = True
    named: bool = False

    @property
    def in_cluster(self) -> bool:
        """Whether there is more than one trainer worker."""
        return self.count > 1

    @classmethod
    def of(cls, config: TfConfig | None) -> ClusterPlace:
        """The place ``config`` gives this process (no cluster for None); ``ConfigError`` for
        a task that does not train (``ps``, ``evaluator``)."""
        if config is None:
            return cls()
        if config.task_type not in TRAINING_TYPES:
            raise ConfigError(
                f"{ENV}: a trainer is a 'chief' or 'worker' task, not {config.task_type!r:.40}"
            )
        address = config.cluster[config.task_type][config.task_index]
        index = config.worker_hosts().index(address)
        return cls(index, config.num_workers, config.is_chief, named=True)


NO_CLUSTER = ClusterPlace()


def place(environ: Mapping[str, str] | None = None) -> ClusterPlace:
    """This process's ``ClusterPlace`` from ``TF_CONFIG`` in ``environ`` (default: the
    environment). Called where a trainer is made, once; everything below takes the value."""
    return ClusterPlace.of(from_environ(environ))


def trainer_endpoints(tf_config: TfConfig | str, port: int) -> list[str]:
    """The feed endpoint ``tcp://HOST:PORT`` of every training task, in ``worker_hosts``
    order: where producers connect (``port`` is the feed's, not TensorFlow's)."""
    config = parse(tf_config) if isinstance(tf_config, str) else tf_config
    if config is None:
        raise ConfigError(f"{ENV} describes no cluster: there are no trainer workers to list")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= MAX_PORT:
        raise ConfigError(f"the feed port must be in 1..{MAX_PORT}, got {port!r}")
    return [str(Endpoint("tcp", _split(a)[0], port)) for a in config.worker_hosts()]


def derive_for_indexed_job(env: Mapping[str, str]) -> str | None:
    """The ``TF_CONFIG`` of an Indexed Job's pod, from ``env``; None if ``env`` sets none of
    ``INDEXED_JOB_VARIABLES``. Pod I of Job ``JOB``, whose pods have the headless Service
    ``SERVICE`` as subdomain, is reachable at ``JOB-I.SERVICE`` (in its namespace), so::

        cluster.worker = ["JOB-0.SERVICE:PORT", ..., "JOB-(N-1).SERVICE:PORT"]
        task = {"type": "worker", "index": JOB_COMPLETION_INDEX}
    """
    given = [name for name in INDEXED_JOB_VARIABLES if env.get(name, "") != ""]
    if not given:
        return None
    missing = [name for name in (*INDEXED_JOB_VARIABLES, JOB_INDEX) if env.get(name, "") == ""]
    if missing:
        raise ConfigError(
            f"{given[0]} is set but {missing[0]} is not: an Indexed Job's TF_CONFIG needs "
            f"{', '.join(INDEXED_JOB_VARIABLES)} and {JOB_INDEX}"
        )
    workers = _number(WORKERS, env[WORKERS], 1, MAX_WORKERS)
    index = _number(JOB_INDEX, env[JOB_INDEX], 0, workers - 1)
    port = _number(TF_PORT, env[TF_PORT], 1, MAX_PORT)
    job, service = _label(JOB, env[JOB]), _label(SERVICE, env[SERVICE])
    if len(f"{job}-{workers - 1}") > 63:
        raise ConfigError(f"{JOB}={job!r}: pod hostname {job}-{workers - 1} is over 63 characters")
    hosts = tuple(f"{job}-{i}.{service}:{port}" for i in range(workers))
    return TfConfig({"worker": hosts}, "worker", index).to_json()


def apply_indexed_job(environ: MutableMapping[str, str] | None = None) -> TfConfig | None:
    """Set ``TF_CONFIG`` from an Indexed Job's variables (``derive_for_indexed_job``) unless it
    is set already; the cluster this process is in (None: none). Call before TensorFlow
    loads. Both given is an error: one cluster, one description."""
    environ = os.environ if environ is None else environ
    derived = derive_for_indexed_job(environ)
    if derived is None:
        return from_environ(environ)
    if environ.get(ENV, "").strip():
        given = next(n for n in INDEXED_JOB_VARIABLES if environ.get(n, "") != "")
        raise ConfigError(
            f"{ENV} is set and so is {given}: give the cluster one way (a TFJob sets "
            f"{ENV}; an Indexed Job sets {', '.join(INDEXED_JOB_VARIABLES)})"
        )
    environ[ENV] = derived
    config = parse(derived)
    assert config is not None  # derived describes a cluster
    log.info(
        "TF_CONFIG from the Indexed Job: worker %d of %d (%s)",
        config.task_index,
        config.num_workers,
        config.cluster["worker"][config.task_index],
    )
    return config


def _cluster(value: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{ENV} cluster must be an object of task lists, got {_short(value)}")
    cluster: dict[str, tuple[str, ...]] = {}
    for kind, addresses in value.items():
        if kind not in TASK_TYPES:
            raise ConfigError(
                f"{ENV} cluster has task type {kind!r}; TensorFlow knows {', '.join(TASK_TYPES)}"
            )
        if isinstance(addresses, dict):
            raise ConfigError(
                f"{ENV} cluster.{kind} is a map of indexes (a TFJob with enableDynamicWorker); "
                "MultiWorkerMirroredStrategy needs the full list"
            )
        if not isinstance(addresses, list) or not addresses:
            raise ConfigError(f"{ENV} cluster.{kind} must be a non-empty list, got {addresses!r}")
        if kind in _ONE_AT_MOST and len(addresses) > 1:
            raise ConfigError(f"{ENV} cluster.{kind} has {len(addresses)} tasks; at most one")
        for i, address in enumerate(addresses):
            _split(address, f"{ENV} cluster.{kind}[{i}]")
        cluster[kind] = tuple(addresses)
    return cluster


def _task(value: Any, cluster: Mapping[str, tuple[str, ...]]) -> tuple[str, int]:
    if not isinstance(value, dict):
        raise ConfigError(f"{ENV} task must be an object with type and index, got {value!r}")
    kind, index = value.get("type"), value.get("index", 0)
    if kind not in TASK_TYPES:
        raise ConfigError(f"{ENV} task.type {kind!r} is not one of {', '.join(TASK_TYPES)}")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(f"{ENV} task.index must be an integer >= 0, got {json.dumps(index)}")
    if kind not in cluster:
        if kind != "evaluator":
            raise ConfigError(f"{ENV} task.type {kind!r} is not in the cluster ({_kinds(cluster)})")
        if index != 0:
            raise ConfigError(f"{ENV} task.index {index} of the one evaluator must be 0")
    elif index >= len(cluster[kind]):
        raise ConfigError(
            f"{ENV} task.index {index} is out of range: cluster.{kind} has "
            f"{len(cluster[kind])} tasks"
        )
    return kind, index


def _split(address: Any, field: str = "address") -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` or ``[IPv6]:PORT``; ``ConfigError`` naming ``field``."""
    if not isinstance(address, str):
        raise ConfigError(f"{field} must be a HOST:PORT string, got {address!r}")
    if address.startswith("["):
        host, close, port_text = address[1:].partition("]:")
        if not close or ":" not in host:
            raise ConfigError(f"{field} {address!r} is not [IPv6]:PORT")
    else:
        host, colon, port_text = address.rpartition(":")
        if not colon or ":" in host:
            raise ConfigError(f"{field} {address!r} is not HOST:PORT")
    why = host_problem(host, wildcard_ok=False)
    if why:
        raise ConfigError(f"{field} {address!r}: {why}")
    if not in_range(port_text, 1, MAX_PORT):
        raise ConfigError(f"{field} {_short(address)}: port {_short(port_text)} is not in "
                          f"1..{MAX_PORT}")  # fmt: skip
    return host, int(port_text)


def in_range(text: str, low: int, high: int) -> bool:
    """Whether ``text`` is the ASCII digits of an integer in ``low..high`` (no sign, not "²",
    not more digits than ``high`` has: ``int()`` refuses thousands of them)."""
    digits = text.isascii() and text.isdigit() and len(text) <= len(str(high))
    return digits and low <= int(text) <= high


def _number(name: str, text: str, low: int, high: int) -> int:
    if not in_range(text, low, high):
        raise ConfigError(f"{name}={_short(text)} must be an integer in {low}..{high}")
    return int(text)


def _label(name: str, text: str) -> str:
    if not _DNS_LABEL.fullmatch(text):
        raise ConfigError(
            f"{name}={text!r} is not a Kubernetes name (lowercase letters, digits and '-', "
            "at most 63)"
        )
    return text


def _kinds(cluster: Mapping[str, tuple[str, ...]]) -> str:
    return ", ".join(cluster) or "empty"


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
