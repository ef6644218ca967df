"""deploy/k8s as a cluster: the TF_CONFIG each trainer worker gets for 1, 2 and 8 workers
(Indexed Job: derived in the pod by common/tf_config.py; TFJob: as the training operator
writes it), the producers' endpoints, the local producers' sidecar (and each pod's shard
group), the keys each pod mounts, and the checkpoints' claim, save folder and restart settings
(overlays/*-resume). Rendered by kustomize (tests/k8s_render.py); the worker
count changed the way docs/kubernetes.md tells (a patch of the Job or TFJob and of the
producers, and the local producers' TRAINER_WORKERS)."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from stagefeed.common import curve, tf_config
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.worker import worker_info

from stagefeed import envflags
from stagefeed.cli import build_parser, producer_options
from stagefeed.producer_flags import endpoints
from tests import k8s_render as k8s
from tests.test_k8s import LOCAL_PRODUCERS, renderer_or_skip

# None: the overlay as shipped (2 workers), its own figures checked against each other.
WORKERS = [None, 1, 2, 8]
FEED_PORT = 5555
# components/local-producers: the ConfigMap and key holding the trainer workers, the count of
# the sidecars' shard groups.
LOCAL_SETTINGS, GROUPS = "stagefeed-local-producers", "TRAINER_WORKERS"


def with_workers(tmp_path: Path, overlay: str, workers: int | None) -> list[dict[str, Any]]:
    """``overlay`` rendered with ``workers`` trainer workers and producers connected to all
    (None: as shipped)."""
    renderer_or_skip()
    if workers is None:
        return k8s.build(k8s.K8S_DIR / "overlays" / overlay)
    indexed = overlay.startswith("indexed")
    host = "trainer-{}.trainer" if indexed else "trainer-worker-{}"
    connect = ",".join(f"tcp://{host.format(i)}:{FEED_PORT}" for i in range(workers))
    producer = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "producer"},
        "spec": {"template": {"spec": {"containers": [
            {"name": "producer", "env": [{"name": "STAGEFEED_CONNECT", "value": connect}]}]}}},
    }  # fmt: skip
    if indexed:
        trainer = {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer"},
            "spec": {"completions": workers, "parallelism": workers, "template": {"spec": {
                "containers": [{"name": "trainer", "env": [
                    {"name": "STAGEFEED_TRAINER_WORKERS", "value": str(workers)}]}]}}},
        }  # fmt: skip
        patches = [{"patch": yaml.safe_dump(trainer)}]
    else:  # a custom resource: JSON patch (docs/kubernetes.md)
        op = [{"op": "replace", "path": "/spec/tfReplicaSpecs/Worker/replicas", "value": workers}]
        target = {"group": "kubeflow.org", "version": "v1", "kind": "TFJob", "name": "trainer"}
        patches = [{"patch": yaml.safe_dump(op), "target": target}]
    root = tmp_path / f"{overlay}-{workers}"  # a kustomization outside the tree: allowed
    root.mkdir()
    kustomization = {
        "resources": [os.path.relpath(k8s.K8S_DIR / "overlays" / overlay, root)],
        "patches": [*patches, {"patch": yaml.safe_dump(producer)}],
    }
    if overlay.endswith(LOCAL_PRODUCERS):  # the sidecars' group count
        kustomization["configMapGenerator"] = [
            {"name": LOCAL_SETTINGS, "behavior": "merge", "literals": [f"{GROUPS}={workers}"]}
        ]
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return k8s.build(root)


def trainer_container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in template["spec"]["containers"] if c["args"] == ["train"]]
    return container


def port(container: dict[str, Any], name: str) -> int:
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return number


def producer_endpoints(resources: list[dict[str, Any]]) -> list[str]:
    template = k8s.find(resources, "Deployment", "producer")["spec"]["template"]
    env = k8s.environment(template["spec"]["containers"][0], resources)
    return env["STAGEFEED_CONNECT"].split(",")


def feed_port(env: dict[str, str]) -> int:
    assert env["STAGEFEED_BIND"] == f"tcp://*:{FEED_PORT}"
    return FEED_PORT


@pytest.mark.parametrize(
    "overlay", ["indexed", "indexed-gpu", "indexed-local-producers", "indexed-resume"]
)
@pytest.mark.parametrize("workers", WORKERS)
def test_each_indexed_job_pod_derives_its_place_in_the_cluster(tmp_path, overlay, workers):
    resources = with_workers(tmp_path, overlay, workers)
    job = k8s.find(resources, "Job", "trainer")
    service = k8s.find(resources, "Service", "trainer")
    template = job["spec"]["template"]
    workers = workers or job["spec"]["completions"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == workers
    # Pod I is JOB-I.SUBDOMAIN: the headless Service of that name selects the Job's pods and
    # publishes them before they are ready (the workers find each other while starting).
    assert template["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    container = trainer_container(template)
    base_env = k8s.environment(container, resources)
    assert "TF_CONFIG" not in base_env
    hosts = [
        f"{job['metadata']['name']}-{i}.{service['metadata']['name']}:{port(container, 'tf')}"
        for i in range(workers)
    ]
    chiefs = []
    for index in range(workers):  # what Kubernetes adds to pod INDEX's environment
        env = {**base_env, "JOB_COMPLETION_INDEX": str(index)}
        assert tf_config.apply_indexed_job(env) is not None  # as `stagefeed train` does
        assert json.loads(env["TF_CONFIG"]) == {
            "cluster": {"worker": hosts},
            "task": {"type": "worker", "index": index},
        }
        config = tf_config.parse(env["TF_CONFIG"])
        chiefs.append(config.is_chief)
        assert producer_endpoints(resources) == tf_config.trainer_endpoints(config, feed_port(env))
    assert chiefs == [True] + [False] * (workers - 1)
    assert {p["port"] for p in service["spec"]["ports"]} >= {FEED_PORT, port(container, "tf")}


def operator_tf_config(tfjob: dict[str, Any], index: int, namespace: str) -> str:
    """What kubeflow/training-operator v1.9.0 sets (pkg/controller.v1/tensorflow/tensorflow.go,
    genTFConfigJSONStr/genClusterSpec): NAME-worker-I.NAMESPACE.svc:PORT, the port from the
    container `tensorflow`'s port named `tfjob-port`, type lower-cased, "environment": "cloud"."""
    name = tfjob["metadata"]["name"]
    worker = tfjob["spec"]["tfReplicaSpecs"]["Worker"]
    (container,) = [
        c for c in worker["template"]["spec"]["containers"] if c["name"] == "tensorflow"
    ]  # the operator sets TF_CONFIG in this container only
    tf_port = port(container, "tfjob-port")
    hosts = [f"{name}-worker-{i}.{namespace}.svc:{tf_port}" for i in range(worker["replicas"])]
    return json.dumps(
        {
            "cluster": {"worker": hosts},
            "task": {"type": "worker", "index": index},
            "environment": "cloud",
        }
    )


