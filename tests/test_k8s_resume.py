"""deploy/k8s's components/checkpoints (overlays/*-resume): resume after a pod is evicted.
Each trainer saves on the ReadWriteMany claim at the folder its settings name (read through the
real ``train`` parser), the Job and the TFJob agree, the resume overlays add only the claim,
its mount, the two settings and the restart settings to their ``*-local-producers``
overlays, and a user's overlay changes the storage class and size (docs/kubernetes.md "Resume
after eviction"). Rendered by kustomize (tests/helpers/k8s_render.py), as
tests/test_k8s_cluster.py."""

from __future__ import annotations

import json
import os
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from tests.helpers import k8s_render as k8s
from tests.test_k8s import renderer_or_skip
from tests.test_k8s_cluster import WORKERS, parsed, trainer_container, with_workers

CLAIM = "stagefeed-checkpoints"
# What the component's backoffLimit is sized for (its comment, docs/kubernetes.md "Resume
# after eviction"): this many evictions of a worker of the cluster as shipped, each costing
# every other worker two container restarts (its exit 3, then a startup probe that runs out
# while the replacement is not up yet). Container restarts are what both controllers count.
EVICTIONS, RESTARTS_PER_SURVIVOR = 4, 2


def trainer_template(resources: list[dict[str, Any]]) -> dict[str, Any]:
    (template,) = [t for n, t in k8s.pod_templates(resources).items() if "producer" not in n]
    return template


