"""Two trainer workers on loopback (MultiWorkerMirroredStrategy, real processes): the custom
distributed step and the collective verdicts of consumer/cluster (child:
tests/helpers/cluster_child.py). Every run here ends in a verdict both workers reach at the
same step, so one cluster trains them one after the other, each with a model of its own (two
TensorFlow processes for six cases); the cases that break a cluster or signal a worker are in
tests/test_cluster_loop.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.helpers.cluster_workers import Workers, references

pytestmark = pytest.mark.slow

PLAIN = {"steps": 10, "batch": 4}
# Each case: worker 0's run, worker 1's run.
CASES = {
    # Uneven per-worker batches (6 and 2): the loss is the global batch's mean all the same.
    "like-one-process": ({"steps": 5, "batch": [6, 2]}, {"steps": 5, "batch": [6, 2]}),
    "one-worker-ends": (PLAIN, {**PLAIN, "end_at": 3}),
    "both-end": ({**PLAIN, "end_at": 3}, {**PLAIN, "end_at": 3}),
    # The production input: each worker's stagefeed Feed (an eager queue filled by a thread,
    # feed.dataset(strategy=...)); worker 1's source ends after 3 batches and closes its feed.
    "feeds": ({**PLAIN, "feed": True}, {**PLAIN, "feed": True, "end_at": 3}),
    "stop-vote": ({**PLAIN, "stop_at": 2}, PLAIN),
    "nan": (PLAIN, {**PLAIN, "nan_at": 3}),  # last: it ends the processes (exit 4)
}
REFERENCES = {"like-one-process": {"steps": 5, "batch": [6, 2]}, "feeds": {"steps": 3, "batch": 4}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Each case's results on worker 0 and worker 1, from one cluster that trained them all."""
    group = Workers(
        tmp_path_factory.mktemp("cluster-runs"),
        [{"runs": [case[index] for case in CASES.values()]} for index in range(2)],
    )
    try:
        (code0, first), (code1, second) = group.wait(240)
    finally:
        group.kill()
    assert (code0, code1) == (4, 4), "the last case (nan) ends both with exit 4"
    logs = [group.output(index)[-3000:] for index in range(2)]
    assert len(first) == len(second) == len(CASES), logs
    return dict(zip(CASES, zip(first, second, strict=True), strict=True))


@pytest.fixture(scope="module")
def expected() -> dict[str, dict]:
    return dict(zip(REFERENCES, references(list(REFERENCES.values())), strict=True))


def flat(weights: list[list[float]]) -> np.ndarray:
    return np.array(list(itertools.chain(*weights)))


def test_each_run_of_the_cluster_starts_from_the_same_model(results):
    # The runs do not leak into each other: the same seed makes the same first weights.
    initial = [run["initial"] for pair in results.values() for run in pair]
    assert all(weights == initial[0] for weights in initial)


def test_two_workers_train_like_one_process_on_their_batches_put_together(results, expected):
    first, second = results["like-one-process"]
    reference = expected["like-one-process"]
    assert first["code"] == second["code"] == 0
    assert first["chief"] and not second["chief"] and first["replicas"] == 2
    assert first["steps"] == second["steps"] == 5
    assert first["reason"] == "worker 0, 1 stops"  # both spent their budget
    assert first["weights"] == second["weights"]  # bit for bit
    np.testing.assert_allclose(flat(first["weights"]), flat(reference["weights"]), atol=1e-6)
    # Figures once per step, the same on both, the step's own values as Keras computes them
    assert first["history"] == second["history"]
    np.testing.assert_allclose(first["losses"], reference["losses"], rtol=1e-6)
    accuracy = [h["accuracy"] for h in reference["history"]]
    assert [h["accuracy"] for h in first["history"]] == accuracy


@pytest.mark.parametrize(
    ("case", "reason", "votes"),
    [
        ("one-worker-ends", "the data of worker 1 ended", ["RUNNING", "DRAIN"]),
        ("both-end", "every worker's data ended", ["DRAIN", "DRAIN"]),
    ],
)
def test_a_workers_data_ending_stops_both_at_the_same_step(results, case, reason, votes):
    first, second = results[case]
    assert first["code"] == second["code"] == 0
    assert first["steps"] == second["steps"] == 3
    assert first["ending"] == second["ending"] == "DRAIN"
    assert first["reason"] == second["reason"] == reason
    assert first["votes"] == second["votes"] == votes
    assert first["weights"] == second["weights"]


def test_each_worker_trains_from_its_own_feed_and_its_books_balance(results, expected):
    first, second = results["feeds"]
    assert first["code"] == second["code"] == 0
    assert first["steps"] == second["steps"] == 3
    assert first["reason"] == second["reason"] == "the data of worker 1 ended"
    np.testing.assert_allclose(first["losses"], expected["feeds"]["losses"], rtol=1e-6)
    assert first["weights"] == second["weights"]
    assert second["feed"] == {"enqueued": 3, "trained": 3, "abandoned": 0, "queued": 0}
    books = first["feed"]  # endless: the fetched batch of the last vote and the buffer abandoned
    assert books["trained"] == 3 and books["abandoned"] >= 1
    assert books["enqueued"] == books["trained"] + books["abandoned"] + books["queued"]


def test_a_stop_vote_stops_both_at_the_same_step(results):
    first, second = results["stop-vote"]
    assert first["code"] == second["code"] == 0
    assert first["steps"] == second["steps"] == 2
    assert first["reason"] == second["reason"] == "worker 0 stops"
    assert first["votes"] == second["votes"] == ["STOP", "RUNNING"]


def test_a_nan_on_one_worker_stops_both_with_the_non_finite_error(results):
    first, second = results["nan"]
    assert first["code"] == second["code"] == 4
    message = "step 3: loss is nan; training stopped (--on-nan warn only warns)"
    assert first["non_finite"] == second["non_finite"] == message
    assert first["steps"] == second["steps"] == 3
