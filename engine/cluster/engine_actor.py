"""One engine per GPU as a Ray actor: today's `Engine`, started with no streams, publishing on its node.

Frames never cross Ray: the engine decodes its own streams. Its publisher binds the node's address
on a port the OS chooses (reported by `info`), as does its metrics endpoint. The controller drives
it with `add_stream` / `control` and reads its `report` every heartbeat.
"""

from __future__ import annotations

import copy
import multiprocessing.util
import os
import shutil
import time
from typing import Optional

from engine.config import EngineConfig, build_config
from engine.core.engine import Engine
from engine.frames.lifecycle import DropReason
from engine.sched.qos import LOAD_DROPS


OBJECT_S = 3.0  # per SAM 2 prompt re-added (the controller waits CALL_S for the whole start)
FRAMES_TO_MEASURE = 20  # frames run between two measurements of a pool's cost per frame
# Ray starts every worker process at niceness 15 (so that its own daemons stay responsive), which leaves
# a real-time engine ~3 % of a core beside any process at the default niceness 0: measured, two busy
# processes on a 2-core node kept both engines loading their models for over 6 minutes. Vidar's actors
# (the engines and the controller, whose heartbeats judge them) run at the raylet's own priority instead:
# Ray reads this variable when a worker process starts and adds it to the niceness it inherited (its
# job supervisor sets it the same way). Actors a controller starts inherit its runtime_env; the engines
# name it too, for a controller started by an older vidar.
NORMAL_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}


def engine_config(tree: dict, node_ip: str) -> EngineConfig:
    """The user's config for one engine: no streams or objects (the controller places them), no
    control socket or view (the head has them), publisher and metrics on this node, OS-chosen ports.
    model_copy skips the check that refuses an engine with no streams and no control socket."""
    cfg, applied = build_config(copy.deepcopy(tree))  # on_cpu applies per node: this node has a GPU or not
    publish = cfg.publish.model_copy(update={"endpoint": f"tcp://{node_ip}:*", "min_subscribers": 0})
    metrics = cfg.metrics.model_copy(update={"host": node_ip, "port": 0})
    return cfg.model_copy(update={
        "streams": [], "objects": [], "publish": publish, "metrics": metrics, "cluster": None,
        "control": cfg.control.model_copy(update={"enabled": False}),
        "view": cfg.view.model_copy(update={"enabled": False})})


