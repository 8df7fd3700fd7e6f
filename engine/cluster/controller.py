"""The controller: one detached, named, restartable Ray actor that holds the desired state (every
stream's config and SAM 2 prompts) and the assignment stream -> engine, and reconciles them with
what the engines report.

The desired state lives in Ray's internal KV (kept by the GCS), so a controller that Ray restarts
re-reads it, re-finds the engines (named, detached actors) and goes on; nothing is re-placed that
still runs. Every `heartbeat_s` the controller asks each engine for its report; an engine Ray reports
dead is fenced at once, one that misses `heartbeat_misses` reports in a row is fenced then: killed
(`ray.kill`), so an engine that was only frozen can never wake up and publish duplicates. Its
streams are placed on the other engines with their SAM 2 objects re-added from their prompts, each
announced by a `relocated` event on the stream's topic. What a relocation loses is counted: the
frames the dead engine held at its last report (`in_flight`), the SAM 2 memory banks of its objects,
the decoder session. Frames it decoded after its last report are seen by nobody (at most one
heartbeat's worth per stream); the README says so.

A stream no engine has room for is kept in the desired state as pending (an `error` event says why)
and tried again at every heartbeat, as the reports show the engines' load change; when it is placed a
`started` event names the engine. A stream is costed at its rate (rates.py): declared by its URL or
its file's container, else the `cluster.stream_fps` estimate until the reports have measured it.

Requests (`control`) run on the actor's threads and take the same lock as the loop: one owner.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from streams import redact_url

from engine.config import ClusterConfig, StreamConfig, build_config
from engine.cluster.placement import EngineLoad, choose, engines_that_fit, fits_idle, measured_streams, place
from engine.cluster.rates import ESTIMATE, IngestRates, cost_fps, declared_fps

log = logging.getLogger("vidar.cluster")

CONTROLLER = "vidar-controller"
CALL_S = 20.0   # an engine call the controller waits for (add_stream opens the source, re-adds prompts)
SETTLE_MAX_S = 30.0  # a placed stream's estimated cost counts until a report measures it, at most this long
ODD_REPORTS = 4  # reports in a row that disagree with the assignment before the controller acts on it
PAST_KEPT = 8    # incarnations' last counts kept per stream
REFUSED_MAX_S = 30.0  # a stream an engine refused (not for room) is tried again at most this far apart
RATE_MIN_REPORTS = 4    # a stream's ingest rate is measured over at least this many heartbeats...
RATE_WINDOW_REPORTS = 20  # ...and at most this many (a source that changes its rate is followed)


@dataclass
class _Engine:
    name: str
    handle: Any
    info: dict
    load: EngineLoad
    misses: int = 0
    report: dict = field(default_factory=dict)
    relocated_in: int = 0


class Controller:
    def __init__(self, tree: dict):
        self.tree = tree
        self.cfg, _ = build_config(copy.deepcopy(tree))
        self.cc: ClusterConfig = self.cfg.cluster or ClusterConfig()
        self._lock = threading.RLock()
        self._key = f"vidar/{self.cc.namespace}/state".encode()
        self.state = self._load() or {"streams": {}, "objects": {}, "assign": {}, "relocations": {}, "lost": {},
                                      "past": {}}
        self.state.setdefault("rates", {})  # stream -> [declared fps, where from] (rates.py), kept across restarts
        self.engines: dict[str, _Engine] = {}
        self.starting: dict[str, tuple[Any, Any, str]] = {}  # name -> (handle, info ref, node id)
        self.pending: dict[str, str] = {}                    # engines that cannot start, and why
        self.unplaced: dict[str, str] = {}                   # streams waiting for an engine, and why
        self.unplaced_since: dict[str, float] = {}           # ... since when (monotonic)
        self.refused_backoff: dict[str, tuple[float, float]] = {}  # sid -> (next try, pause): refused by an engine
        hb = self.cc.heartbeat_s
        self.rates = IngestRates(min_span_s=RATE_MIN_REPORTS * hb, window_s=RATE_WINDOW_REPORTS * hb)
        self.moving: dict[str, str] = {}                     # streams whose engine was lost, and why
        self._odd: Counter = Counter()                       # (engine, stream) reports that disagree in a row
        self.draining: set[str] = set(self.state.get("draining", []))  # node ids (kept across restarts)
        self._stop = threading.Event()
        self._adopt()
        self._thread = threading.Thread(target=self._loop, name="controller", daemon=True)
        self._thread.start()

    # -- state in Ray's KV -------------------------------------------------------------------------
    def _load(self) -> Optional[dict]:
        from ray.experimental.internal_kv import _internal_kv_get
        raw = _internal_kv_get(self._key)
        return json.loads(raw) if raw else None

    def _save(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_put
        _internal_kv_put(self._key, json.dumps(self.state).encode(), overwrite=True)

    # -- engines -------------------------------------------------------------------------------------
    def _engine_names(self, node_id: str) -> list[str]:
        return [f"vidar-engine-{node_id[:12]}-{k}" for k in range(self.cc.engines_per_node)]

    def _adopt(self) -> None:
        """After a restart: the engines that still run are found by name and kept."""
        import ray
        for node in self._gpu_nodes():
            for name in self._engine_names(node["NodeID"]):
                self._find(name, node["NodeID"])

    def _find(self, name: str, node_id: str) -> bool:
        """An engine of this name that runs already (a restarted controller's, or one still loading its
        models) is waited for like one this controller started, never started twice."""
        import ray
        try:
            handle = ray.get_actor(name, namespace=self.cc.namespace)
        except ValueError:
            return False
        self.starting[name] = (handle, handle.info.remote(), node_id)
        self.pending[name] = f"found on node {node_id[:12]}, waiting for its report"
        return True

    def _gpu_nodes(self) -> list[dict]:
        import ray
        return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= self.cc.engine_gpus]

    def _add_engine(self, name: str, handle, info: dict, node: dict) -> None:
        labels = dict(node.get("Labels") or {})
        self.engines[name] = _Engine(name, handle, info, EngineLoad(name, node["NodeID"], labels,
                                                                    draining=node["NodeID"] in self.draining))
        self.pending.pop(name, None)
        log.info("engine %s up on node %s (%s), results on %s", name, node["NodeID"][:12], info["node_ip"],
                 info["publish"])

    def _ensure_engines(self, nodes: list[dict]) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from engine.cluster.engine_actor import NORMAL_PRIORITY, EngineActor
        remote = ray.remote(EngineActor)
        for node in nodes:
            names = self._engine_names(node["NodeID"])
            fit, why = engines_that_fit(node.get("Resources", {}), per_node=len(names), gpus=self.cc.engine_gpus,
                                        cpus=self.cc.engine_cpus)
            for name in names[fit:]:  # Ray would keep them pending for ever, with no error
                if name not in self.engines and name not in self.starting:
                    self.pending[name] = f"not started: {why}"
            for name in names[:fit]:
                if name in self.engines or name in self.starting or self._find(name, node["NodeID"]):
                    continue
                try:
                    handle = remote.options(
                        name=name, namespace=self.cc.namespace, lifetime="detached", max_restarts=0,
                        num_gpus=self.cc.engine_gpus, num_cpus=self.cc.engine_cpus, max_concurrency=4,
                        runtime_env=NORMAL_PRIORITY,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                    ).remote(self.tree, name)
                except Exception as err:  # e.g. the name was taken between the lookup and here
                    self.pending[name] = f"cannot start: {type(err).__name__}: {str(err)[:200]}"
                    continue
                self.starting[name] = (handle, handle.info.remote(), node["NodeID"])
                self.pending[name] = f"starting on node {node['NodeID'][:12]}"
        for name, (handle, ref, node_id) in list(self.starting.items()):
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            if node_id not in {n["NodeID"] for n in nodes}:  # its node died while it started
                del self.starting[name]
                continue
            del self.starting[name]
            try:
                info = ray.get(ref)
            except Exception as err:  # the engine could not start (bad weights, no GPU...): say why
                self.pending[name] = f"failed to start: {type(err).__name__}: {str(err)[:300]}"
                log.error("engine %s: %s", name, self.pending[name])
                continue
            node = next((n for n in nodes if n["NodeID"] == node_id), {"NodeID": node_id})
            self._add_engine(name, handle, info, node)

    # -- the loop ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with self._lock:
                    self._tick()
            except Exception:
                log.exception("controller: reconcile step failed")
            self._stop.wait(max(0.0, self.cc.heartbeat_s - (time.monotonic() - t0)))

    def _tick(self) -> None:
        import ray
        nodes = self._gpu_nodes()
        alive = {n["NodeID"] for n in nodes}
        for e in list(self.engines.values()):
            if e.load.node_id not in alive:
                self._fence(e, f"node {e.load.node_id[:12]} died")
        self._ensure_engines(nodes)
        refs = {e.handle.report.remote(): e for e in self.engines.values()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.cc.heartbeat_s) if refs else ([], [])
        for ref, e in refs.items():
            if ref in done:
                try:
                    rep = ray.get(ref)
                except Exception as err:  # Ray says the actor is gone
                    self._fence(e, f"engine died ({type(err).__name__})")
                    continue
                if "dead" in rep:
                    self._fence(e, f"engine dead: {rep['dead']}")
                    continue
                measured = measured_streams(e.report, rep)
                e.misses, e.report = 0, rep
                self.rates.update(e.name, rep, time.monotonic())
                self._reconcile(e)
                e.load.busy, e.load.frame_s = rep["busy"], rep["frame_s"]
                e.load.drop_share = rep["drop_share"]
                e.load.settle(time.monotonic(), running=set(rep["streams"]), measured=measured, max_s=SETTLE_MAX_S)
            else:
                e.misses += 1
                if e.misses >= self.cc.heartbeat_misses:
                    self._fence(e, f"no heartbeat for {e.misses * self.cc.heartbeat_s:g} s")
        self._place_unassigned()

    def _reconcile(self, e: _Engine) -> None:
        """What the engine runs against what it was given: a stream it runs but was not given (a start the
        controller gave up waiting for, then placed elsewhere) is removed there; a stream it was given
        but does not run (lost in a crash between two steps) is placed again. Both after a few reports,
        so a start or a removal in progress is not taken for either."""
        running = set(e.report.get("streams", {}))
        given = {s for s, n in self.state["assign"].items() if n == e.name}
        for sid in running - given:
            self._odd[(e.name, sid)] += 1
            if self._odd[(e.name, sid)] >= ODD_REPORTS:
                log.warning("engine %s runs stream %s it was not given: removing it there", e.name, sid)
                e.handle.control.remote({"op": "remove_stream", "stream": sid, "reason": "relocated: duplicate"})
                del self._odd[(e.name, sid)]
        for sid in given - running:
            self._odd[(e.name, sid)] += 1
            if self._odd[(e.name, sid)] >= ODD_REPORTS:
                log.warning("engine %s does not run stream %s it was given: placing it again", e.name, sid)
                self.state["assign"][sid] = None
                self.moving[sid] = f"engine {e.name} no longer ran it"
                del self._odd[(e.name, sid)]
        for key in [k for k in self._odd if k[0] == e.name and (k[1] in running) == (k[1] in given)]:
            del self._odd[key]

    def _fence(self, e: _Engine, why: str) -> None:
        import ray
        log.warning("fencing engine %s: %s", e.name, why)
        try:
            ray.kill(e.handle, no_restart=True)
        except Exception:  # already gone
            pass
        self.engines.pop(e.name, None)
        for sid, name in list(self.state["assign"].items()):
            if name != e.name:
                continue
            last = e.report.get("streams", {}).get(sid, {})
            lost = Counter(self.state["lost"].get(sid, {}))
            lost["in_flight"] += sum(c["in_flight"] for c in last.get("counts", {}).values())
            lost["sam2_banks"] += len(self.state["objects"].get(sid, {}))
            lost["decoder_sessions"] += 1
            self.state["lost"][sid] = dict(lost)
            self._past(sid, last.get("counts", {}))
            self.state["relocations"][sid] = self.state["relocations"].get(sid, 0) + 1
            self.state["assign"][sid] = None
            self.moving[sid] = f"engine {e.name} on node {e.load.node_id[:12]}: {why}"
        self._save()

    def _past(self, sid: str, counts: dict) -> None:
        past = self.state["past"].setdefault(sid, [])
        past.append(counts)
        del past[:-PAST_KEPT]

    def _place_unassigned(self) -> None:
        """Every stream without an engine (pending, or its engine lost) is tried again: at every heartbeat,
        so a stream waiting for room is placed at the first report that shows some."""
        for sid, scfg in self.state["streams"].items():
            name = self.state["assign"].get(sid)
            if name in self.engines or name in self.starting:  # running, or its engine is being found again
                continue
            now = time.monotonic()
            t_next, pause = self.refused_backoff.get(sid, (0.0, 0.0))
            if now < t_next:  # an engine refused it (not for room): tried again with backoff, not every beat
                continue
            since = self.unplaced_since.get(sid)
            placed = None if sid in self.moving or since is None else f"after {now - since:.1f} s pending"
            err = self._start_on(sid, scfg, exclude=set(), relocated=self.moving.get(sid), placed=placed)
            if err:
                self._wait_for_room(sid, err.why)
                if not err.retry:  # each try may cost a call of up to CALL_S under the lock
                    pause = min(REFUSED_MAX_S, max(2 * self.cc.heartbeat_s, 2 * pause))
                    self.refused_backoff[sid] = (time.monotonic() + pause, pause)
            else:
                self.refused_backoff.pop(sid, None)
                self._placed(sid)

    def _wait_for_room(self, sid: str, why: str) -> None:
        """The stream waits (pending) for an engine; said once, when it starts waiting (the reason's numbers
        change at every try): logged, in `list`, and as an `error` event on its topic."""
        self.unplaced[sid] = why
        if sid in self.unplaced_since:
            return
        self.unplaced_since[sid] = time.monotonic()
        log.warning("stream %s pending: %s", sid, why)
        self._event(sid, "pending", f"{why}; it starts as soon as an engine has room")

    def _placed(self, sid: str) -> None:
        self.unplaced.pop(sid, None)
        self.unplaced_since.pop(sid, None)
        self.refused_backoff.pop(sid, None)
        self.moving.pop(sid, None)

    def _event(self, sid: str, kind: str, reason: str) -> None:
        """An event for a stream that runs nowhere, through any engine's publisher (the head's proxy
        follows them all); none runs: only logged. Not waited for."""
        for e in sorted(self.engines.values(), key=lambda e: e.name):
            e.handle.event.remote(sid, kind, reason)
            return
        log.info("stream %s: no engine runs to publish its %s event", sid, kind)

    def _fps(self, sid: str, scfg: dict) -> tuple[float, str]:
        """(the rate a stream is costed at, where it came from): its declared rate (URL, container), or
        the estimate until the reports have measured it, then the measurement."""
        declared = tuple(self.state["rates"].get(sid) or declared_fps(scfg["url"], self.cc.stream_fps, probe=False))
        measured = self.rates.fps.get(sid)
        fps = cost_fps(declared, measured)
        return fps, ("measured" if declared[1] == ESTIMATE and measured is not None else declared[1])

    def _start_on(self, sid: str, scfg: dict, *, exclude: set[str], relocated: Optional[str],
                  target: Optional[_Engine] = None, placed: Optional[str] = None) -> Optional[_NotPlaced]:
        """Place and start one stream; None, or why it could not be."""
        import ray
        pools = scfg.get("pools") or list(self.cfg.models.configured())
        fps, fps_from = self._fps(sid, scfg)
        if target is None:
            loads = [e.load for e in self.engines.values() if e.name not in exclude]
            offline, pin = scfg.get("mode") == "offline", self.cc.pin.get(sid)
            chosen, why = choose(loads, stream=sid, pools=pools, fps=fps, max_load=self.cc.max_load,
                                 pin=pin, offline=offline, fps_from=fps_from)
            if chosen is None:
                return _NotPlaced(why, offline or fits_idle(loads, pools=pools, fps=fps, max_load=self.cc.max_load,
                                                            pin=pin))
            target = self.engines[chosen.name]
        objects = list(self.state["objects"].get(sid, {}).values())
        try:
            reply = ray.get(target.handle.add_stream.remote(scfg, objects, relocated, placed), timeout=CALL_S)
        except Exception as err:
            return _NotPlaced(f"engine {target.name} did not take stream {sid!r}: {type(err).__name__}", False)
        if not reply["ok"]:
            return _NotPlaced(reply["error"], False)
        place(target.load, pools, fps, time.monotonic(), sid)
        if relocated:
            target.relocated_in += 1
        self.state["assign"][sid] = target.name
        self._save()
        return None

    # -- requests ----------------------------------------------------------------------------------------
    def control(self, req: dict) -> dict:
        """The control socket's ops plus list_engines, move_stream, drain_node; never raises."""
        op = req.get("op") if isinstance(req, dict) else None
        try:
            # outside the lock: reading a file's rate opens it (bounded by rates.PROBE_S), and the
            # heartbeats must not wait for that
            rate = self._declared(req) if op == "add_stream" else None
            with self._lock:
                return self._handle(op, req, rate)
        except _Refused as err:
            return {"ok": False, "error": str(err)}
        except Exception as err:  # a bug must not take the controller down
            log.exception("controller: %s failed", op)
            return {"ok": False, "error": f"internal error: {type(err).__name__}: {redact_url(str(err))}"}

    def _declared(self, req: dict) -> Optional[tuple[float, str]]:
        """A valid stream's declared rate; nothing is read for a request the add would refuse (a URL
        FFmpeg would read as a protocol is never opened here)."""
        try:
            url = StreamConfig.model_validate(req.get("stream")).url
        except Exception:  # refused with its reason by _add_stream
            return None
        return declared_fps(url, self.cc.stream_fps)

    def _handle(self, op, req: dict, rate: Optional[tuple[float, str]] = None) -> dict:
        handlers = {"list": self._list, "list_engines": self._list_engines,
                    "add_stream": lambda r: self._add_stream(r, rate),
                    "remove_stream": self._remove_stream, "move_stream": self._move_stream,
                    "drain_node": self._drain_node, "add_object": self._object_op,
                    "remove_object": self._object_op, "reset_stream": self._object_op}
        if op not in handlers:
            raise _Refused(f"unknown op {op!r}; allowed: {sorted(handlers)}")
        return handlers[op](req)

    def _stream(self, req: dict) -> str:
        sid = req.get("stream")
        if not isinstance(sid, str) or sid not in self.state["streams"]:
            raise _Refused(f"{req.get('op')}: unknown stream {sid!r}; streams: {sorted(self.state['streams'])}")
        return sid

    def _engine_of(self, sid: str) -> _Engine:
        e = self.engines.get(self.state["assign"].get(sid) or "")
        if e is None:
            raise _Refused(f"stream {sid!r} is not running on any engine now ({self.unplaced.get(sid, 'moving')}); "
                           "try again")
        return e

    def _add_stream(self, req: dict, rate: Optional[tuple[float, str]]) -> dict:
        """Placed now, or kept pending when no engine has room now (`pending`: why; placed at a later
        heartbeat). Refused: a stream that would not fit even an idle engine, or that the engine refused."""
        try:
            scfg = StreamConfig.model_validate(req.get("stream"))
        except ValidationError as err:
            e = err.errors()[0]
            raise _Refused(f"add_stream: stream.{'.'.join(map(str, e['loc']))}: {e['msg']}") from None
        if scfg.id in self.state["streams"]:
            raise _Refused(f"add_stream: stream id {scfg.id!r} is already running; remove it first")
        tree = scfg.model_dump(exclude_none=True)
        self.rates.forget(scfg.id)  # a measurement of an earlier stream of this id is not this one's
        self.state["rates"][scfg.id] = list(rate or declared_fps(scfg.url, self.cc.stream_fps, probe=False))
        err = self._start_on(scfg.id, tree, exclude=set(), relocated=None)
        if err and not err.retry:
            self.state["rates"].pop(scfg.id, None)
            raise _Refused(f"add_stream: {err.why.removeprefix('add_stream: ')}")  # the engine's reply says it already
        self.state["streams"][scfg.id] = tree
        self._save()
        if err:
            self._wait_for_room(scfg.id, err.why)
            return {"ok": True, "stream": scfg.id, "engine": None, "pending": err.why}
        return {"ok": True, "stream": scfg.id, "engine": self.state["assign"][scfg.id]}

    def _remove_stream(self, req: dict) -> dict:
        import ray
        sid = self._stream(req)
        e = self.engines.get(self.state["assign"].get(sid) or "")
        if e is not None:
            ray.get(e.handle.control.remote({"op": "remove_stream", "stream": sid}), timeout=CALL_S)
        for k in ("streams", "objects", "assign", "relocations", "lost", "past", "rates"):
            self.state[k].pop(sid, None)
        self._placed(sid)
        self.rates.forget(sid)
        self._save()
        return {"ok": True}

    def _object_op(self, req: dict) -> dict:
        import ray
        sid = self._stream(req)
        reply = ray.get(self._engine_of(sid).handle.control.remote(dict(req)), timeout=CALL_S)
        if reply["ok"]:  # the prompt is kept only once the engine took it
            objs = self.state["objects"].setdefault(sid, {})
            if req["op"] == "add_object":
                objs[str(req["id"])] = {k: req[k] for k in ("id", "box", "points") if k in req}
            elif req["op"] == "remove_object":
                objs.pop(str(req.get("id")), None)
            else:
                objs.clear()
            self._save()
        return reply

    def _move_stream(self, req: dict) -> dict:
        sid = self._stream(req)
        to = req.get("engine")
        if to is not None and to not in self.engines:
            raise _Refused(f"move_stream: unknown engine {to!r}; engines: {sorted(self.engines)}")
        src = self.state["assign"].get(sid)
        err = self._relocate(sid, to=to, why=req.get("reason", "moved by request"))
        if err:
            raise _Refused(f"move_stream: {err}")
        return {"ok": True, "stream": sid, "from": src, "engine": self.state["assign"][sid]}

    def _relocate(self, sid: str, *, to: Optional[str], why: str) -> Optional[str]:
        """Stop the stream where it runs, start it elsewhere (with its objects). On failure it stays."""
        import ray
        src = self.engines.get(self.state["assign"].get(sid) or "")
        exclude = {src.name} if src else set()
        scfg = self.state["streams"][sid]
        pools = scfg.get("pools") or list(self.cfg.models.configured())
        if to is None:
            loads = [e.load for e in self.engines.values() if e.name not in exclude]
            fps, fps_from = self._fps(sid, scfg)
            chosen, reason = choose(loads, stream=sid, pools=pools, fps=fps, max_load=self.cc.max_load,
                                    pin=self.cc.pin.get(sid), offline=scfg.get("mode") == "offline", fps_from=fps_from)
            if chosen is None:
                return reason
            to = chosen.name
        if src is not None:  # the old one first: one stream, one decoder, one publisher at a time
            self.state["assign"][sid] = None  # saved first: a crash from here on re-places it, never loses it
            self.moving[sid] = why
            self._save()
            ray.get(src.handle.control.remote({"op": "remove_stream", "stream": sid, "reason": f"relocated: {why}"}),
                    timeout=CALL_S)
            last = src.report.get("streams", {}).get(sid, {})
            self._past(sid, last.get("counts", {}))
        self.state["relocations"][sid] = self.state["relocations"].get(sid, 0) + 1
        err = self._start_on(sid, scfg, exclude=set(), relocated=why, target=self.engines[to])
        if err:
            self._wait_for_room(sid, err.why)
            return err.why
        self._placed(sid)
        return None

    def _drain_node(self, req: dict) -> dict:
        node = req.get("node")
        matches = {e.load.node_id for e in self.engines.values() if isinstance(node, str) and e.load.node_id.startswith(node)}
        if len(matches) != 1:
            raise _Refused(f"drain_node: node {node!r} matches {len(matches)} nodes with engines; nodes: "
                           f"{sorted({e.load.node_id for e in self.engines.values()})}")
        node_id = matches.pop()
        self.draining.add(node_id)
        self.state["draining"] = sorted(self.draining)
        self._save()
        for e in self.engines.values():
            e.load.draining = e.load.node_id in self.draining
        moved, stuck = [], {}
        for sid, name in list(self.state["assign"].items()):
            if name in self.engines and self.engines[name].load.node_id == node_id:
                err = self._relocate(sid, to=None, why=f"node {node_id[:12]} drained")
                (stuck.__setitem__(sid, err) if err else moved.append(sid))
        return {"ok": not stuck, "moved": moved, **({"error": f"not moved: {stuck}"} if stuck else {})}

    def _list(self, req: dict) -> dict:
        out = {}
        for sid, scfg in self.state["streams"].items():
            name = self.state["assign"].get(sid)
            e = self.engines.get(name or "")
            rep = e.report.get("streams", {}).get(sid, {}) if e else {}
            waiting = "pending" if sid in self.unplaced and sid not in self.moving else "moving"
            fps, fps_from = self._fps(sid, scfg)
            out[sid] = {"url": redact_url(scfg["url"]), "mode": scfg.get("mode", "live"), "engine": name,
                        "node": e.load.node_id if e else None, "state": rep.get("state", waiting if name is None else "starting"),
                        "fps": round(fps, 2), "fps_from": fps_from,
                        "counts": rep.get("counts", {}), "objects": sorted(int(i) for i in self.state["objects"].get(sid, {})),
                        "relocations": self.state["relocations"].get(sid, 0), "lost": self.state["lost"].get(sid, {}),
                        "past": self.state["past"].get(sid, [])}
            if sid in self.unplaced and name is None:
                out[sid]["waiting"] = self.unplaced[sid]
        return {"ok": True, "streams": out}

    def _list_engines(self, req: dict) -> dict:
        engines = {}
        for e in self.engines.values():
            streams = sorted(s for s, n in self.state["assign"].items() if n == e.name)
            p99 = [c["p99_ms"] for s in e.report.get("streams", {}).values() for c in s["counts"].values()
                   if c.get("p99_ms") is not None]
            engines[e.name] = {"node_id": e.load.node_id, "node_ip": e.info["node_ip"], "gpus": e.info["gpus"],
                               "publish": e.info["publish"], "metrics_port": e.info["metrics_port"], "pid": e.info["pid"],
                               "streams": streams, "busy": e.load.busy, "drop_share": e.load.drop_share,
                               "slack": round(1 - max([e.load.load(p) for p in e.load.busy] or [0.0]), 3),
                               "p99_ms": max(p99) if p99 else None, "relocated_in": e.relocated_in,
                               "draining": e.load.draining, "labels": e.load.labels}
        return {"ok": True, "engines": engines, "pending": dict(self.pending)}

    def shutdown(self) -> None:
        """Stop every engine and forget the desired state (`cluster run` ending, `cluster down`)."""
        import ray
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for e in list(self.engines.values()) + [_Engine(n, h, {}, EngineLoad(n, "")) for n, (h, _, _) in self.starting.items()]:
                try:
                    ray.get(e.handle.stop.remote(), timeout=CALL_S)
                except Exception:
                    pass
                try:
                    ray.kill(e.handle, no_restart=True)
                except Exception:
                    pass
            self.engines.clear()
            self.starting.clear()
            from ray.experimental.internal_kv import _internal_kv_del
            _internal_kv_del(self._key)

    def ping(self) -> int:
        """This controller's process id (a restart changes it)."""
        import os
        return os.getpid()

    def node(self) -> str:
        """The Ray node this controller runs on."""
        import ray
        return ray.get_runtime_context().get_node_id()


class _Refused(Exception):
    """A request refused with a reason (becomes {"ok": false, "error": ...})."""


@dataclass
class _NotPlaced:
    """Why a stream was not started. `retry`: no engine has room for it now but one could (it waits,
    pending); else it would not fit even an idle engine, or the engine refused it."""

    why: str
    retry: bool
