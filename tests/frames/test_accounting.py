"""The ledger's holders: a stream's snapshot asks only the holders that may hold its frames."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.frames.accounting import Accounting

pytestmark = pytest.mark.timeout(30)


def _ledger(streams: list[str]):
    acct, calls = Accounting("classify"), Counter()

    def holder(name, counts):
        def count():
            calls[name] += 1
            return Counter(counts)
        return count

    for s in streams:  # as a pool registers each stream's ring: its own frames only
        acct.add_holder(f"ring:{s}", holder(f"ring:{s}", {s: 1}), stream=s)
    acct.add_holder("scheduler", holder("scheduler", {s: 2 for s in streams}))  # any stream's frames
    for s in streams:
        acct.ingest(s, 3)
    return acct, calls


def test_a_streams_snapshot_asks_its_own_ring_and_the_shared_holders_only():
    """A metrics scrape or the status line snapshots every stream: asking all N rings for each of N streams held
    the ledger lock and the GIL ~40 ms at 48 streams. One snapshot asks 1 ring + the shared holders."""
    streams = [f"s{i}" for i in range(48)]
    acct, calls = _ledger(streams)
    snap = acct.snapshot("s7")
    assert snap.held == {"ring:s7": 1, "scheduler": 2} and snap.in_flight == 3 and snap.balanced()
    assert calls == Counter({"ring:s7": 1, "scheduler": 1})
    assert acct.held("s7") == 3 and acct.held("s7", exclude=("scheduler",)) == 1
    assert acct.audit() == {}  # the audit still asks every holder
    assert acct.held_by_stream(exclude_prefix="ring:") == Counter({s: 2 for s in streams})


def test_a_removed_holder_is_asked_no_more_and_a_name_registered_again_replaces_it():
    acct, calls = _ledger(["a", "b"])
    acct.remove_holder("ring:a")
    assert acct.snapshot("a").held == {"scheduler": 2}
    acct.add_holder("ring:a", lambda: Counter({"a": 5}), stream="a")
    acct.add_holder("ring:a", lambda: Counter({"a": 1}), stream="a")  # the same name: replaced, not added
    assert acct.snapshot("a").held == {"ring:a": 1, "scheduler": 2}
    acct.add_holder("ring:a", lambda: Counter({"a": 1}))  # now shared: asked for every stream, never twice
    assert acct.snapshot("a").held == {"ring:a": 1, "scheduler": 2} and acct.snapshot("b").held["ring:b"] == 1
