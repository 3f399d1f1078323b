"""Preemption signals: the handler only sets a flag (docs/architecture.md §Conventions); the session
reads it at the next step boundary, where the ranks agree on a stop step with a small all-reduce."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

# SIGHUP too: a hangup (a closed terminal, an ssh session that ends) must stop like a preemption —
# the in-flight save finishes, the ranks agree on a stop step — not kill a rank mid-save.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.when: float | None = None      # monotonic time of the first signal
        self._previous: dict[int, Any] = {}

    @property
    def set(self) -> bool:
        return self.signum is not None

    def _handler(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum, self.when = signum, time.monotonic()

    def install(self) -> bool:
        """Install the handlers; only possible on the main thread (False elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handler)
        return True

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def elapsed_s(self, now: float | None = None) -> float:
        if self.when is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.when


def emergency_save_fits(*, measured_save_s: float | None, margin: float, budget_s: float | None,
                        elapsed_s: float = 0.0) -> bool:
    """Pure rule: save only if the measured save time x margin fits what is left of the budget.
    An unmeasured save, or no budget, never fits (no save on a guess)."""
    if measured_save_s is None or budget_s is None:
        return False
    return measured_save_s * margin <= budget_s - elapsed_s
