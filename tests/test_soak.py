"""benchmarks/soak.py's judgement, without an engine: the delivery ledger (every published result received or
counted missed, matched in order; a loss nobody counted named), the fault tally (a fault that never fired, raised,
or was not recovered from fails the soak), the trend rules over samples, and what it reads of processes and
/dev/shm. Each rule is also shown failing."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("soak", None)


def result(stream: str, seq: int) -> dict:
    return {"type": "classify", "stream": stream, "seq": seq, "t_capture": 1000.0 + seq}


def publish(ledger, stream: str, seqs, missed_at=(), missed_before: int = 0) -> int:
    """Sends as the publisher's listener reports them: the stream's missed count moves on a missed send."""
    missed = missed_before
    for seq in seqs:
        missed += seq in missed_at
        ledger.on_sent(result(stream, seq), missed)
    return missed


def test_ledger_every_result_received_or_counted(soak):
    led = soak.DeliveryLedger()
    publish(led, "cam0", range(10), missed_at={3, 4, 7})
    for seq in (0, 1, 2, 4, 5, 6, 8, 9):  # 3 and 7 missed and lost; 4 counted missed but received all the same
        led.on_received(result("cam0", seq))
    led.match(final=True)
    assert led.check({"cam0": 10}, {"cam0": 3}) == []
    s = led.summary()["cam0"]
    assert (s["received"], s["counted_missed"], s["missed_lost"], s["missed_received"]) == (8, 3, 2, 1)


def test_ledger_names_a_loss_nobody_counted(soak):
    led = soak.DeliveryLedger()
    publish(led, "cam0", range(6), missed_at={2})
    for seq in (0, 1, 3, 5):  # 2 missed (counted); 4 lost without a count
        led.on_received(result("cam0", seq))
    led.match(final=True)
    why = led.check({"cam0": 6}, {"cam0": 1})
    assert any("1 results neither received nor counted missed" in w for w in why)
    assert led.examples[0]["seq"] == 4


@pytest.mark.parametrize("published, publisher_missed, match", [
    ({"cam0": 7}, {"cam0": 1}, "listener saw 6 results sent, the engine counted 7"),
    ({"cam0": 6}, {"cam0": 2}, "the publisher counted 2 missed, the ledger flagged 1"),
])
def test_ledger_counts_checked_independently(soak, published, publisher_missed, match):
    led = soak.DeliveryLedger()
    publish(led, "cam0", range(6), missed_at={2})
    for seq in (0, 1, 3, 4, 5):
        led.on_received(result("cam0", seq))
    led.match(final=True)
    assert any(match in w for w in led.check(published, publisher_missed))


def test_ledger_a_received_result_never_sent_fails(soak):
    led = soak.DeliveryLedger()
    publish(led, "cam0", range(2))
    for seq in (0, 1, 9):
        led.on_received(result("cam0", seq))
    led.match()  # not final: 9 may be a send whose listener has not run yet
    assert led.got["cam0"] == 2 and not led.unknown
    led.match(final=True)
    assert any("never recorded as published" in w for w in led.check({"cam0": 2}, {}))


def test_ledger_removed_stream_counts_again_from_zero(soak):
    """The publisher forgets a removed stream's missed count; the next incarnation's first missed send is 1 again."""
    led = soak.DeliveryLedger()
    missed = publish(led, "cam0", range(3), missed_at={1})  # count 1
    led.forgotten("cam0", missed)
    publish(led, "cam0", range(100, 103), missed_at={100})  # count 1 again: still a missed send
    for seq in (0, 2, 101, 102):
        led.on_received(result("cam0", seq))
    led.match(final=True)
    assert led.sent_missed["cam0"] == 2
    assert led.check({"cam0": 6}, {"cam0": 1}) == []


def test_ledger_events_move_the_count_but_are_not_results(soak):
    led = soak.DeliveryLedger()
    led.on_sent({"type": "event", "stream": "cam0", "kind": "started"}, 1)
    led.on_sent(result("cam0", 0), 1)
    led.on_received(result("cam0", 0))
    led.match(final=True)
    assert led.events_missed["cam0"] == 1 and led.sent_missed["cam0"] == 0
    assert led.check({"cam0": 1}, {"cam0": 1}) == []


def test_fault_tally(soak):
    t = soak.FaultTally()
    t.add("ingest_kill", "scheduled", 3)
    t.add("ingest_kill", "fired", 3)
    t.add("ingest_kill", "recovered", 3)
    assert t.problems() == []
    t.add("worker_kill", "scheduled")
    t.add("worker_kill", "errors")
    t.add("rtsp_restart", "scheduled", 2)
    t.add("rtsp_restart", "fired", 2)
    t.add("rtsp_restart", "recovered", 1)
    assert t.problems() == ["faults: rtsp_restart: recovered from 1 of 2 fired",
                            "faults: worker_kill: 1 injection(s) raised",
                            "faults: worker_kill: scheduled 1 time(s), never fired"]


def test_fault_tally_descriptors_held_after_recovery(soak):
    t = soak.FaultTally()
    t.add("ingest_kill", "scheduled", 2)
    t.add("ingest_kill", "fired", 2)
    t.add("ingest_kill", "recovered", 2)
    t.descriptors("ingest_kill", {})
    assert t.problems() == []
    t.descriptors("ingest_kill", {"pipe": 2})
    assert t.problems() == ["faults: ingest_kill: after 1 of 2 recoveries the engine held more descriptors than "
                            "before the fault (pipe +2 in all)"]
    assert t.as_dict()["ingest_kill"]["fds_held_by_kind"] == {"pipe": 2}


def samples(soak, n: int = 20, **slopes) -> list[dict]:
    """Flat samples every 10 s; `slopes`: key -> growth per sample."""
    base = {k: 0 for k, _, _ in soak.JUDGED}
    base.update(rss_trimmed_mb=800.0, ingest_rss_mb=700.0, helpers_rss_mb=90.0, fds=40, shm_segments=4, shm_mb=14.0)
    return [dict(base, t=10.0 * i, **{k: base[k] + v * i for k, v in slopes.items()}) for i in range(n)]


@pytest.mark.parametrize("slopes, fails", [
    ({}, []),
    ({"rss_trimmed_mb": 0.02}, []),                                   # 1.2 MB / 10 min: under the limit
    ({"ingest_rss_mb": 1.0}, ["trend: ingest_rss_mb grows 60.0 MB per 10 min"]),
    ({"fds": 0.5}, ["trend: fds grows: median"]),
    ({"ingest_fds": 1}, ["trend: ingest_fds grows: median"]),
    ({"shm_segments": 0.2}, ["trend: shm_segments grows: median"]),
])
def test_trends(soak, slopes, fails):
    _, failures = soak.judge_trends(samples(soak, **slopes), warmup_frac=0.2, rss_limit=5.0, rss_noise=2.0)
    assert len(failures) == len(fails)
    for got, want in zip(failures, fails):
        assert got.startswith(want)


def test_trends_need_samples(soak):
    _, failures = soak.judge_trends(samples(soak, 3), warmup_frac=0.2, rss_limit=5.0, rss_noise=2.0)
    assert failures and "need 4" in failures[0]


def test_process_and_shm_readings(soak, tmp_path, monkeypatch):
    rec = soak.proc_sample(psutil.Process())
    assert rec["pid"] == os.getpid() and rec["fds"] > 0 and rec["threads"] >= 1 and rec["rss_mb"] > 0
    assert abs(sum(soak.fd_kinds().values()) - rec["fds"]) <= 1  # the listing's own descriptor, seen or not
    for name, size in (("vidar-ab12-cam0-1", 8192), ("vidar-ab12-cam1-1", 4096), ("vidar-zz99-cam0-1", 4096),
                       ("other", 4096)):
        with open(tmp_path / name, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
    monkeypatch.setattr(soak, "SHM_DIR", str(tmp_path))
    u = soak.shm_usage("vidar-ab12-")
    assert (u["shm_segments"], u["shm_all_vidar"]) == (2, 3)
    assert u["shm_mb"] == pytest.approx(12288 / 2 ** 20, abs=0.01)
    assert soak.run_prefix(["vidar-ab12-cam0-1"]) == "vidar-ab12-"