@pytest.mark.parametrize("overlay", ["tfjob", "tfjob-gpu", "tfjob-local-producers", "tfjob-resume"])
@pytest.mark.parametrize("workers", WORKERS)
def test_each_tfjob_worker_reads_the_operators_tf_config(tmp_path, overlay, workers):
    resources = with_workers(tmp_path, overlay, workers)
    tfjob = k8s.find(resources, "TFJob", "trainer")
    workers = workers or tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"]
    assert set(tfjob["spec"]["tfReplicaSpecs"]) == {"Worker"}  # no chief: worker 0 is
    template = tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]
    env = k8s.environment(trainer_container(template), resources)
    assert not set(tf_config.INDEXED_JOB_VARIABLES) & set(env)  # both would be refused
    chiefs = []
    for index in range(workers):
        text = operator_tf_config(tfjob, index, "ml")
        assert tf_config.apply_indexed_job({**env, "TF_CONFIG": text}) is not None
        config = tf_config.parse(text)
        chiefs.append(config.is_chief)
        # Producers use the Services' short names (their own namespace): the same workers.
        expected = [
            e.replace(".ml.svc:", ":") for e in tf_config.trainer_endpoints(config, feed_port(env))
        ]
        assert producer_endpoints(resources) == expected
    assert chiefs == [True] + [False] * (workers - 1)


