"""deploy/k8s: every overlay rendered by the real kustomize, validated offline, and checked
against the CLI as compose is (tests/test_docker.py).

- every overlay renders (sigs.k8s.io/kustomize/api through pykustomize: tests/helpers/k8s_render.py;
  there is no kubectl here), and a broken kustomization does not;
- every rendered manifest passes `kubernetes-validate --strict` (the Kubernetes schemas it
  bundles; unknown fields refused) for the oldest and newest Kubernetes the docs name; the
  TFJob, which it has no schema for, passes the training operator's CRD schema
  (tests/schemas/, with check-jsonschema), made strict the same way;
- both validators are shown to refuse a broken manifest;
- images are the ones docker/ builds, commands are `stagefeed` subcommands, probes run
  `stagefeed health`; every reference to a ConfigMap names one that is rendered;
- every STAGEFEED_* variable a container sees is one its command reads;
- every `$(VAR)` in an env value names a variable defined before it (the kubelet's rule).

TF_CONFIG, the producers' endpoints, shared memory and keys: tests/test_k8s_cluster.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from stagefeed import envflags
from stagefeed.cli import build_parser
from stagefeed.common import tf_config
from tests.helpers import compose_local as cl
from tests.helpers import k8s_render as k8s

OVERLAYS = [
    "indexed",
    "tfjob",
    "indexed-gpu",
    "tfjob-gpu",
    "indexed-local-producers",
    "tfjob-local-producers",
    "indexed-resume",
    "tfjob-resume",
]
# Overlays with components/local-producers (the *-resume ones compose it with checkpoints).
LOCAL_PRODUCERS = ("-local-producers", "-resume")
# The oldest Kubernetes the guide supports (native sidecars on by default) and the newest
# kubernetes-validate bundles.
KUBERNETES = ["1.29.0", "1.37.0"]
BIN = Path(sys.executable).parent
SCHEMAS = Path(__file__).parent / "schemas"
# docker/ builds these (docs/deployment.md); the tags compose gives them.
IMAGES = {"stagefeed-producer": "Dockerfile.producer", "stagefeed-trainer": "Dockerfile.trainer"}
TAGS = {"stagefeed-producer": {"local"}, "stagefeed-trainer": {"cpu", "gpu"}}

# Variables the manifests set that the CLI does not read yet, each with what is missing
# (none now: issue 22's producer side reads STAGEFEED_CONNECT's comma-separated list).
PENDING: dict[str, str] = {}


def renderer_or_skip() -> None:
    if k8s.library_path() is None:
        message = "pykustomize's kustomize library is not installed (make venv installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    renderer_or_skip()
    return {name: k8s.build(k8s.K8S_DIR / "overlays" / name) for name in OVERLAYS}


def test_the_overlays_listed_are_the_overlays_there():
    on_disk = sorted(p.name for p in (k8s.K8S_DIR / "overlays").iterdir() if p.is_dir())
    assert on_disk == sorted(OVERLAYS)


def test_the_renderer_is_kustomize_and_refuses_a_broken_kustomization(tmp_path):
    renderer_or_skip()
    assert k8s.version().startswith("pykustomize-v")
    base = k8s.build(k8s.K8S_DIR / "base")
    assert {r["kind"] for r in base} == {"ConfigMap", "Deployment"}
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(k8s.RenderError, match="missing.yaml"):
        k8s.build(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_producers_and_trainers(rendered, overlay):
    kinds = sorted(r["kind"] for r in rendered[overlay])
    trainer = ["Job", "Service"] if overlay.startswith("indexed") else ["TFJob"]
    # components/local-producers adds one: the sidecars' group count
    settings = ["ConfigMap"] * (3 if overlay.endswith(LOCAL_PRODUCERS) else 2)
    # components/checkpoints: the claim the run's folder is on
    claim = ["PersistentVolumeClaim"] if overlay.endswith("-resume") else []
    assert kinds == sorted([*settings, *claim, "Deployment", *trainer])


def kubernetes_validate(path: Path, version: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "-k", version, str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("version", KUBERNETES)
def test_every_manifest_passes_kubernetes_validate_strict(rendered, tmp_path, version):
    for overlay, resources in rendered.items():
        path = tmp_path / f"{overlay}.yaml"
        path.write_text(yaml.safe_dump_all(resources))
        result = kubernetes_validate(path, version)
        assert result.returncode == 0, result.stdout + result.stderr
        lines = (result.stdout + result.stderr).splitlines()
        minor = version.rsplit(".", 1)[0]
        for r in resources:
            name = f"{r['kind'].lower()}/{r['metadata']['name']}"
            passed = f"passed for resource {name} against version {minor}"
            if r["kind"] == "TFJob":  # no schema bundled: the CRD's schema checks it below
                assert any("Couldn't find schema for kind TFJob" in ln for ln in lines), lines
            else:
                assert any(passed in ln for ln in lines), (overlay, name, lines)


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda job: job["spec"].update(completionz=3), "'completionz' was unexpected"),
        (lambda job: job["spec"].update(parallelism="2"), "'2' is not of type 'integer'"),
    ],
)  # fmt: skip
def test_kubernetes_validate_refuses_a_broken_job(rendered, tmp_path, edit, complaint):
    job = copy.deepcopy(k8s.find(rendered["indexed"], "Job"))
    edit(job)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = kubernetes_validate(path, KUBERNETES[-1])
    assert result.returncode != 0 and complaint in result.stdout + result.stderr


def strict(schema: Any) -> Any:
    """The API server's strict field validation: an object that lists its properties takes
    no other (unless the schema preserves unknown fields), as tests/schemas/README.md says."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def tfjob_schema(tmp_path_factory) -> Path:
    schema = strict(json.loads((SCHEMAS / "tfjob-v1.json").read_text()))
    schema["properties"]["apiVersion"] = {"const": "kubeflow.org/v1"}
    schema["properties"]["kind"] = {"const": "TFJob"}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "spec"})
    path = tmp_path_factory.mktemp("schema") / "tfjob-v1.strict.json"
    path.write_text(json.dumps(schema))
    return path