def claim_mount(template: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's volume of the claim and the trainer container's mount of it."""
    (volume,) = [v for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v]
    mounts = trainer_container(template)["volumeMounts"]
    (mount,) = [m for m in mounts if m["name"] == volume["name"]]
    return volume, mount


@pytest.mark.parametrize("kind", ["indexed", "tfjob"])
@pytest.mark.parametrize("workers", WORKERS)
def test_every_trainer_saves_on_the_claim_and_resumes(tmp_path, monkeypatch, kind, workers):
    """The claim is mounted in every trainer container (the chief is whichever pod is index 0),
    and `stagefeed train`, run in that container's environment, saves into a folder on it and
    checkpoints; the run's shards each feed one worker (docs/resume.md): every pod has its
    sidecar, and no Deployment producer feeds them all."""
    resources = with_workers(tmp_path, f"{kind}-resume", workers)
    claim = k8s.find(resources, "PersistentVolumeClaim", CLAIM)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on several nodes
    assert claim["spec"]["resources"]["requests"]["storage"].endswith("Gi")
    template = trainer_template(resources)
    volume, mount = claim_mount(template)
    assert volume["persistentVolumeClaim"] == {"claimName": CLAIM}
    assert not mount.get("readOnly")
    trainer = trainer_container(template)
    args = parsed(monkeypatch, k8s.environment(trainer, resources), "train")
    save = PurePosixPath(args.save)
    # A folder of its own on the claim: the mount itself would hold lost+found, other runs.
    assert save.is_absolute() and save.parent == PurePosixPath(mount["mountPath"])
    assert args.checkpoint_every > 0
    assert not args.fresh  # a restarted worker resumes; --fresh would move the run aside
    (sidecar,) = template["spec"]["initContainers"]
    assert sidecar["args"] == ["produce"]
    assert volume["name"] not in {m["name"] for m in sidecar["volumeMounts"]}  # trainer only
    assert k8s.find(resources, "Deployment", "producer")["spec"]["replicas"] == 0


@pytest.mark.parametrize("kind", ["indexed", "tfjob"])
def test_checkpoints_add_the_claim_and_keep_the_rest(tmp_path, kind):
    """overlays/KIND-resume is overlays/KIND-local-producers plus the claim, its mount, two
    trainer settings, the backoff limit and no Deployment pods: nothing else moved (the TFJob's
    JSON patch appends to the container `tensorflow`, and replaces no list)."""
    local = with_workers(tmp_path, f"{kind}-local-producers", None)
    resume = with_workers(tmp_path, f"{kind}-resume", None)
    before, after = trainer_template(local), trainer_template(resume)
    volume, mount = claim_mount(after)
    assert unordered(after["spec"]["volumes"]) == unordered([*before["spec"]["volumes"], volume])
    trainer, was = trainer_container(after), trainer_container(before)
    assert unordered(trainer["volumeMounts"]) == unordered([*was["volumeMounts"], mount])
    # envFrom: the same ConfigMaps, by generator name (the settings' content hash changed)
    kept = [{**c, "envFrom": generated(c["envFrom"]), "volumeMounts": None} for c in (trainer, was)]
    assert kept[0] == kept[1]
    assert after["spec"]["initContainers"] == before["spec"]["initContainers"]
    settings = {  # the trainer settings, each rendering's own
        name: k8s.find(r, "ConfigMap", c["envFrom"][1]["configMapRef"]["name"])["data"]
        for name, r, c in (("local", local, was), ("resume", resume, trainer))
    }
    added = {k: v for k, v in settings["resume"].items() if k not in settings["local"]}
    assert set(added) == {"STAGEFEED_SAVE", "STAGEFEED_CHECKPOINT_EVERY"}
    assert {k: settings["resume"][k] for k in settings["local"]} == settings["local"]


def unordered(items: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps(item, sort_keys=True) for item in items)


def generated(sources: list[dict[str, Any]]) -> list[str]:
    """The ConfigMaps named, without the suffix kustomize appends (a hash of the content)."""
    return [source["configMapRef"]["name"].rsplit("-", 1)[0] for source in sources]


def restart_settings(resources: list[dict[str, Any]]) -> dict[str, Any]:
    """How the trainers' controller restarts them: the pods' restart policy, the backoff limit
    and the worker count (the Job's, or the TFJob's and its training operator's)."""
    jobs = [r for r in resources if r["kind"] == "Job"]
    if jobs:
        spec = jobs[0]["spec"]
        return {
            "restartPolicy": spec["template"]["spec"]["restartPolicy"],
            "backoffLimit": spec["backoffLimit"],
            "workers": spec["completions"],
        }
    spec = k8s.find(resources, "TFJob", "trainer")["spec"]
    return {
        "restartPolicy": spec["tfReplicaSpecs"]["Worker"]["restartPolicy"],
        "backoffLimit": spec["runPolicy"]["backoffLimit"],
        "workers": spec["tfReplicaSpecs"]["Worker"]["replicas"],
    }


def test_the_job_and_the_tfjob_resume_alike(tmp_path):
    """Both trainers: the same claim, mounted at the same path, the same save folder and
    interval, restart in place on failure (OnFailure: the kubelet restarts a worker's container
    in its pod, the controller replaces an evicted pod at the same index) with a backoff limit
    that outlasts EVICTIONS evictions."""
    rendered = {
        kind: with_workers(tmp_path, f"{kind}-resume", None) for kind in ("indexed", "tfjob")
    }
    claims = {kind: k8s.find(r, "PersistentVolumeClaim", CLAIM) for kind, r in rendered.items()}
    assert claims["indexed"] == claims["tfjob"]
    seen = {}
    for kind, resources in rendered.items():
        template = trainer_template(resources)
        volume, mount = claim_mount(template)
        env = k8s.environment(trainer_container(template), resources)
        seen[kind] = (
            volume, mount, env["STAGEFEED_SAVE"], env["STAGEFEED_CHECKPOINT_EVERY"],
            restart_settings(resources),
        )  # fmt: skip
    assert seen["indexed"] == seen["tfjob"]
    job = k8s.find(rendered["indexed"], "Job", "trainer")
    assert job["spec"]["podReplacementPolicy"] == "Failed"  # one pod per index at a time
    settings = seen["indexed"][-1]
    assert settings["restartPolicy"] == "OnFailure"
    survivors = settings["workers"] - 1
    assert settings["backoffLimit"] > EVICTIONS * RESTARTS_PER_SURVIVOR * survivors
    # the plain overlays keep theirs: the component raises it only where a restart resumes
    assert restart_settings(with_workers(tmp_path, "indexed", None))["backoffLimit"] == 3


def test_your_overlay_names_the_storage_class_and_size_and_adds_a_gpu(tmp_path):
    """docs/kubernetes.md "Resume after eviction": a user's overlay of overlays/indexed-resume
    names a StorageClass, resizes the claim, moves the run's folder and adds components/gpu."""
    renderer_or_skip()
    root = tmp_path / "mine"
    root.mkdir()
    pvc_patch = [
        {"op": "add", "path": "/spec/storageClassName", "value": "nfs-rwx"},
        {"op": "replace", "path": "/spec/resources/requests/storage", "value": "200Gi"},
    ]
    kustomization = {
        "resources": [os.path.relpath(k8s.K8S_DIR / "overlays" / "indexed-resume", root)],
        "components": [os.path.relpath(k8s.K8S_DIR / "components" / "gpu", root)],
        "patches": [
            {"target": {"kind": "PersistentVolumeClaim", "name": CLAIM},
             "patch": yaml.safe_dump(pvc_patch)},
        ],
        "configMapGenerator": [
            {"name": "stagefeed-trainer-settings", "behavior": "merge",
             "literals": ["STAGEFEED_SAVE=/checkpoints/run2", "STAGEFEED_CHECKPOINT_EVERY=500"]},
        ],
    }  # fmt: skip
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    resources = k8s.build(root)
    claim = k8s.find(resources, "PersistentVolumeClaim", CLAIM)
    assert claim["spec"]["storageClassName"] == "nfs-rwx"
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    template = trainer_template(resources)
    _, mount = claim_mount(template)
    trainer = trainer_container(template)
    env = k8s.environment(trainer, resources)
    assert (env["STAGEFEED_SAVE"], env["STAGEFEED_CHECKPOINT_EVERY"]) == (
        "/checkpoints/run2",
        "500",
    )
    assert env["STAGEFEED_SAVE"].startswith(mount["mountPath"] + "/")
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
