"""The one writer of Keras' ``model.stop_training`` in stagefeed: ``FitStops``.

``fit`` checks the flag after each step (the epoch ends) and after each epoch's callbacks (fit
ends). Stagefeed decides it three ways, each with a reason:

- ``stop(reason)``: ``fit`` ends after the step in progress and nothing lets it go on (a stop
  or a failure of the run, its planned steps or passes trained, the feed closed and drained).
  From any thread.
- ``cut_epoch(reason)``: the epoch ends after this step, and ``fit`` goes on to the next at
  that epoch's end (a pass boundary, the steps a resumed epoch had left).
- ``go_on()``: at the end of a cut epoch, the cut is undone: ``fit`` goes on.

Stopping wins over going on, whatever the order of the calls or of the callbacks that make
them: the flag holds a ``Halt`` (truthy, with its reason) when written here, and ``go_on``
clears only a cut; a stop, or a flag set by anyone else (a user's ``EarlyStopping``,
``TerminateOnNaN``), stays set. A cut never replaces a stop or another's flag.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Halt:
    """``model.stop_training`` as ``FitStops`` writes it: true, with why (``ends_fit``: a stop;
    else an epoch cut)."""

    reason: str
    ends_fit: bool

    def __bool__(self) -> bool:
        return True


class FitStops:
    """The owner of one model's ``stop_training`` (see the module docstring). ``bind`` the
    model before ``fit`` (a stop asked before is applied then)."""

    def __init__(self, model: Any = None) -> None:
        self._lock = threading.Lock()
        self._model = model
        self._stopped: Halt | None = None

    def bind(self, model: Any) -> None:
        """Write ``model``'s flag from now on (``fit`` clears it at its start)."""
        with self._lock:
            self._model = model
            if self._stopped is not None:
                model.stop_training = self._stopped

    @property
    def stopped(self) -> str | None:
        """Why ``fit`` was stopped, or None."""
        return None if self._stopped is None else self._stopped.reason

    def stop(self, reason: str) -> None:
        """``fit`` ends after the step in progress; nothing lets it go on (any thread)."""
        with self._lock:
            if self._stopped is None:
                self._stopped = Halt(reason, ends_fit=True)
                log.debug("fit stops after this step: %s", reason)
            if self._model is not None:
                self._model.stop_training = self._stopped

    def cut_epoch(self, reason: str) -> None:
        """(``fit``'s thread) The epoch ends after this step; ``go_on`` at its end."""
        with self._lock:
            model = self._model
            assert model is not None, "FitStops.bind(model) before fit"
            flag = model.stop_training
            if self._stopped is None and (not flag or isinstance(flag, Halt)):
                model.stop_training = Halt(reason, ends_fit=False)
                log.debug("fit's epoch ends after this step: %s", reason)

    def go_on(self) -> bool:
        """(an epoch's end) Undo a cut: ``fit`` goes on, unless it was stopped (here, or by
        anyone else's flag). Whether it goes on."""
        with self._lock:
            model = self._model
            assert model is not None, "FitStops.bind(model) before fit"
            if self._stopped is not None:
                model.stop_training = self._stopped
                return False
            flag = model.stop_training
            if isinstance(flag, Halt) and not flag.ends_fit:
                model.stop_training = False
                return True
            return not flag