def check_tfjob(schema: Path, tfjob: dict[str, Any], path: Path) -> subprocess.CompletedProcess:
    path.write_text(yaml.safe_dump(tfjob))
    return subprocess.run(
        [str(BIN / "check-jsonschema"), "--schemafile", str(schema), str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("tfjob")])
def test_the_tfjob_passes_the_training_operators_crd_schema(
    rendered, tfjob_schema, tmp_path, overlay
):
    result = check_tfjob(tfjob_schema, k8s.find(rendered[overlay], "TFJob"), tmp_path / "t.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda spec: spec["Worker"].update(replica=2), "replica"),
        (lambda spec: spec["Worker"].update(replicas="2"), "'2' is not of type 'integer'"),
        (lambda spec: spec["Worker"]["template"]["spec"]["containers"][0].update(args="train"),
         "'train' is not of type 'array'"),
    ],
)  # fmt: skip
def test_the_crd_schema_refuses_a_broken_tfjob(rendered, tfjob_schema, tmp_path, edit, complaint):
    tfjob = copy.deepcopy(k8s.find(rendered["tfjob"], "TFJob"))
    edit(tfjob["spec"]["tfReplicaSpecs"])
    result = check_tfjob(tfjob_schema, tfjob, tmp_path / "t.yaml")
    assert result.returncode != 0 and complaint in result.stdout + result.stderr


def subcommands() -> dict[str, Any]:
    return build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_and_commands_are_the_ones_docker_builds(rendered, overlay):
    commands = subcommands()
    for name, template in k8s.pod_templates(rendered[overlay]).items():
        for container in k8s.containers(template):
            image, _, tag = container["image"].partition(":")
            assert image in IMAGES and tag in TAGS[image], (name, container["image"])
            dockerfile = cl.DOCKER_DIR / IMAGES[image]
            instructions = cl.dockerfile_instructions(dockerfile)
            entrypoint = [a for ins, a in instructions if ins == "ENTRYPOINT"]
            assert entrypoint == ['["stagefeed"]'], dockerfile  # args are a subcommand's
            command = container["args"][0]
            assert "command" not in container and command in commands, (name, container)
            assert (command == "train") == (image == "stagefeed-trainer"), (name, command)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if command == "train":
                    assert container[probe]["exec"]["command"] == ["stagefeed", "health"]
                else:
                    assert probe not in container, (name, probe)
    gpu = overlay.endswith("-gpu")
    trainer = next(
        c for t in k8s.pod_templates(rendered[overlay]).values()
        for c in k8s.containers(t) if c["args"] == ["train"]
    )  # fmt: skip
    assert trainer["image"] == f"stagefeed-trainer:{'gpu' if gpu else 'cpu'}"
    assert trainer["resources"]["limits"].get("nvidia.com/gpu") == (1 if gpu else None)
    env = k8s.environment(trainer, rendered[overlay])
    assert env["STAGEFEED_DEVICE"] == ("gpu" if gpu else "cpu")


