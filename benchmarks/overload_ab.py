"""2x overload, real engine, NoopRunner (sleeps: machine-independent capacity): 4 live streams at 30 fps,
capacity 60 frames/s, budget 250 ms, 20 s. Run from a checkout's root (older commits too: it needs only the engine API):
    python benchmarks/overload_ab.py LABEL [on|off]   # on/off: qos.ladder (omit on commits without it)"""
import json, socket, sys, threading, time
sys.path.insert(0, ".")
from engine.publish.client import Subscriber
from engine.config import build_config
from engine.core.engine import Engine
from engine.models.noop import NoopRunner

label, ladder = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); ep = f"tcp://127.0.0.1:{s.getsockname()[1]}"
tree = {"streams": [{"id": f"s{i}", "url": "synthetic://shapes?size=160x120&fps=30"} for i in range(4)],
        "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 4, "device": "cpu"}},
        "budget": {"latency_ms": 250}, "publish": {"endpoint": ep, "hwm": 100000},
        "metrics": {"enabled": False}, "control": {"enabled": False}}
if ladder is not None:
    tree["qos"] = {"ladder": ladder == "on"}
cfg, _ = build_config(tree, cuda_available=True)
sub = Subscriber(ep, ["classify."])
lat, per = [], {f"s{i}": 0 for i in range(4)}
stop = threading.Event()
def read():
    while not stop.is_set():
        m = sub.recv(0.5)
        if m:
            lat.append(m["latency_ms"]); per[m["stream"]] += 1
t = threading.Thread(target=read); t.start()
eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=1 / 60)})
eng.start(); time.sleep(20); eng.stop(); stop.set(); t.join(5); sub.close()
lat.sort()
drops = {}
for i in range(4):
    for k, v in eng.pools["classify"].acct.snapshot(f"s{i}").dropped.items():
        drops[k] = drops.get(k, 0) + v
print(json.dumps({"run": label, "published": len(lat), "p50_ms": round(lat[len(lat) // 2], 1),
                  "p99_ms": round(lat[int(len(lat) * 0.99)], 1), "late": sum(x > 251 for x in lat),
                  "per_stream": per, "dropped": drops}))
