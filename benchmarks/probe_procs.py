"""Questions asked each in a spawned process of its own with a time box (benchmarks/gpu_ipc_probe.py's seven): the
runner, and the helpers a question uses to start processes of its own.

A question is a function of an `Ask`, returning a dict, run in a process started with multiprocessing's "spawn"
(never fork after CUDA). Its answer comes back through a pipe. Past its box the process, and every process it
started, is killed by pid, and its answer is `{"error": "no answer within N s", "killed": [pids]}`; a question
that raised answers with the error and where. One `emit("probe", question=..., gpu=..., s=..., ...)` per question
as soon as it (and its variants: the same question in another environment, a sub-answer of its line) answered.
Without a GPU each line says so in `note`, and every answer field is renamed dry_*.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Ask:
    """What a question's process gets: whether it runs on a GPU, a folder of the run's (removed after it), when it
    must have answered (time.time(): a second before its box ends, counted from its start, imports included), the
    clip to decode if any."""
    gpu: bool
    workdir: Path
    deadline: float
    clip: Optional[str] = None

    def left(self, keep_s: float = 0.0) -> float:
        """Seconds to wait for something, keeping `keep_s` for what follows (at least 0.1)."""
        return max(0.1, self.deadline - time.time() - keep_s)


@dataclass(frozen=True)
class Question:
    ask: Callable[[Ask], dict]    # a module-level function: the spawned process imports it by name
    box_s: float
    stand_in: str                 # what replaces the GPU without one, said in the line's note
    variants: dict[str, dict[str, str]] = field(default_factory=dict)  # sub-answer: the environment it runs in


# -- for a question's own processes ----------------------------------------------------------------------
def spawn(target: Callable, *args: Any) -> tuple[Any, Any]:
    """(process, the pipe end it writes to, its last argument): a spawned daemon, so it dies with the question."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    p.start()
    theirs.close()  # only the child's end remains: its death reads as EOF here
    return p, mine


def recv(conn: Any, timeout: float) -> Any:
    """The next message, or a string saying why there is none (none in time, or the sender is gone)."""
    if not conn.poll(timeout):
        return f"nothing within {timeout:.3g} s"
    try:
        return conn.recv()
    except EOFError:
        return "exited without a word"


def reap(p: Any, timeout: float = 5.0) -> Optional[int]:
    """Its exit code, once it ended (killed past `timeout`)."""
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(timeout)
    return p.exitcode


def kill_tree(p: Any) -> list[int]:
    """SIGKILL a question's process and every process it started, by pid (stopped first, so it starts none while
    they are listed); the pids killed. They stay in the caller's process group, so gpu_check's box still covers
    them if this process is killed first."""
    import psutil
    try:
        os.kill(p.pid, signal.SIGSTOP)
        kids = psutil.Process(p.pid).children(recursive=True)
    except (ProcessLookupError, psutil.NoSuchProcess):
        kids = []
    for kid in kids:
        with suppress(psutil.NoSuchProcess):
            kid.kill()
    p.kill()
    p.join(5)
    return [p.pid] + [kid.pid for kid in kids]


# -- the runner ------------------------------------------------------------------------------------------
def _child(ask: Callable[[Ask], dict], a: Ask, env: dict[str, str], conn: Any) -> None:
    os.environ.update(env)  # before this process's first CUDA call: the allocator reads its settings once
    try:
        answer = ask(a)
    except Exception as err:  # an answer too: what raised and where, for the device run's reader
        tb = traceback.extract_tb(err.__traceback__)[-1]
        answer = {"error": f"{type(err).__name__}: {err}"[:400], "where": f"{Path(tb.filename).name}:{tb.lineno}"}
    conn.send(answer)


def run_questions(emit: Callable[..., None], table: dict[str, Question], *, gpu: bool, clip: Optional[str],
                  width: int) -> list[dict]:
    """Every question (and variant) in its own process, `width` at a time, in the table's order; the emitted
    lines' fields."""
    jobs = [(name, v, env) for name, q in table.items() for v, env in [(None, {}), *q.variants.items()]]
    ctx = mp.get_context("spawn")
    answers: dict[str, dict] = defaultdict(dict)  # name: {variant (None: the question itself): answer}
    started: dict[str, float] = {}
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vidar_probe_procs_") as tmp:
        running: dict[Any, tuple] = {}  # its pipe end: (name, variant, process, start, box)
        try:
            while jobs or running:
                while jobs and len(running) < width:
                    name, variant, env = jobs.pop(0)
                    q = table[name]
                    mine, theirs = ctx.Pipe(duplex=False)
                    p = ctx.Process(target=_child, args=(q.ask, Ask(gpu, Path(tmp), time.time() + q.box_s - 1, clip), env, theirs),
                                    name=f"probe-{name}")
                    p.start()
                    theirs.close()
                    started.setdefault(name, time.perf_counter())
                    running[mine] = (name, variant, p, time.perf_counter(), q.box_s)
                for conn in wait(list(running), timeout=0.1):
                    name, variant, p, _, _ = running.pop(conn)
                    got = recv(conn, 0)
                    conn.close()
                    p.join(5)
                    if p.is_alive():  # answered, then stuck on its way out: it and what it started go
                        kill_tree(p)
                    answers[name][variant] = got if isinstance(got, dict) else {
                        "error": f"its process exited ({p.exitcode}) without an answer"}
                for conn, (name, variant, p, t0, box) in list(running.items()):
                    if time.perf_counter() - t0 > box:
                        del running[conn]
                        conn.close()
                        answers[name][variant] = {"error": f"no answer within {box:g} s", "killed": kill_tree(p)}
                done = {line["question"] for line in lines}
                for name, q in table.items():
                    if name not in done and all(v in answers[name] for v in [None, *q.variants]):
                        lines.append(_line(emit, name, gpu, q, answers[name], started[name]))
        finally:
            for _, _, p, _, _ in running.values():  # an exception here: nothing of ours outlives it
                kill_tree(p)
    return lines


def _dry(answer: dict) -> dict:
    """A dry answer's fields renamed dry_* (what went wrong, and the pids a box killed, keep their names): a
    stand-in's number must never read as a GPU's."""
    return {k if k in ("error", "where", "killed") else f"dry_{k}": v for k, v in answer.items()}


def _line(emit: Callable[..., None], name: str, gpu: bool, q: Question, got: dict, t0: float) -> dict:
    answer = dict(got[None])
    for variant in q.variants:
        answer[variant] = got[variant]
        if "error" in got[variant] and "error" not in answer:  # a sub-answer's failure is the line's too
            answer["error"] = f"{variant}: {got[variant]['error']}"
    note = {} if gpu else {"note": f"no GPU: {q.stand_in}; proves the script runs, says nothing about a GPU"}
    fields = {"question": name, "gpu": gpu, "s": round(time.perf_counter() - t0, 2), **note,
              **(answer if gpu else _dry(answer))}
    emit("probe", **fields)
    return fields
