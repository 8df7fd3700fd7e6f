"""The ingest processes themselves: started, told things, checked, ended (the I/O thread's process manager).

vLLM v1 keeps its engine-core processes in a manager of their own beside the client that talks to them; so
here. Each process: started by multiprocessing's forkserver (`av`, `numpy` preloaded there, so a child starts
in milliseconds and never forks a process that has threads), one ZeroMQ PUSH for its commands (the process binds,
the engine connects: see `start`), one uplink (uplink.py) for what it sends. Its exit is polled here every 50 ms
(its pidfd: supervisor.IngestProcess.alive) rather than registered in the I/O thread's poller, which would need rebuilding at
every restart for a gain of at most 50 ms of the 5 s promised. What a death means for its streams is leases.py's.
Only the I/O thread calls in here.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import socket
import sys
import time
from typing import Any, Callable

import zmq

from engine.config import EngineConfig
from engine.ingest import uplink, wire
from engine.ingest.supervisor import IngestProcess

log = logging.getLogger("vidar.ingest")

#: Modules an ingest process imports at start. Tests only (a source that crashes on purpose is registered
#: this way, tests/support/crashing_source.py); the product never sets it.
TEST_IMPORTS: list[str] = []

_PRELOAD = ["av", "numpy", "zmq", "msgspec", "engine.ingest.process"]
#: a gap between two checks of the processes (every 50 ms, client.IngestHub._loop) longer than this (or than a
#: quarter of hang_after_s) is the engine stalled, not its processes silent
_STALL_S = 0.5


def _gpu_streams_possible(ic: Any) -> bool:
    """NVDEC streams may decode in ingest processes here (ingest.gpu_transport shm on a CUDA machine): torch is then
    loaded by the forkserver (importing it makes no CUDA context, so forking after is safe), not by a process's main
    thread at its first such stream, where seconds of imports would hold up its heartbeat past hang_after_s."""
    if ic.gpu_transport != "shm":
        return False
    torch = sys.modules.get("torch")  # the engine's own: a CPU-only engine never imports it for this
    return torch is not None and torch.cuda.is_available()


def resolve_processes(processes: int | str, streams: int, streams_per_process: int, cores: int) -> tuple[int, str]:
    """(the most general ingest processes, the rule said in the start log)."""
    if processes != "auto":
        return int(processes), f"ingest.processes={processes}"
    cap = max(2, cores)  # a process's streams share its GIL: see IngestConfig.processes
    return cap, (f"ingest.processes=auto: up to max(2, usable cores) = {cap} processes, a new one started when "
                 f"every running one holds ingest.streams_per_process={streams_per_process} streams "
                 f"({streams} configured now -> {min(cap, max(1, math.ceil(streams / streams_per_process)))})")


class ProcessManager:
    def __init__(self, cfg: EngineConfig, run: str, run_dir: str, *, cores: int,
                 on_start: Callable[[IngestProcess], None]):
        self.cfg, self._run, self._dir, self._on_start = cfg, run, run_dir, on_start
        ic = cfg.ingest
        self.max_procs, rule = resolve_processes(ic.processes, len(cfg.streams), ic.streams_per_process, cores)
        self._auto = ic.processes == "auto"
        log.info("ingest: decoders run in processes: %s", rule)
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload(_PRELOAD + (["torch"] if _gpu_streams_possible(ic) else []))
        self._ctx = zmq.Context()
        self.procs: dict[int, IngestProcess] = {}
        self._gens: dict[int, int] = {}
        self._last_check = 0.0  # monotonic, the I/O thread's last check (a longer gap: the engine stalled)

    def pick(self, stream: str, isolated: bool) -> IngestProcess:
        """The process for a stream: a new one of its own when quarantined (`isolated`), else the general process
        with the fewest streams, or a new one while there may be more. Raises what `start` raises."""
        if isolated:
            return self.start(dedicated=True)
        general = [p for p in self.procs.values() if not p.dedicated]
        least = min(general, key=lambda p: len(p.streams), default=None)
        spp = self.cfg.ingest.streams_per_process
        if least is not None and (len(general) >= self.max_procs or (self._auto and len(least.streams) < spp)):
            return least
        try:
            return self.start(dedicated=False)
        except Exception as err:  # noqa: BLE001 -- whatever a start raises (see start): a running process will do
            if least is None:
                raise
            log.warning("ingest: cannot start another process (%s: %s): stream %s goes to %s", type(err).__name__,
                        err, stream, least.label)
            return least

    def start(self, dedicated: bool) -> IngestProcess:
        """A new ingest process. Raises when none can be started, and the caller retries the placement later:
        zmq.ZMQError or OSError (out of descriptors), EOFError (the forkserver died: a fork it could not make,
        at a container's pids limit, raises in the forkserver and ends it; multiprocessing starts a new one at the
        next try), AssertionError or RuntimeError (the forkserver's own descriptor checks), and anything else:
        every failure to start is one stream's problem, never the engine's."""
        idx = next(i for i in range(len(self.procs) + 1) if i not in self.procs)
        gen = self._gens[idx] = self._gens.get(idx, -1) + 1
        cmd_addr = f"ipc://{self._dir}/c{idx}-{gen}"
        core_end, theirs = uplink.pair()
        if not self.procs and not self._gens.get(idx):  # once: what a process may queue before it blocks
            log.info("ingest: each process's uplink buffers %d KiB (asked %d; net.core.wmem_max caps it)",
                     theirs.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 1024, uplink.SNDBUF // 1024)
        cmd, handle = None, None
        try:
            # The engine binds nothing here: each ingest process binds its command endpoint and the engine connects.
            # A listener in the engine would accept on every connection, and libzmq's ipc listener aborts the
            # process when accept() fails with EMFILE (src/ipc_listener.cpp:297: a descriptor flood on the control
            # port killed the engine); a connecter that cannot get a descriptor just retries (ipc_connecter.cpp).
            cmd = self._ctx.socket(zmq.PUSH)
            cmd.setsockopt(zmq.SNDHWM, 100_000)
            cmd.setsockopt(zmq.LINGER, 0)
            cmd.setsockopt(zmq.RECONNECT_IVL, 10)  # a new process's endpoint appears within ms of its start
            cmd.connect(cmd_addr)
            ic = self.cfg.ingest
            # forkserver passes `theirs` with the arguments (SCM_RIGHTS): the process's own descriptor
            handle = self._mp.Process(target=_child_main, name=f"ingest-{idx}", daemon=True,
                                      args=(idx, gen, theirs, cmd_addr, ic.heartbeat_s, ic.nice, list(TEST_IMPORTS),
                                            self._run))
            handle.start()
        except BaseException:
            core_end.close()
            if cmd is not None:
                cmd.close(0)
            if handle is not None and handle.pid is not None:  # started, but not ours to supervise: ended here
                handle.kill()
                handle.join(2.0)
            raise
        finally:
            theirs.close()  # the process has its own copy: its death is then the uplink's end of file here
        proc = IngestProcess(idx, gen, handle, cmd, uplink.Reader(core_end), dedicated=dedicated, os_pid=handle.pid)
        proc.open_pidfd()
        proc.up.owner = proc
        self.procs[idx] = proc
        self._on_start(proc)
        log.info("ingest: started %s%s", proc.label, " for one stream (quarantine)" if dedicated else "")
        return proc

    def send(self, proc: IngestProcess, msgs: list) -> None:
        """In order; what cannot go now (not Ready yet, its connection still being made, or it stopped reading)
        waits in `pending`, retried every loop (a process that stopped reading is killed by the hang check)."""
        proc.pending.extend(msgs)
        if proc.ready:
            self.flush(proc)

    def flush(self, proc: IngestProcess) -> None:
        while proc.pending:
            try:
                proc.cmd.send(wire.encode(proc.pending[0]), zmq.NOBLOCK)
            except zmq.Again:
                return
            proc.pending.pop(0)

    def check(self, now: float, drain: Callable[[IngestProcess], None]) -> list[IngestProcess]:
        """Commands flushed, hung processes killed; the processes that have exited (to be reaped).

        A hang is judged on the time the I/O thread was there to read: when the thread itself did not run for a
        while (the engine SIGSTOPped, swapped out, a stop-the-world pause), that time is credited to every process,
        and a process that looks hung has what already waits in its uplink read (`drain`) before it is judged: a
        heartbeat waiting there is not its fault. A stall of the engine is never blamed on a process."""
        ic = self.cfg.ingest
        gap = now - self._last_check if self._last_check else 0.0
        self._last_check = now
        # Only a real stall is credited: a gap far beyond the loop's 50 ms (a busy I/O thread's 100-300 ms gaps
        # are not: crediting those would let a silent process live many times hang_after_s)
        stalled = gap if gap > max(_STALL_S, ic.hang_after_s / 4) else 0.0
        if stalled:
            log.warning("ingest: the engine did not check its processes for %.1f s (stopped or starved): that time "
                        "is not counted against their heartbeats", gap)
        gone = []
        for proc in list(self.procs.values()):
            if stalled:
                proc.last_beat += stalled
                proc.started_at += stalled
            if proc.pidfd is None:
                proc.open_pidfd()  # could not be had at start (out of descriptors): tried again
            if proc.ready and proc.pending:
                self.flush(proc)
            if not proc.alive():
                gone.append(proc)
                continue
            if proc.kill_reason or not proc.hung(now, ic.hang_after_s, ic.start_timeout_s):
                continue
            t_drain = time.monotonic()
            drain(proc)
            why = proc.hung(now + (time.monotonic() - t_drain), ic.hang_after_s, ic.start_timeout_s)
            if why:
                proc.kill_reason = why
                log.error("ingest: %s %s: killing it", proc.label, why)
                proc.kill()
        return gone

    def reap(self, proc: IngestProcess) -> None:
        """An exited process forgotten (its uplink was read to its end by the caller)."""
        self.procs.pop(proc.idx, None)
        proc.cmd.close(0)
        proc.handle.join(0)
        _close_handle(proc)
        proc.forget()

    def tell_exit(self) -> None:
        for proc in list(self.procs.values()):
            if proc.ready:
                self.send(proc, [wire.Exit()])

    def any_alive(self) -> bool:
        return any(p.alive() for p in self.procs.values())

    def close(self, t_end: float) -> None:
        """Every process joined until `t_end` (told to exit before: tell_exit), killed past it; sockets closed."""
        for proc in list(self.procs.values()):
            if not proc.wait(max(0.1, t_end - time.monotonic())):
                log.warning("ingest: %s did not exit in time: killed", proc.label)
                proc.kill()
                proc.wait(2.0)
            proc.handle.join(0.1)
            proc.cmd.close(0)
            proc.forget()  # its handle stays open: its exit code is still read (Process.close forbids that)
        self.procs.clear()
        self._ctx.term()

    def pids(self) -> dict[int, int]:
        return {p.idx: p.handle.pid for p in list(self.procs.values())}

    def cuda_contexts(self) -> int:
        """How many of the processes said they made a CUDA context (IngestProcess.cuda)."""
        return sum(1 for p in list(self.procs.values()) if p.cuda)

    def describe(self) -> list[dict]:
        return [{"process": p.label, "streams": sorted(p.streams), "dedicated": p.dedicated,
                 "cuda_context": p.cuda}
                for p in list(self.procs.values())]


def _close_handle(proc: IngestProcess) -> None:
    """multiprocessing's handle lets go of its two pipes to the forkserver now, not at the next full garbage
    collection (a dead process and its uplink's reader refer to each other: the soak saw 2 pipes a death pile
    up for 25 minutes); the reader's back-reference goes too."""
    proc.up.owner = None
    try:
        proc.handle.close()
    except ValueError:  # still running (a kill that has not landed yet): its pipes go with the collection
        pass


def _child_main(*args) -> None:
    from engine.ingest.process import main
    main(*args)
