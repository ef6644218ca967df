"""docker/compose.yaml's services run for real, without an engine: each service's command and
environment, read from the file, starts the real processes over loopback and trains (producers
able to import only what their image installs); the healthcheck passes while the trainer
listens and fails after; the default trainer runs until SIGTERM; CURVE keys from the keygen
service protect the run. Under a real engine: tests/compose/check_compose.py.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.conftest import free_tcp_port, run_cli, wait_for
from tests.helpers import compose_local as cl

DOCKERFILES = [cl.DOCKER_DIR / "Dockerfile.producer", cl.DOCKER_DIR / "Dockerfile.trainer"]
HADOLINT = Path(sys.executable).parent / "hadolint"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


def compose_variables(**overrides: str) -> dict[str, str]:
    """The shell of `docker compose up`: a free port, tiny batches; the rest are the defaults."""
    return {"STAGEFEED_PORT": str(free_tcp_port()), "STAGEFEED_BATCH_SIZE": "2", **overrides}


_NOT_IN_IMAGE = """\
import sys

BLOCKED = frozenset({blocked!r})


class NotInTheProducerImage:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed in the producer image")
        return None


sys.meta_path.insert(0, NotInTheProducerImage)
"""


def as_in_the_producer_image(service: cl.LocalService, tmp_path: Path) -> None:
    """Let ``service`` import only what the producer image installs: the base dependencies.

    A ``sitecustomize`` (first on PYTHONPATH, so spawned producer processes get it too) makes
    every other installed distribution's modules (TensorFlow, Keras, PyYAML, ...) unimportable.
    """
    allowed = cl.requirement_closure(cl.base_requirements()) | {"stagefeed"}
    blocked = sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if not {canonicalize_name(d) for d in dists} & allowed
    )
    assert "tensorflow" in blocked and "zmq" not in blocked
    site = tmp_path / "producer-image-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_NOT_IN_IMAGE.format(blocked=blocked))
    service.env["PYTHONPATH"] = f"{site}:{service.env['PYTHONPATH']}"


def healthcheck(service: cl.LocalService) -> subprocess.CompletedProcess:
    assert service.healthcheck_args is not None
    return run_cli(service.healthcheck_args, timeout=30, env=service.env)


def start_services(start_cli, tmp_path, variables, producers: int):
    trainer = cl.local_service("trainer", variables, tmp_path)
    trainer_proc = start_cli(trainer.args, name="trainer", env=trainer.env)
    healthy = wait_for(
        lambda: trainer_proc.proc.poll() is not None or healthcheck(trainer).returncode == 0,
        timeout=120,
        interval=0.5,
    )
    assert healthy and trainer_proc.proc.poll() is None, trainer_proc.output()
    producer_procs = []
    for index in range(producers):  # `--scale producer=N`: N containers of one service
        producer = cl.local_service("producer", variables, tmp_path)
        as_in_the_producer_image(producer, tmp_path)
        producer_procs.append(start_cli(producer.args, name=f"producer{index}", env=producer.env))
    return trainer, trainer_proc, producer_procs


def stop_producers(producer_procs) -> None:
    for proc in producer_procs:
        proc.signal(signal.SIGTERM)  # what `docker compose down` sends
    for proc in producer_procs:
        assert proc.wait(30) == 0, proc.output()
        assert "Traceback" not in proc.output()


@pytest.mark.slow
def test_services_train_a_few_steps_then_the_healthcheck_fails(start_cli, tmp_path):
    # A batch a second a producer: the 5 steps (2 warm-up) take the first one alone 5 s, so
    # the second, started right after it, has seconds to offer its pool (both are mapped) and
    # the run's length is its steps. (With 3 batches a producer and no pace, the first once
    # fed the whole run before the second started, and once ended its data, so the run had
    # 1 step, before the second said hello.)
    variables = compose_variables(STAGEFEED_STEPS="3", STAGEFEED_RATE="1")
    trainer, trainer_proc, producer_procs = start_services(start_cli, tmp_path, variables, 2)
    assert trainer_proc.wait(120) == 0, trainer_proc.output()
    after = healthcheck(trainer)
    assert after.returncode == 1 and "connection refused" in after.stdout, after.stdout
    summary = json.loads((trainer.volumes["/var/lib/stagefeed"] / "summary.json").read_text())
    assert (summary["steps"], summary["batch_size"], summary["interrupted"]) == (3, 2, False)
    # The seed's AlexNet (dense kernels of stddev 1.0, SGD 0.01) diverges on batches of 2
    # random images after a few steps: only the first loss is asked to be finite here.
    assert summary["device"] == "/cpu:0" and summary["loss_first"] is not None
    assert summary["wire_dtype"] == "float32" and summary["enqueue_threads"] == 2
    # Shared memory between the "containers", through the shm-sock volume (STAGEFEED_TRANSPORT
    # defaults to auto): every batch came as a slot descriptor, both pools were mapped.
    assert summary["transport"] == "shm+tcp"
    assert summary["shm"]["pools_accepted"] == 2
    assert summary["shm"]["batches"] == summary["batches"]["received"] > 0
    assert summary["shm"]["socket"].startswith(str(trainer.volumes["/run/stagefeed"]))
    stop_producers(producer_procs)


@pytest.mark.slow
def test_the_default_trainer_runs_until_sigterm_and_writes_its_summary(start_cli, tmp_path):
    variables = compose_variables(STAGEFEED_PROGRESS_S="0.2")  # STAGEFEED_STEPS: default 0
    trainer, trainer_proc, producer_procs = start_services(start_cli, tmp_path, variables, 2)
    both = wait_for(
        lambda: (
            re.search(r"producers 2\b", trainer_proc.output())
            or trainer_proc.proc.poll() is not None
        ),
        timeout=120,
        interval=0.2,
    )
    assert both and trainer_proc.proc.poll() is None, trainer_proc.output()
    trainer_proc.signal(signal.SIGTERM)  # `docker compose stop`, forwarded by init
    assert trainer_proc.wait(30) == 0, trainer_proc.output()
    summary = json.loads((trainer.volumes["/var/lib/stagefeed"] / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["batches"]["trained"] >= 1
    assert summary["steps"] + summary["warmup_steps"] == summary["batches"]["trained"]
    assert len(summary["producers"]) == 2
    assert all(p["received"] > 0 for p in summary["producers"].values())
    stop_producers(producer_procs)


@pytest.mark.slow
def test_curve_keys_from_the_keygen_service_protect_the_run(start_cli, tmp_path):
    keygen = cl.local_service("keygen", {}, tmp_path)
    made = run_cli(keygen.args, timeout=60, env=keygen.env)
    assert made.returncode == 0, made.stdout + made.stderr
    variables = compose_variables(STAGEFEED_STEPS="3", STAGEFEED_CURVE_KEYS="/keys/curve")
    trainer, trainer_proc, producer_procs = start_services(start_cli, tmp_path, variables, 1)
    # The healthcheck passed as a CURVE client; without the keys the same check fails.
    plain = run_cli(
        trainer.healthcheck_args, timeout=30, env={**trainer.env, "STAGEFEED_CURVE_KEYS": ""}
    )
    assert plain.returncode == 1, plain.stdout
    assert trainer_proc.wait(60) == 0, trainer_proc.output()
    summary = json.loads((trainer.volumes["/var/lib/stagefeed"] / "summary.json").read_text())
    assert (summary["steps"], summary["interrupted"]) == (3, False)
    assert len(summary["producers"]) == 1
    stop_producers(producer_procs)
