"""deploy/k8s as a cluster: the TF_CONFIG each trainer worker gets for 1, 2 and 8 workers
(Indexed Job: derived in the pod by common/tf_config.py; TFJob: as the training operator
writes it), the producers' endpoints, the local producers' sidecar (and each pod's shard
group) and the keys each pod mounts; the checkpoints' claim is tests/test_k8s_resume.py's.
Rendered by kustomize (tests/helpers/k8s_render.py); the worker
count changed the way docs/kubernetes.md tells (a patch of the Job or TFJob and of the
producers, and the local producers' TRAINER_WORKERS)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from stagefeed import envflags
from stagefeed.cli import build_parser, producer_options
from stagefeed.common import curve, tf_config
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.worker import worker_info
from stagefeed.producer_flags import endpoints
from tests.helpers import k8s_render as k8s
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
