"""Plain-text tables of bench reports, shaped like the seed's (markdown, so docs can quote them)."""

from __future__ import annotations

from typing import Any

from stagefeed.bench.config import REFERENCES

MODE_MEANING = {
    "synthetic-device": "random tensors made on the training device, held in a variable",
    "synthetic-host": "the same made on the CPU, copied to the device every step",
    "feed_dict": "a numpy batch fed through placeholders every step",
    "seed-staging": "the seed's Python thread -> FIFOQueue -> StagingArea, put grouped",
    "tf.data": "Dataset.from_generator over numpy batches + prefetch",
    "stagefeed": "producer processes -> ZeroMQ -> intake -> FIFOQueue -> StagingArea",
    "stagefeed-tcp": "the same over tcp, as from producers on other hosts",
    "keras-synthetic": "random tensors made on the training device, held; fit's dataset a scalar",
    "keras-from_generator": "fit on Dataset.from_generator over numpy batches + prefetch",
    "keras-stagefeed": "fit on ServedFeed: producer processes -> intake -> queue -> device buffer",
}


def _cell(value: Any, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value}{suffix}"


def _images(schema: dict[str, Any]) -> dict[str, Any]:
    """The ``images`` entry of a schema in its ``to_dict`` form."""
    return next(a for a in schema["arrays"] if a["name"] == "images")


FAMILY_TITLE = {
    "graph": "AlexNet (graph mode: consumer.graph.alexnet in a compat.v1 session)",
    "keras": "AlexNet in Keras 3 (bench.keras_model), model.fit",
}


def steps_table(report: dict[str, Any]) -> str:
    """One table per family of modes in the report (graph, then Keras), each with its notes."""
    s, schema = report["settings"], report["settings"]["schema"]
    images = _images(schema)
    m = report["machine"]
    lines = [
        f"stagefeed bench steps: batch {schema['batch_size']} x {images['dtype']} "
        f"{'x'.join(map(str, images['shape']))} ({s['batch_mb']} MB), "
        f"device {report['device']}, TF {report['tensorflow']}",
        f"{s['steps']} timed steps per mode in {s['rounds']} interleaved rounds, after "
        f"{s['warmup_steps']} warm-up steps; {m['cpus']} CPUs ({m['cpu']}), load "
        f"{m['load_avg_1m']} -> {m.get('load_avg_1m_end', '?')}, {m['date']}",
    ]
    for family in FAMILY_TITLE:
        modes = {n: f for n, f in report["modes"].items() if f["family"] == family}
        if modes:
            lines += ["", *_family_table(report, family, modes)]
    lines += [
        "",
        "note: x reference: median step / the reference's median step; paired: median of each "
        "step / the reference's step in the same round (timed seconds apart).",
        "note: stall %: share of step time spent waiting for a batch before session.run; n/a "
        "where the wait happens inside session.run (or Keras' train_function) and cannot be "
        "told apart from compute.",
    ]
    return "\n".join(lines)


