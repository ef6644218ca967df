"""common/tf_config.py: TF_CONFIG parsed and checked, and derived for an Indexed Job's pod."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stagefeed.common import tf_config
from stagefeed.common.errors import ConfigError
from tests.conftest import REPO, cli_env


def config(cluster: dict, task_type: str = "worker", index: int = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def indexed_env(workers: int, index: int, **overrides: str) -> dict[str, str]:
    env = {
        "JOB_COMPLETION_INDEX": str(index),
        "STAGEFEED_TRAINER_WORKERS": str(workers),
        "STAGEFEED_TRAINER_JOB": "trainer",
        "STAGEFEED_TRAINER_SERVICE": "trainer",
        "STAGEFEED_TF_PORT": "2222",
    }
    return {**env, **overrides}


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_an_indexed_job_gives_each_pod_its_place_in_one_cluster(workers):
    hosts = [f"trainer-{i}.trainer:2222" for i in range(workers)]
    chiefs = []
    for index in range(workers):
        text = tf_config.derive_for_indexed_job(indexed_env(workers, index))
        assert json.loads(text) == {
            "cluster": {"worker": hosts},
            "task": {"type": "worker", "index": index},
        }
        parsed = tf_config.parse(text)
        assert parsed.worker_hosts() == tuple(hosts)
        assert (parsed.task_index, parsed.num_workers) == (index, workers)
        chiefs.append(parsed.is_chief)
        assert tf_config.trainer_endpoints(parsed, 5555) == [
            f"tcp://trainer-{i}.trainer:5555" for i in range(workers)
        ]
    assert chiefs == [True] + [False] * (workers - 1)


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_a_tfjob_cluster_as_the_training_operator_writes_it(workers):
    """kubeflow/training-operator v1.9.0 pkg/controller.v1/tensorflow/tensorflow.go
    (genTFConfigJSONStr): NAME-worker-I.NAMESPACE.svc:PORT, task type lower-cased, and an
    "environment" key TensorFlow ignores."""
    hosts = [f"trainer-worker-{i}.ml.svc:2222" for i in range(workers)]
    for index in range(workers):
        text = json.dumps(
            {
                "cluster": {"worker": hosts},
                "task": {"type": "worker", "index": index},
                "environment": "cloud",
            }
        )
        parsed = tf_config.parse(text)
        assert parsed.worker_hosts() == tuple(hosts)
        assert parsed.is_chief is (index == 0)
        assert tf_config.trainer_endpoints(text, 5555) == [
            f"tcp://trainer-worker-{i}.ml.svc:5555" for i in range(workers)
        ]


def test_a_chief_trains_first_and_writes_alone():
    cluster = {"chief": ["c:1"], "worker": ["a:1", "b:1"], "ps": ["p:1"]}
    chief = tf_config.parse(config(cluster, "chief"))
    assert chief.worker_hosts() == ("c:1", "a:1", "b:1")  # no ps: it does not train
    assert chief.is_chief and chief.num_workers == 3
    assert not tf_config.parse(config(cluster, "worker", 0)).is_chief
    assert not tf_config.parse(config(cluster, "ps", 0)).is_chief
    assert tf_config.trainer_endpoints(chief, 7) == ["tcp://c:7", "tcp://a:7", "tcp://b:7"]
    evaluator = tf_config.parse(config(cluster, "evaluator"))  # need not be in the cluster
    assert (evaluator.task_type, evaluator.is_chief) == ("evaluator", False)


def test_ipv6_addresses_keep_their_brackets_in_endpoints():
    parsed = tf_config.parse(config({"worker": ["[fd00::1]:2222", "10.0.0.2:2222"]}))
    assert tf_config.trainer_endpoints(parsed, 5555) == [
        "tcp://[fd00::1]:5555",
        "tcp://10.0.0.2:5555",
    ]


@pytest.mark.parametrize("text", [None, "", "  ", "{}", '{"cluster": {}}'])
def test_no_cluster_is_one_local_worker(text):
    assert tf_config.parse(text) is None
    environ = {} if text is None else {"TF_CONFIG": text}
    assert tf_config.place(environ) == tf_config.NO_CLUSTER
    assert tf_config.NO_CLUSTER.chief and not tf_config.NO_CLUSTER.in_cluster


def test_the_place_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", config({"worker": ["a:1", "b:1"]}, "worker", 1))
    assert tf_config.place() == tf_config.ClusterPlace(1, 2, chief=False, named=True)
    monkeypatch.delenv("TF_CONFIG")
    assert tf_config.place() == tf_config.NO_CLUSTER


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('{"task": "worker"', "TF_CONFIG is not JSON"),
        ('["worker"]', "must be a JSON object"),
        ('{"task": {"type": "worker", "index": 0}}', "cluster must be an object"),
        (config({"master": ["m:1"]}, "master"), "task type 'master'"),
        (config({"worker": "a:1"}), "cluster.worker must be a non-empty list"),
        (config({"worker": []}), "cluster.worker must be a non-empty list"),
        (config({"worker": {"1": "a:1"}}, "worker", 1), "enableDynamicWorker"),
        (config({"chief": ["c:1", "d:1"]}, "chief"), "cluster.chief has 2 tasks"),
        (config({"worker": ["a:1", "b"]}), "cluster.worker[1] 'b' is not HOST:PORT"),
        (config({"worker": ["a:99999"]}), "port '99999' is not in 1..65535"),
        (config({"worker": ["a:0"]}), "port '0'"),
        (config({"worker": ["a b:1"]}), "is not an IP address or a DNS name"),
        (config({"worker": ["*:1"]}), "host * only names every interface"),
        (config({"worker": ["fd00::1:1"]}), "is not HOST:PORT"),
        (config({"worker": [7]}), "cluster.worker[0] must be a HOST:PORT string, got 7"),
        (config({"worker": ["a:1"]}, "worker", 1), "task.index 1 is out of range"),
        (config({"worker": ["a:1"]}, "worker", -1), "task.index must be an integer >= 0"),
        (config({"worker": ["a:1"]}, "chief"), "task.type 'chief' is not in the cluster"),
        (config({"worker": ["a:1"]}, "boss"), "task.type 'boss' is not one of"),
        (config({"worker": ["a:1"]}, "evaluator", 1), "evaluator must be 0"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": true}}', "got true"),
        ('{"cluster": {"worker": ["a:1"]}}', "task must be an object"),
    ],
)  # fmt: skip
def test_a_bad_tf_config_is_one_line_naming_the_value(text, complaint):
    with pytest.raises(ConfigError) as caught:
        tf_config.parse(text)
    message = str(caught.value)
    assert complaint in message and "TF_CONFIG" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("overrides", "complaint"),
    [
        ({"STAGEFEED_TRAINER_WORKERS": "0"}, "STAGEFEED_TRAINER_WORKERS='0' must be an integer"),
        ({"STAGEFEED_TRAINER_WORKERS": "two"}, "STAGEFEED_TRAINER_WORKERS='two'"),
        ({"JOB_COMPLETION_INDEX": "2"}, "JOB_COMPLETION_INDEX='2' must be an integer in 0..1"),
        ({"JOB_COMPLETION_INDEX": "-1"}, "JOB_COMPLETION_INDEX='-1'"),
        ({"JOB_COMPLETION_INDEX": ""}, "STAGEFEED_TRAINER_WORKERS is set but JOB_COMPLETION"),
        ({"STAGEFEED_TRAINER_SERVICE": ""}, "but STAGEFEED_TRAINER_SERVICE is not"),
        ({"STAGEFEED_TF_PORT": "65536"}, "STAGEFEED_TF_PORT='65536'"),
        ({"STAGEFEED_TRAINER_JOB": "Trainer"}, "STAGEFEED_TRAINER_JOB='Trainer' is not a Kube"),
        ({"STAGEFEED_TRAINER_SERVICE": "a.b"}, "STAGEFEED_TRAINER_SERVICE='a.b'"),
        ({"STAGEFEED_TRAINER_JOB": "j" * 62}, "over 63 characters"),
    ],
)
def test_bad_indexed_job_variables_are_one_line_naming_the_value(overrides, complaint):
    with pytest.raises(ConfigError, match=complaint.replace("(", r"\(")) as caught:
        tf_config.derive_for_indexed_job(indexed_env(2, 1, **overrides))
    assert "\n" not in str(caught.value)


def test_no_indexed_job_variables_derive_nothing():
    assert tf_config.derive_for_indexed_job({"JOB_COMPLETION_INDEX": "3"}) is None
    assert tf_config.derive_for_indexed_job({"STAGEFEED_TRAINER_WORKERS": ""}) is None


def test_apply_sets_tf_config_once_and_refuses_two_descriptions():
    environ = indexed_env(2, 1)
    applied = tf_config.apply_indexed_job(environ)
    assert applied.task_index == 1 and not applied.is_chief
    assert tf_config.parse(environ["TF_CONFIG"]) == applied
    with pytest.raises(ConfigError, match="TF_CONFIG is set and so is STAGEFEED_TRAINER_WORKERS"):
        tf_config.apply_indexed_job(environ)  # the derived TF_CONFIG is there now
    tfjob = {"TF_CONFIG": config({"worker": ["a:1", "b:1"]}, "worker", 1)}
    assert tf_config.apply_indexed_job(tfjob).worker_hosts() == ("a:1", "b:1")  # left as it is
    assert tf_config.apply_indexed_job({}) is None
    with pytest.raises(ConfigError, match="TF_CONFIG is not JSON"):
        tf_config.apply_indexed_job({"TF_CONFIG": "{"})  # checked before TensorFlow loads


@pytest.mark.parametrize("port", [0, 65536, True, "5555"])
def test_trainer_endpoints_refuse_a_bad_feed_port(port):
    with pytest.raises(ConfigError, match="feed port must be in 1..65535"):
        tf_config.trainer_endpoints(config({"worker": ["a:1"]}), port)


def test_trainer_endpoints_need_a_cluster():
    with pytest.raises(ConfigError, match="describes no cluster"):
        tf_config.trainer_endpoints("{}", 5555)


def test_the_module_imports_no_tensorflow():
    code = (
        "import sys; import stagefeed.common.tf_config; "
        "print([m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=cli_env(),
        timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "[]"


_NO_TENSORFLOW = """\
import sys


