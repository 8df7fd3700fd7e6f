"""Where a stream goes: the engine with the most slack that can take its estimated cost. Pure (no Ray),
so it is tested with tables.

An engine's load is what it measured over its last report interval: per pool, the busy share of its
workers, raised by the share of frames it dropped for load (a pool that drops is saturated beyond
what busy time shows), plus the estimated cost of the streams placed on it that no report has
measured yet (see `settle`). A stream costs, in each pool it feeds, its frame rate x the pool's cost
per frame as the engine measures it (`EngineActor._frame_s`: its busier stage's seconds per frame /
worker instances); the rate is the one `rates.py` gives (URL, container, measured, else the estimate).
The engine must stay under `max_load` in every pool after the addition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class EngineLoad:
    name: str
    node_id: str
    labels: dict[str, str] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)     # pool -> busy share, last interval
    drop_share: dict[str, float] = field(default_factory=dict)  # pool -> load drops / frames offered, last interval
    frame_s: dict[str, float] = field(default_factory=dict)  # pool -> seconds of pool time per frame
    placed: list = field(default_factory=list)  # (when, pool, cost, stream) of streams no report has measured
    draining: bool = False

    @property
    def pending(self) -> dict[str, float]:
        """pool -> the estimated cost of streams placed lately, whose load the reports do not show yet."""
        out: dict[str, float] = {}
        for _, pool, c, _ in self.placed:
            out[pool] = out.get(pool, 0.0) + c
        return out

    def settle(self, now: float, *, running: set[str], measured: set[str], max_s: float) -> None:
        """After a report: forget the estimates of the streams whose load it measured (they ran through
        its whole interval), of those the engine no longer runs, and of any placed more than `max_s`
        ago (a source that never opens stops holding room). Forgetting them at a fixed age instead
        counted a running stream twice (measured and estimated) until then, and refused streams the
        engine could take; forgetting them at every report counts a stream still opening as free."""
        self.placed = [p for p in self.placed if p[3] in running and p[3] not in measured and now - p[0] < max_s]

    def load(self, pool: str) -> float:
        return self.busy.get(pool, 0.0) + self.drop_share.get(pool, 0.0) + self.pending.get(pool, 0.0)


def cost(engine: EngineLoad, pools: list[str], fps: float) -> dict[str, float]:
    return {p: fps * engine.frame_s.get(p, 0.0) for p in pools}


def choose(engines: list[EngineLoad], *, stream: str, pools: list[str], fps: float, max_load: float,
           pin: Optional[str] = None, offline: bool = False, fps_from: str = "") -> tuple[Optional[EngineLoad], str]:
    """(the engine, "") or (None, why none can take it). An offline stream (a file processed as fast as
    the engine goes, no deadlines) is never refused for load: it takes what is free, so it goes to the
    engine with the most slack whatever its rate would cost (refusing it measured a file's nominal
    30 fps against a loaded machine's warm-up time: a clip no engine would take)."""
    why = []
    best, best_load = None, None
    for e in engines:
        excluded = _excluded(e, pin)
        if excluded:
            why.append(excluded)
            continue
        c = cost(e, pools, fps)
        after = {p: e.load(p) + c[p] for p in pools}
        worst = max(after.values(), default=0.0)
        if worst > max_load and not offline:
            p = max(after, key=after.get)
            why.append(f"{e.name} {p} load {e.load(p):.2f} + {c[p]:.2f} = {worst:.2f} > {max_load:g}")
            continue
        if best is None or worst < best_load:
            best, best_load = e, worst
    if best is not None:
        return best, ""
    if not engines:
        return None, f"no engine can take stream {stream!r}: no engine is running (no node with a free GPU?)"
    rate = f"{fps:g} fps" + (f" ({fps_from})" if fps_from else "")
    return None, (f"no engine can take stream {stream!r} ({rate} into {pools}): " + "; ".join(why)
                  + ". Add a node, remove a stream, or raise cluster.max_load")


def _excluded(e: EngineLoad, pin: Optional[str]) -> str:
    """Why `e` may not take the stream whatever its load ("" when it may)."""
    if e.draining:
        return f"{e.name} draining"
    if pin is not None:
        key, _, value = pin.partition("=")
        if e.labels.get(key) != value:
            return f"{e.name} lacks label {pin}"
    return ""


def fits_idle(engines: list[EngineLoad], *, pools: list[str], fps: float, max_load: float,
              pin: Optional[str] = None) -> bool:
    """Whether the stream would fit one of the engines that may take it were that engine idle: a stream
    refused only for the load of others waits (pending) for room; one that costs more than a whole
    engine is refused outright (it would wait for ever). With no engine that may take it (none runs yet,
    all draining, none with its label) it waits too: one may come."""
    eligible = [e for e in engines if not _excluded(e, pin)]
    return not eligible or any(max(cost(e, pools, fps).values(), default=0.0) <= max_load for e in eligible)


def place(e: EngineLoad, pools: list[str], fps: float, now: float = 0.0, stream: str = "") -> None:
    """Count a stream placed on `e` until the reports show the load it brings (see `settle`)."""
    for p, c in cost(e, pools, fps).items():
        e.placed.append((now, p, c, stream))


def measured_streams(previous: dict, report: dict) -> set[str]:
    """The streams whose load a report measured: those that had already taken frames at the report
    before (so they ran through the whole interval between the two). Reports as `EngineActor.report`."""
    def took(rep: dict, sid: str) -> bool:
        counts = rep.get("streams", {}).get(sid, {}).get("counts", {})
        return sum(c.get("ingested", 0) for c in counts.values()) > 0
    return {sid for sid in report.get("streams", {}) if took(previous, sid)}


def engines_that_fit(resources: dict, *, per_node: int, gpus: float, cpus: float) -> tuple[int, str]:
    """How many of a node's `per_node` engines its resources (Ray's totals for the node) can hold, and
    why not all ("" when all fit). Ray keeps an actor that fits nowhere pending with no error, so the
    controller never starts those beyond what fits: it reports them with this reason instead."""
    fit, why = per_node, ""
    for key, need in (("GPU", gpus), ("CPU", cpus)):
        if need <= 0:
            continue
        have = float(resources.get(key, 0.0))
        n = int(have / need + 1e-9)
        if n < fit:
            fit = n
            why = (f"the node has {have:g} {key}, {n} engine(s) of {need:g} {key} fit (cluster.engines_per_node="
                   f"{per_node}, cluster.engine_{key.lower()}s={need:g})")
    return fit, why
