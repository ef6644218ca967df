"""``bench input``'s table (markdown, so docs can quote it) and the targets it measured."""

from __future__ import annotations

from typing import Any

MODE_MEANING = {
    "ideal": "one process decoding alone (decode + crop + flip), training nothing",
    "stagefeed": "stagefeed run: images:DIR source + --transform in N producer processes",
    "tf.data": "read_file + decode_jpeg + crop/flip in TF ops, map(AUTOTUNE), batch, prefetch",
    "from_generator": "Dataset.from_generator over the Python decode, batch, prefetch",
    "pydataset": "keras.utils.PyDataset(workers=N, use_multiprocessing=True), Python decode",
}


def _cell(value: Any) -> str:
    return "n/a" if value is None else str(value)


def _name(row: dict[str, Any]) -> str:
    return f"{row['mode']} {row['transport']}".strip()


def _workers(row: dict[str, Any], cores: int) -> str:
    return f"AUTOTUNE ({cores} cores)" if row["workers"] == 0 else str(row["workers"])


def input_table(report: dict[str, Any]) -> str:
    """The table, its notes and the targets: met or missed, with what was measured."""
    s, m, ideal = report["settings"], report["machine"], report["ideal"]
    cores = m.get("cpus") or 1
    lines = [
        f"stagefeed bench input: {s['images']} JPEGs of {s['image_size']}x{s['image_size']}, "
        f"random crop {s['crop']}x{s['crop']} + flip, batch {s['batch_size']}, "
        f"{s['steps']} timed steps per mode after {s['warmup_steps']} warm-up steps; "
        f"Python decode: {ideal['decoder'] or 'n/a'}",
        f"{cores} CPUs ({m['cpu']}), load {m['load_avg_1m']} -> {m.get('load_avg_1m_end', '?')}"
        f", {m['date']}, {m['wall_s']} s",
        "",
        "| mode | N | images/s | ideal (N x one) | x ideal | core-ms/image |",
        "|---|---|---|---|---|---|",
    ]
    runs = ideal["runs_images_per_s"]
    if ideal["images_per_s"] is not None:
        lines.append(
            f"| ideal | 1 | {ideal['images_per_s']} | {ideal['images_per_s']} | 1.0 | "
            f"{_cell(ideal['core_ms_per_image'])} |"
        )
    for row in report["rows"]:
        lines.append(
            f"| {_name(row)} | {_workers(row, cores)} | {_cell(row['images_per_s'])} | "
            f"{_cell(row['ideal_images_per_s'])} | {_cell(row['ratio'])} | "
            f"{_cell(row['core_ms_per_image'])} |"
        )
    modes = ["ideal"] + [r["mode"] for r in report["rows"]]
    lines += [""] + [f"- {mode}: {MODE_MEANING[mode]}" for mode in dict.fromkeys(modes)]
    lines += [
        "",
        "note: ideal: the mean of its runs before and after the other modes "
        f"({', '.join(map(str, runs)) or 'none'} images/s); x ideal: images/s over N times it "
        "(tf.data: over the host's cores times it, what AUTOTUNE may use).",
        "note: core-ms/image: user + system CPU of the mode's process tree (trainer, producers, "
        "workers) over its timed window, per image. Every mode shares the same cores.",
    ]
    compared = [r for r in report["rows"] if r.get("vs")]
    if compared:
        lines += ["", "stagefeed's images/s over each peer's (PyDataset: the same N):"]
        for row in compared:
            vs = ", ".join(f"{peer} {x}x" for peer, x in row["vs"].items() if x is not None)
            lines.append(f"- {_name(row)} x{row['workers']}: {vs or 'no peer measured'}")
    if report["targets"]:
        lines += ["", "targets (issue 30):"]
        for target in report["targets"]:
            verdict = "met" if target["met"] else "MISSED"
            lines.append(f"- {target['target']}: {target['measured']} ({verdict})")
    return "\n".join(lines)
