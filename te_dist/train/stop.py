"""A rank's SIGINT/SIGTERM: stop every rank at the same step boundary (SIGTERM: after a checkpoint).

Why not stop where the signal lands: ranks receive it at different moments, and a rank that
leaves mid-step leaves its peers waiting in a collective. So the handler only records the
signal; each step's loss all-reduce carries every rank's votes (no extra collective), and all
ranks read the same sums and stop after the same step. SIGTERM (a scheduler's preemption,
``te-dist train`` forwarding it) saves a checkpoint first, like Megatron's
``--exit-signal-handler``; SIGINT (an interrupt) stops without one. One rank's vote is enough.

    rank r: signal -> StopRequest.votes() = [sigint?, sigterm?]
    step s: all_reduce(SUM)([loss, sigint votes, sigterm votes]) -> agreed(...) on every rank
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

__all__ = ["StopRequest"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The stop signals this rank has received (the handler records; the loop decides)."""

    def __init__(self):
        self.received = set()

    def install(self) -> "StopRequest":
        """Handle SIGINT/SIGTERM from now on (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.received.add(signum)

    def votes(self) -> list:
        """[1.0 if SIGINT was received, 1.0 if SIGTERM was]: summed over ranks by the loss all-reduce."""
        return [float(signal.SIGINT in self.received), float(signal.SIGTERM in self.received)]

    @staticmethod
    def agreed(sigint_votes: float, sigterm_votes: float) -> Optional[signal.Signals]:
        """The signal every rank acts on, from the summed votes (SIGTERM wins: it asks for a checkpoint)."""
        if sigterm_votes > 0:
            return signal.SIGTERM
        if sigint_votes > 0:
            return signal.SIGINT
        return None