@pytest.mark.parametrize("kind", ["indexed", "tfjob"])
def test_local_producers_share_the_trainers_pod_socket_and_keep_the_trainer(tmp_path, kind):
    plain = with_workers(tmp_path, kind, 2)
    local = with_workers(tmp_path, f"{kind}-local-producers", 2)
    (before,) = [t for n, t in k8s.pod_templates(plain).items() if "producer" not in n]
    (after,) = [t for n, t in k8s.pod_templates(local).items() if "producer" not in n]
    trainer, was = trainer_container(after), trainer_container(before)
    added = {"env", "volumeMounts"}
    # The trainer keeps all it had (a merge that replaced the container list would not).
    assert {k: v for k, v in trainer.items() if k not in added} == {
        k: v for k, v in was.items() if k not in added
    }
    assert all(e in trainer.get("env", []) for e in was.get("env", []))
    (sidecar,) = after["spec"]["initContainers"]
    assert sidecar["restartPolicy"] == "Always" and sidecar["args"] == ["produce"]
    (volume,) = [v for v in after["spec"]["volumes"] if v["name"] == "shm-sock"]
    assert volume["emptyDir"]["medium"] == "Memory"
    mounts = [
        [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "shm-sock"]
        for c in (sidecar, trainer)
    ]
    assert mounts == [["/run/stagefeed"], ["/run/stagefeed"]]
    env = k8s.environment(trainer, local)
    side = k8s.environment(sidecar, local)
    assert env["STAGEFEED_SHM_SOCKET"].startswith("/run/stagefeed/")
    assert (env["STAGEFEED_TRANSPORT"], side["STAGEFEED_TRANSPORT"]) == ("auto", "shm")
    assert env["STAGEFEED_SHM_PRODUCERS"] == side["STAGEFEED_WORKERS"]
    assert side["STAGEFEED_CONNECT"] == f"tcp://127.0.0.1:{feed_port(env)}"
    limit = sidecar["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) * 2**30 > 16 * 256 * 227 * 227 * 3 * 4
    if kind == "tfjob":  # the JSON patch holds the Job's sidecar, word for word, but for
        # where the pod's index comes from (test_each_pods_local_producers_are_their_own_group)
        job = with_workers(tmp_path, "indexed-local-producers", 2)  # the same ConfigMaps
        (job_template,) = [t for n, t in k8s.pod_templates(job).items() if "producer" not in n]
        (job_sidecar,) = job_template["spec"]["initContainers"]
        assert [index_source(job_sidecar), index_source(sidecar)] == [
            f"metadata.annotations['{JOB_INDEX}']",
            f"metadata.labels['{TFJOB_INDEX}']",
        ]
        assert without_index_source(job_sidecar) == without_index_source(sidecar)


# Where a trainer pod's index is (the downward API): the Indexed Job's completion index, the
# annotation Kubernetes derives JOB_COMPLETION_INDEX from; the training operator's pod label.
JOB_INDEX = "batch.kubernetes.io/job-completion-index"
TFJOB_INDEX = "training.kubeflow.org/replica-index"
INDEX_VARIABLE = "TRAINER_INDEX"


def index_source(sidecar: dict[str, Any]) -> str:
    (entry,) = [e for e in sidecar["env"] if e["name"] == INDEX_VARIABLE]
    return entry["valueFrom"]["fieldRef"]["fieldPath"]


def without_index_source(sidecar: dict[str, Any]) -> dict[str, Any]:
    env = [e for e in sidecar["env"] if e["name"] != INDEX_VARIABLE]
    return {**sidecar, "env": env}


def pod_metadata(kind: str, template: dict[str, Any], index: int) -> dict[str, Any]:
    """The metadata of pod ``index`` as Kubernetes makes it from ``template``: the Job
    controller's completion-index annotation (and label), or the training operator's
    replica-index label (kubeflow/training-operator v1, pkg/common/util: ReplicaIndexLabel)."""
    labels = dict(template["metadata"].get("labels", {}))
    if kind == "indexed":
        return {"labels": {**labels, JOB_INDEX: str(index)}, "annotations": {JOB_INDEX: str(index)}}
    return {"labels": {**labels, TFJOB_INDEX: str(index)}}


@pytest.mark.parametrize("variant", ["local-producers", "resume"])
@pytest.mark.parametrize("kind", ["indexed", "tfjob"])
@pytest.mark.parametrize("workers", WORKERS)
def test_each_pods_local_producers_are_their_own_group(
    tmp_path, monkeypatch, kind, workers, variant
):
    """The sidecar's STAGEFEED_SHARD_GROUP, composed by the kubelet from the pod's index and
    TRAINER_WORKERS, read by the real `produce` command line: pod G of K is group G/K, so the
    pods' producers carry every shard 0..K*N-1 once (docs/resume.md)."""
    resources = with_workers(tmp_path, f"{kind}-{variant}", workers)
    (template,) = [t for n, t in k8s.pod_templates(resources).items() if "producer" not in n]
    if kind == "indexed":
        pods = k8s.find(resources, "Job", "trainer")["spec"]["completions"]
    else:
        pods = k8s.find(resources, "TFJob", "trainer")["spec"]["tfReplicaSpecs"]["Worker"]
        pods = pods["replicas"]
    assert pods == (workers or 2)
    (sidecar,) = template["spec"]["initContainers"]
    shards = []
    for index in range(pods):
        env = k8s.environment(sidecar, resources, pod_metadata(kind, template, index))
        assert env["STAGEFEED_SHARD_GROUP"] == f"{index}/{pods}"
        options = produce_options(monkeypatch, env)
        assert options.shard_group == (index, pods)
        infos = [worker_info(options, i) for i in range(options.workers)]
        assert {w.count for w in infos} == {pods * options.workers}
        shards += [w.index for w in infos]
    assert sorted(shards) == list(range(pods * int(env["STAGEFEED_WORKERS"])))


def parsed(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], command: str) -> Any:
    """The arguments of `stagefeed COMMAND` run in ``env`` (its STAGEFEED_* variables only: the
    container sees no other): the real parser and its environment check."""
    for name in [n for n in os.environ if n.startswith(envflags.PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(envflags.PREFIX):
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args([command])
    envflags.check(args)
    return args


def produce_options(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> ProducerOptions:
    """``ProducerOptions`` of `stagefeed produce` run in ``env``, as the command makes them."""
    args = parsed(monkeypatch, env, "produce")
    return producer_options(args, endpoints(args), args.workers)


@pytest.mark.parametrize("overlay", ["indexed", "tfjob"])
def test_each_pod_mounts_the_keys_it_needs_and_no_more(tmp_path, overlay):
    """The stagefeed-curve Secret (docs/kubernetes.md), as common/curve.py lays out a keys
    directory: producers never get the trainer's secret key; trainers get the allow-list."""
    resources = with_workers(tmp_path, overlay, 2)
    layouts = {}
    for name, template in k8s.pod_templates(resources).items():
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "curve-keys"]
        assert volume["secret"]["secretName"] == "stagefeed-curve"
        assert volume["secret"]["optional"] is True
        layouts[name.split("/")[0]] = {i["path"]: i["key"] for i in volume["secret"]["items"]}
        for container in k8s.containers(template):
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "curve-keys"]
            assert mount["mountPath"] == "/keys/curve" and mount["readOnly"] is True
    producer = {curve.CLIENT_PUBLIC, curve.CLIENT_SECRET, curve.SERVER_PUBLIC}
    assert layouts.pop("Deployment") == {name: name for name in producer}
    (trainer,) = layouts.values()
    assert trainer == {
        **{name: name for name in (*producer, curve.SERVER_SECRET)},
        f"{curve.AUTHORIZED}/local.key": curve.CLIENT_PUBLIC,
    }


# ---- components/checkpoints (overlays/*-resume): resume after a pod is evicted ----------------

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
