"""One ``bench steps`` mode in its own process, driven over a pipe by the coordinator.

Protocol (coordinator -> worker): ``("steps", n)`` runs n steps then settles, answered by
``("done", {"step_s": [...], "wait_s": [...], "settle": {...}, "process_cpu_s": x,
"feed_cpu_s": y})``; ``("close", 0)`` ends it, even in the middle of a block.
The first message from the worker is ``("ready", info)``; any failure is ``("error", text)``.
TensorFlow is imported inside the worker only, never by the coordinator.

Once its mode is closed, a worker ends with ``os._exit(0)``: after long runs, interpreter
finalization of a process holding TensorFlow and Keras (a model, its traced functions, a tf.data
iterator) was seen to take over 20 s on the loaded 2-core machine, after which the coordinator
terminated the worker; nothing a closed mode holds needs Python's finalizers (its producers are
stopped and joined, its socket file removed, mappings go with the process). A mode's close
drops its producer pool, so the pool's semaphores leave the resource tracker's books then; the
mode itself is not collected (``gc.collect()`` there destroys the TensorFlow objects, the slow
part: a run with it still had two workers terminated after 20 s).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import traceback
from typing import Any

from stagefeed.bench.config import StepsConfig
from stagefeed.bench.cpu import process_cpu_s
from stagefeed.common.errors import ConfigError
from stagefeed.common.logs import setup_logging

log = logging.getLogger(__name__)

# The modes whose trainer applies stagefeed's malloc policy; the others keep glibc's defaults,
# as a user's own code would.
POLICY_MODES = ("stagefeed", "stagefeed-tcp", "keras-stagefeed")


def open_mode(name: str, config: StepsConfig, device: str) -> Any:
    """The mode object for ``name`` (imports TensorFlow)."""
    from stagefeed.bench import modes

    if name in ("synthetic-device", "synthetic-host"):
        return modes.SyntheticMode(config, device, on_host=name == "synthetic-host")
    if name == "feed_dict":
        return modes.FeedDictMode(config, device)
    if name == "tf.data":
        return modes.TfDataMode(config, device)
    if name == "seed-staging":
        from stagefeed.bench.seed_staging import SeedStagingMode

        return SeedStagingMode(config, device)
    if name in ("stagefeed", "stagefeed-tcp"):
        from stagefeed.bench.stagefeed_mode import StagefeedMode

        if name == "stagefeed-tcp":
            config = dataclasses.replace(config, transport="tcp")
        return StagefeedMode(config, device)
    if name in ("keras-synthetic", "keras-from_generator"):
        from stagefeed.bench import keras_modes

        if name == "keras-synthetic":
            return keras_modes.KerasSyntheticMode(config, device)
        return keras_modes.KerasFromGeneratorMode(config, device)
    if name == "keras-stagefeed":
        from stagefeed.bench.keras_stagefeed import KerasStagefeedMode

        return KerasStagefeedMode(config, device)
    raise ConfigError(f"unknown mode {name!r}")


class _CloseRequested(Exception):
    """The coordinator asked to close in the middle of a block (it is stopping)."""


def _run_block(mode: Any, count: int, conn: Any) -> dict[str, Any]:
    """``count`` steps, then settle; CPU seconds spent from the first step to the settle's end
    by this process and, where the mode can tell, by its feed path (any process).

    Between steps the pipe is checked: the only message that can arrive mid-block is
    ``close``, and it ends the block at once."""
    feed_cpu = getattr(mode, "feed_cpu_s", lambda: None)
    cpu_before, feed_before = process_cpu_s(), feed_cpu()
    step_s, wait_s = [], []
    for _ in range(count):
        if conn.poll():
            raise _CloseRequested
        total, waited = mode.step()
        step_s.append(total)
        wait_s.append(waited)
    settle = mode.settle()
    cpu_after, feed_after = process_cpu_s(), feed_cpu()
    return {
        "step_s": step_s,
        "wait_s": wait_s,
        "settle": settle,
        "process_cpu_s": _delta(cpu_before, cpu_after),
        "feed_cpu_s": _delta(feed_before, feed_after),
    }


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def mode_worker(name: str, config: StepsConfig, conn: Any, log_level: int) -> None:
    """Process entry point. The coordinator owns shutdown: SIGINT is ignored here."""
    setup_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mode = None
    try:
        largest = config.schema.largest_array_bytes
        if name in POLICY_MODES:
            from stagefeed.consumer.memory import malloc_policy

            if largest > malloc_policy.THREAD_HEAP_BYTES:  # as the command line does
                malloc_policy.keep_freed_memory(largest)  # before TensorFlow's threads
        from stagefeed.consumer.quiet_tf import import_tensorflow

        tf = import_tensorflow()
        from stagefeed.consumer.devices import training_device

        device = training_device(config.device)
        mode = open_mode(name, config, device)
        info = mode.setup()
        info.update({"device": device, "tensorflow": tf.__version__})
        conn.send(("ready", info))
        while True:
            command, count = conn.recv()
            if command == "close":
                break
            conn.send(("done", _run_block(mode, count, conn)))
    except _CloseRequested:
        log.info("%s worker closing mid-block", name)
    except EOFError:
        log.warning("bench coordinator went away; %s worker stopping", name)
    except Exception as exc:  # noqa: BLE001 - sent to the coordinator, which raises it
        log.debug("mode %s failed", name, exc_info=True)
        kind = "config" if isinstance(exc, ConfigError) else "error"
        try:
            conn.send((kind, f"{name}: {exc!r}\n{traceback.format_exc(limit=8)}"))
        except (BrokenPipeError, EOFError, OSError):
            pass
    finally:
        if mode is not None:
            started = time.monotonic()
            mode.close()
            log.info("%s closed in %.1f s", name, time.monotonic() - started)
        conn.close()
    logging.shutdown()  # flush, before the exit that skips finalization
    os._exit(0)
