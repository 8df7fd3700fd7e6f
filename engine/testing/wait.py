"""One polling helper for tests and benchmarks: wait for a condition, with a deadline."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(cond: Callable[[], Any], timeout: float, step: float = 0.05) -> Any:
    """Poll `cond` every `step` seconds until it is true or `timeout` seconds pass; whether it came true.

    `cond` is called at least once, and once more when the deadline has passed (a condition that came
    true during the last sleep still counts). Returns the truthy value `cond` gave (True for a plain
    predicate, so `assert wait_for(...)` reads as a check), or False on timeout.
    """
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= end:
            return False
        time.sleep(step)