class EngineActor:
    def __init__(self, tree: dict, name: str):
        import ray

        ctx = ray.get_runtime_context()
        self.name, self.node_id = name, ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        # keep_ended: the controller reconciles against this engine's streams; one forgotten after it ended
        # would be taken for a lost stream and placed again
        self.engine = Engine(engine_config(tree, self.node_ip), keep_ended=True)
        self.engine.start()
        self._last: dict[str, tuple] = {}
        self._cost: dict[str, tuple] = {}  # pool -> (busy s, frames run, cost per frame) at the last measurement
        self._ran: dict[str, int] = {}     # pool -> frames run at the last report
        self.started = time.time()

    def info(self) -> dict:
        import ray
        m = self.engine.metrics
        return {"name": self.name, "node_id": self.node_id, "node_ip": self.node_ip, "pid": os.getpid(),
                "publish": self.engine.publisher.endpoint, "metrics_port": m.port if m else None,
                "gpus": [str(g) for g in ray.get_gpu_ids()], "started": self.started}

    def report(self) -> dict:
        """What the controller needs each heartbeat: streams with their counts, and load per pool; `t`
        (this process's monotonic clock, when the counts were read) times the streams' ingest rates."""
        eng = self.engine
        if eng.check_dead():
            return {"dead": eng.dead_reason}
        t, streams = time.monotonic(), {}
        described = eng.describe()
        for sid, d in described.items():
            counts = {}
            for name in d["pools"]:
                s = eng.pools[name].acct.snapshot(sid)
                counts[name] = {"ingested": s.ingested, "published": s.published, "dropped": s.dropped,
                                "failed": s.failed, "in_flight": s.in_flight, "p99_ms": _num(s.p99_ms)}
            streams[sid] = {"state": d["state"], "counts": counts, "objects": d.get("objects", [])}
        busy, frame_s, drop_share = {}, {}, {}
        for name, pool in eng.pools.items():
            b, cap = pool.qos.busy()
            b0, cap0 = self._last.get(name, (0.0, 0.0))
            self._last[name] = (b, cap)
            busy[name] = (b - b0) / (cap - cap0) if cap > cap0 else 0.0
            frame_s[name] = self._frame_s(name, pool, b)
            ing, dropped = pool.acct.totals(list(pool.acct.streams()))
            offered, d = ing - dropped[DropReason.INTERVAL.value], sum(dropped[r.value] for r in LOAD_DROPS)
            o0, d0 = self._last.get(name + "/drops", (0, 0))
            self._last[name + "/drops"] = (offered, d)
            # a removed stream's counters go with it: a negative difference is no interval to judge
            drop_share[name] = (d - d0) / (offered - o0) if offered - o0 > 0 and d >= d0 else 0.0
        return {"streams": streams, "busy": busy, "frame_s": frame_s, "drop_share": drop_share, "t": t}

    def _frame_s(self, name: str, pool, busy_s: float) -> float:
        """A pool's cost per frame in busy-share units (seconds of its busier stage per frame / workers):
        what it spent per frame over its last FRAMES_TO_MEASURE frames or more, at the batch sizes its
        streams make, never above the mean batch-1 time the scheduler measured (a hung batch's seconds
        would otherwise price every stream out for a while). Before any, and again once the pool ran
        nothing for a report (its streams left: a lone new stream runs at batch 1), that batch-1 time
        itself (the mean, not the scheduler's deadline estimate, a high quantile that read 60 ms for a
        50 ms frame: a fresh engine refused a third stream that fit until its reports showed the load)."""
        workers = max(1, len(pool.slots.models))
        b1 = pool.scheduler.latency.mean(1) / workers
        n = pool.slots.frames_run
        b0, n0, est = self._cost.get(name, (0.0, 0, None))
        if n == self._ran.get(name, -1):  # quiet since the last report
            b0, n0, est = busy_s, n, None
        elif n - n0 >= FRAMES_TO_MEASURE and busy_s > b0:
            b0, n0, est = busy_s, n, (busy_s - b0) / (n - n0) / workers
        self._cost[name], self._ran[name] = (b0, n0, est), n
        return b1 if est is None else min(est, b1) if b1 > 0 else est

    def add_stream(self, scfg: dict, objects: list[dict], relocated: Optional[str] = None,
                   placed: Optional[str] = None) -> dict:
        """Start a stream (and re-add its SAM 2 objects from their prompts); `relocated`: why it moved
        here (published as its `relocated` event as soon as it runs); `placed`: how long it waited for
        room (pending), published as a `started` event naming this engine."""
        eng = self.engine
        reply = eng.control({"op": "add_stream", "stream": scfg})
        if not reply["ok"]:
            return reply
        if relocated:  # right after the start: the stream's first frame is still being decoded
            eng.publisher.submit_event(scfg["id"], "relocated", relocated)
        elif placed:
            eng.publisher.submit_event(scfg["id"], "started", f"placed on engine {self.name} {placed}")
        failed = []
        for o in objects:
            r = eng.control({"op": "add_object", "stream": scfg["id"], **o}, timeout=OBJECT_S)
            if not r["ok"]:
                failed.append(f"object {o.get('id')}: {r['error']}")
        return {"ok": True, "stream": scfg["id"], **({"object_errors": failed} if failed else {})}

    def control(self, req: dict) -> dict:
        return self.engine.control(req)

    def event(self, stream: str, kind: str, reason: str) -> None:
        """Publish an event for a stream that runs nowhere (one the controller keeps pending): any engine's
        publisher reaches the head's results proxy."""
        eng = self.engine

        def sent() -> None:  # the outbox the event opened goes with it, unless the stream came here meanwhile
            if stream not in eng.live_streams():
                eng.publisher.forget(stream)
        eng.publisher.submit_event(stream, kind, reason, on_sent=sent)

    def stop(self) -> None:
        """The engine stopped; the controller kills the actor next (ray.kill: this process's exit handlers never
        run), so the folder multiprocessing made here for the ingest processes' forkserver (pymp-*) is removed now,
        as those handlers would have (one left in /tmp per engine stopped, before)."""
        self.engine.stop(drain=False)
        shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)


def _num(x: float) -> Optional[float]:
    return None if x != x else round(x, 2)
