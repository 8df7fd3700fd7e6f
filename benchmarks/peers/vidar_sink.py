"""vidar's results as a user receives them: a subscriber process on vidar's ZeroMQ endpoint (vidar's venv).

    python benchmarks/peers/vidar_sink.py tcp://127.0.0.1:PORT c0,c1,...

Counts distinct (stream, seq) of the null pool's results (topic `noop.`) and, per result:
  latency  receive time - `t_capture` (wall clock, one machine), what the user sees from capture;
  age      how much further behind the server's clock this frame is than the stream's freshest frame so
           far: (receive - pts) - min over the stream of (receive - pts). The server sends a clip in real time,
           so a reader that keeps up holds it constant; one that falls behind the live edge (its backlog in
           the socket, which `t_capture` cannot see: it is stamped when the packet leaves the demuxer) grows it.
Events (`event.`) are counted by kind (degraded / restored from the ladder, reconnecting, eos).
Protocol: benchmarks/peers/sink.py.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

from sink import Tally, emit, serve_commands

from engine.publish.client import Subscriber


def main() -> None:
    endpoint, streams = sys.argv[1], sys.argv[2].split(",")
    tally, events = Tally(streams), Counter()
    base: dict[str, float] = {}  # per stream: the smallest receive - pts so far (its freshest frame)
    stop = threading.Event()
    sub = Subscriber(endpoint, ["noop.", "event."])
    serve_commands(tally, stop.set)
    emit({"event": "started", "t": time.time()})
    while not stop.is_set():
        msg = sub.recv(0.05)
        if msg is None:
            continue
        now = time.time()
        s = msg.get("stream")
        if msg.get("type") == "event":
            events[msg.get("kind")] += 1
            tally.extra["events"] = dict(events)
            continue
        offset = now - msg["pts"]
        base[s] = min(base.get(s, offset), offset)
        tally.add(s, msg["seq"], (now - msg["t_capture"]) * 1e3, (offset - base[s]) * 1e3)
    sub.close()


if __name__ == "__main__":
    main()
