"""A fake GPU clock for the CPU tests of measured choices: ms per call by choice, every timing recorded."""

from __future__ import annotations

MS = {("cutlass", 0): 1.0, ("cutlass", 2): 0.6, ("cutlass", 10): 0.9, ("torch", None): 0.8, ("loop", None): 2.0}


class FakeTimer:
    """ms per call by choice; records (choice, calls) of every timing."""

    def __init__(self, ms):
        self.ms = dict(ms)
        self.calls = []

    def __call__(self, fn, calls):
        choice = fn()
        self.calls.append((choice, calls))
        return self.ms[choice]