class NoTensorFlow:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow":
            raise ImportError("tensorflow imported (blocked by the test)")
        return None


sys.meta_path.insert(0, NoTensorFlow)
"""


def train_without_tensorflow(tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`stagefeed train` where importing TensorFlow fails: what happens before it loads."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_NO_TENSORFLOW)
    env = cli_env(**env)
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return subprocess.run(
        [sys.executable, "-m", "stagefeed.cli", "train", "--batch-size", "2"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60, check=False,
    )  # fmt: skip


def test_stagefeed_train_derives_tf_config_before_tensorflow_loads(tmp_path):
    """`stagefeed train` in an Indexed Job's pod sets TF_CONFIG before TensorFlow is imported
    (here the import fails, after the derivation has logged); a bad index fails at start with
    exit 2 and the one line, TensorFlow never imported."""
    good = train_without_tensorflow(tmp_path, indexed_env(2, 1))
    assert "TF_CONFIG from the Indexed Job: worker 1 of 2 (trainer-1.trainer:2222)" in (
        good.stdout + good.stderr
    )
    assert "tensorflow imported (blocked by the test)" in good.stderr
    bad = train_without_tensorflow(tmp_path, indexed_env(2, 5))
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "stagefeed: error: JOB_COMPLETION_INDEX='5' must be an integer in 0..1"
    ]