def _family_table(report: dict[str, Any], family: str, modes: dict[str, Any]) -> list[str]:
    reference = REFERENCES[family]
    lines = [
        f"{FAMILY_TITLE[family]}:",
        "",
        f"| mode | median ms/step | p10 | p90 | images/s | x {reference} | paired | stall % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, f in modes.items():
        lines.append(
            f"| {name} | {_cell(f['median_ms'])} | {_cell(f['p10_ms'])} | {_cell(f['p90_ms'])} "
            f"| {_cell(f['images_per_s'])} | {_cell(f['ratio'])} | {_cell(f['paired_ratio'])} "
            f"| {_cell(f['stall_pct'])} |"
        )
    lines.append("")
    lines += [f"  {name}: {MODE_MEANING[name]}" for name in modes]
    notes = _graph_notes(report, modes) if family == "graph" else []
    for name in ("stagefeed", "stagefeed-tcp", "keras-stagefeed"):
        if name in modes:
            i = modes[name]["info"]
            transport = "tcp" if name == "stagefeed-tcp" else report["settings"]["transport"]
            notes.append(
                f"{name}: {i.get('producers')} producers, {i.get('enqueue_threads')} enqueue "
                f"threads (--enqueue-threads), queue {i.get('queue_capacity')} batches, staging "
                f"depth {i.get('stage_depth')}, {transport}."
            )
    feed_cpu = [
        f"{name} {f['feed_cpu_ms_per_step']}"
        for name, f in modes.items()
        if f.get("feed_cpu_ms_per_step") is not None
    ]
    whole = modes.get(reference, {}).get("process_cpu_ms_per_step")
    if feed_cpu:
        notes.append(
            "feed path CPU, core-ms per step: "
            + ", ".join(feed_cpu)
            + (f" ({reference}'s whole step: {whole})" if whole else "")
            + "; on a CPU-only machine the step pays for it."
        )
    return lines + ["", *[f"note: {n}" for n in notes]] if notes else lines


def _graph_notes(report: dict[str, Any], modes: dict[str, Any]) -> list[str]:
    if not report["device"].startswith("/cpu"):
        return []
    notes = [
        "CPU-only: synthetic-host is the same as synthetic-device (no host-to-device copy "
        "exists) and tf.data runs without prefetch_to_device."
    ]
    gauge = modes.get("synthetic-host", {})
    if gauge.get("ratio") is not None and "synthetic-device" in modes:
        notes.append(
            f"noise gauge: synthetic-host does synthetic-device's exact work here, so its "
            f"ratios ({gauge['ratio']}, paired {gauge['paired_ratio']}) show how far this "
            "run's noise alone moves a ratio."
        )
    return notes


def _transport(row: dict[str, Any]) -> str:
    return "shm in place" if row.get("fill") == "inplace" else row["transport"]


def ingest_table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"stagefeed bench ingest: batch {report['settings']['batch_size']} images, GB = 1e9 "
        f"bytes; {m['cpus']} CPUs ({m['cpu']}), load {m['load_avg_1m']} -> "
        f"{m.get('load_avg_1m_end', '?')}, {m['date']}",
        "",
        "| dtype | MB/batch | transport | producers = enqueue threads | raw pyzmq GB/s (over) "
        "| stagefeed GB/s | stagefeed / raw | memcpy GB/s (1 core) | stagefeed / memcpy "
        "| feed core-ms/batch: stagefeed, raw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        memcpy = row["memcpy"]["gb_per_s"]
        fed = row["stagefeed"]["gb_per_s"]
        of_memcpy = round(fed / memcpy, 3) if fed and memcpy else None
        raw_over = row.get("raw_transport", row["transport"])
        lines.append(
            f"| {row['dtype']} | {row['batch_mb']} | {_transport(row)} | {row['producers']} "
            f"| {_cell(row['raw']['gb_per_s'])} ({raw_over}) | {_cell(fed)} "
            f"| {_cell(row['ratio'])} | {_cell(memcpy)} | {_cell(of_memcpy)} "
            f"| {_cell(row['stagefeed'].get('core_ms_per_batch'))}, "
            f"{_cell(row['raw'].get('core_ms_per_batch'))} |"
        )
    lines += [
        "",
        "note: raw pyzmq = the same messages from as many sender processes into one PULL "
        "socket, zero-copy send and receive, nothing done with them (the transport's ceiling), "
        "its receiver under the trainer's malloc policy.",
        "note: stagefeed = producer processes -> ZeroMQ -> intake -> enqueue threads -> "
        "FIFOQueue -> StagingArea, consumed by a step that reads labels and one pixel per image.",
        "note: shm = the same, but each batch is copied by its producer into a slot of a "
        "shared-memory pool and only a descriptor crosses ZeroMQ (ipc); TF aliases the slot. "
        "Its raw pyzmq peer is tcp. A batch copied once moves at most at memcpy's speed, so "
        "its stagefeed / raw is bounded by memcpy / raw of the same row.",
        "note: shm in place = the same, but the producer's source fills the slot itself and "
        "writes only the labels (bench.sources.labels_in_place): the transport's own cost.",
        "note: feed core-ms/batch = CPU of the producers, the trainer's intake, enqueue and "
        "pool threads and ZeroMQ I/O threads (raw: senders + receiver) per timed batch.",
    ]
    return "\n".join(lines)
