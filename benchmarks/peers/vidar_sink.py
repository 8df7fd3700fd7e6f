"""vidar's results as a user receives them: a subscriber process on vidar's ZeroMQ endpoint (vidar's venv).

    python benchmarks/peers/vidar_sink.py tcp://127.0.0.1:PORT c0,c1,...

Counts distinct (stream, seq) of the null pool's results (topic `noop.`) and, per result:
  latency  receive time - `t_capture` (wall clock, one machine), what the user sees from capture;
  age      the frame's age by the camera's clock, receive - when the server sent it (sink.CameraClock: from
           pts, anchored on the stream's freshest frame); a backlog in the socket, which `t_capture` cannot see
           (it is stamped when the packet leaves the demuxer), grows it while latency stays flat. A stream's
           `connected` event (a new session: the server's clip and its pts start again) starts a new anchor.
Events (`event.`) are counted by kind (degraded / restored from the ladder, reconnecting, eos).
Protocol: benchmarks/peers/sink.py.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

from sink import CameraClock, Tally, emit, serve_commands

from engine.publish.client import Subscriber


def main() -> None:
    endpoint, streams = sys.argv[1], sys.argv[2].split(",")
    tally, events = Tally(streams), Counter()
    clock = CameraClock()
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
            if msg.get("kind") == "connected":  # a new session: the server's clip, and its pts, start again
                clock.new_session(s)
            continue
        latency = now - msg["t_capture"]
        tally.add(s, msg["seq"], latency * 1e3, clock.age(s, msg["pts"], latency, now) * 1e3)
    sub.close()


if __name__ == "__main__":
    main()
