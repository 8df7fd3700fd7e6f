"""benchmarks/gpu_ipc_probe.py's seven device questions (issue 43 item 5), dry on the CPU: each goes through its own
spawned process, time box and JSON line with the stand-ins of benchmarks/gpu_ipc_fake.py, and says that it proves
the script only. A question that never answers is killed past its box, with everything it started."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Callable

import psutil
import pytest

from benchmarks.gpu_ipc_probe import QUESTIONS, Question, run

SEVEN = {"ipc_record_seen", "ipc_dead_recorder", "ipc_consumer_death_leak", "context_memory",
         "busy_contexts_latency", "event_create_48_threads", "nvdec_torn_frames"}


def collect(lines: list) -> Callable[..., None]:
    def emit(part: str, **fields) -> None:
        lines.append({"part": part, "at": time.perf_counter(), **fields})
    return emit


@pytest.mark.timeout(120)
def test_the_seven_questions_answer_dry_each_saying_it_proves_the_script_only():
    lines: list[dict] = []
    t0 = time.perf_counter()
    returned = run(collect(lines), dry=True)
    took = time.perf_counter() - t0
    got = {x["question"]: x for x in lines}
    assert set(QUESTIONS) == SEVEN and set(got) == SEVEN and len(lines) == 7 == len(returned), lines
    for x in lines:
        assert x["part"] == "probe" and x["gpu"] is False and "error" not in x, x
        assert x["note"].startswith("no GPU: ") and "says nothing about a GPU" in x["note"], x
        # no stand-in's number may read as a GPU's: every answer field is named dry_*
        assert all(k.startswith("dry_") for k in set(x) - {"part", "at", "question", "gpu", "s", "note"}), x
    # each line as soon as its question answered, not all at the end
    assert min(x["at"] for x in lines) < t0 + took - 1.0, [round(x["at"] - t0, 2) for x in lines]
    # the scripts' control flow, seen through the stand-ins' (made-up) answers
    seen = got["ipc_record_seen"]
    assert seen["dry_importer"] == ["queued", "done"] and seen["dry_premise_holds"] is True, seen
    dead = got["ipc_dead_recorder"]
    assert dead["dry_recorder"] == "queued" and dead["dry_recorder_exit"] == -9, dead
    assert dead["dry_queries_after_death"] == [False] * 3 and dead["dry_query_after_new_recorder"] is True, dead
    leak = got["ipc_consumer_death_leak"]
    for answer in ({k[4:]: v for k, v in leak.items() if k.startswith("dry_")}, leak["dry_expandable_segments"]):
        assert answer["consumer"] == "opened" and answer["consumer_exit"] == -9, leak
        assert (answer["reserved_mib_after_death"], answer["reserved_mib_after_release"]) == (64, 0), leak
    assert leak["dry_expandable_segments"]["alloc_conf"] == "expandable_segments:True" and not leak["dry_alloc_conf"]
    assert got["context_memory"]["dry_contexts"] == 6, got["context_memory"]
    busy = got["busy_contexts_latency"]
    assert busy["dry_busy_contexts"] == 6 and set(busy["dry_with_busy"]) == {"p50_ms", "p99_ms", "wall_p50_ms",
                                                                             "wall_p99_ms"}, busy
    events = got["event_create_48_threads"]
    assert {f"dry_us_per_event_{w}_{k}_threads" for w in ("new", "reused") for k in (1, 48)} < set(events), events
    torn = got["nvdec_torn_frames"]
    assert torn["dry_threads"] == 32 and torn["dry_frames_per_thread"] == [12, 12] and torn["dry_frames"] == 12, torn
    assert torn["dry_mismatched"] == 0 and torn["dry_decode_device"] == ["cuda"] and not torn["dry_errors"], torn


def _hang(a) -> dict:
    """A question that starts a process of its own, then never answers."""
    mp.get_context("spawn").Process(target=time.sleep, args=(3600,), daemon=True).start()
    time.sleep(3600)
    return {}


def _raises(a) -> dict:
    raise ValueError("on purpose")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, its parent gone: not reaped yet
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
def test_a_question_past_its_box_is_killed_with_what_it_started_and_a_failing_one_says_where():
    lines: list[dict] = []
    box = 4
    run(collect(lines), dry=True, questions={"hang": Question(_hang, box, "nothing"),
                                             "raises": Question(_raises, box, "nothing")})
    got = {x["question"]: x for x in lines}
    hang = got["hang"]
    assert hang["error"] == f"no answer within {box} s" and box <= hang["s"] < box + 3, hang
    assert len(hang["killed"]) == 2, hang  # the question's process and the one it started
    deadline = time.monotonic() + 5
    while not all(map(_gone, hang["killed"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_gone, hang["killed"])), [(p, psutil.Process(p).status()) for p in hang["killed"] if not _gone(p)]
    raised = got["raises"]
    assert raised["error"] == "ValueError: on purpose" and raised["where"].startswith("test_gpu_ipc_probe.py:"), raised
    assert raised["s"] < box, raised