def flags_of(command: str) -> set[str]:
    parser = subcommands()[command]
    return {
        envflags.env_name(option)
        for action in parser._actions  # noqa: SLF001
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_a_container_sees_is_one_its_command_reads(rendered, overlay):
    """Its ConfigMaps' keys and its env; a trainer also reads the Indexed Job's variables
    (common/tf_config.py); none is set twice in one container; every ConfigMap named exists."""
    resources = rendered[overlay]
    config_maps = {r["metadata"]["name"] for r in resources if r["kind"] == "ConfigMap"}
    for name, template in k8s.pod_templates(resources).items():
        for container in k8s.containers(template):
            command = container["args"][0]
            names = [entry["name"] for entry in container.get("env", [])]
            assert len(names) == len(set(names)), (name, names)
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, (name, source)
            seen = {v for v in k8s.environment(container, resources) if v.startswith("STAGEFEED_")}
            readable = flags_of(command) | (
                set(tf_config.INDEXED_JOB_VARIABLES) if command == "train" else set()
            )
            assert seen - readable - set(PENDING) == set(), (name, command)
            if command == "train":  # its health probe, in the same environment, checks the
                # address in STAGEFEED_BIND (stagefeed/health.py), unless told another one
                assert {"STAGEFEED_BIND", "STAGEFEED_CURVE_KEYS"} <= seen, name
                assert "STAGEFEED_CONNECT" not in seen, name


def test_the_producers_read_the_comma_separated_connect_of_every_overlay(rendered):
    """What was PENDING: each producer container's STAGEFEED_CONNECT is the list of trainer
    workers its command line reads (stagefeed/producer_flags.py)."""
    import argparse

    from stagefeed.producer_flags import endpoints

    assert PENDING == {}
    for overlay in OVERLAYS:
        resources = rendered[overlay]
        for template in k8s.pod_templates(resources).values():
            for container in k8s.containers(template):
                env = k8s.environment(container, resources)
                if container["args"][0] != "produce" or "STAGEFEED_CONNECT" not in env:
                    continue
                args = argparse.Namespace(connect=None, connect_tf_config=None)
                listed = env["STAGEFEED_CONNECT"].split(",")
                assert endpoints(args, {"STAGEFEED_CONNECT": env["STAGEFEED_CONNECT"]}) == tuple(
                    listed
                ), overlay


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_names_one_defined_before_it(rendered, overlay):
    """The kubelet expands ``$(VAR)`` in an env value from the container's ConfigMaps and the
    entries above it, and leaves any other reference as written: a misspelt or misplaced one
    would reach the command as ``$(VAR)`` (the local producers' STAGEFEED_SHARD_GROUP)."""
    resources = rendered[overlay]
    for name, template in k8s.pod_templates(resources).items():
        for container in k8s.containers(template):
            defined = set(k8s.environment({"envFrom": container.get("envFrom", [])}, resources))
            for entry in container.get("env", []):
                for reference in re.findall(r"\$\(([^)]*)\)", entry.get("value", "")):
                    assert reference in defined, (name, container["name"], entry)
                defined.add(entry["name"])


def test_every_variable_the_manifests_set_is_documented():
    text = "\n".join(p.read_text() for p in k8s.K8S_DIR.rglob("*.yaml"))
    # and the local producers' own: their pod's index and the trainer workers
    used = set(re.findall(r"\b(?:STAGEFEED|TRAINER)_[A-Z0-9_]+", text))
    assert used, "deploy/k8s names no variable?"
    guide = (Path(__file__).parent.parent / "docs" / "kubernetes.md").read_text()
    assert sorted(v for v in used if v not in guide) == []
