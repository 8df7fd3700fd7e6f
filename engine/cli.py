"""`vidar` command line: run an engine, subscribe to its results."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from engine.errors import ConfigError, VidarError


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")


def cmd_run(args: argparse.Namespace) -> int:
    from engine.config import load_config
    from engine.core.engine import Engine
    from engine.control.runtime import EXIT_CONFIG, run

    try:
        cfg, applied = load_config(args.config, args.set)
    except ConfigError as err:
        print(f"vidar: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if cfg.cluster is not None:
        print("vidar: the cluster: section is for `vidar cluster run`; `vidar run` runs one engine here", flush=True)
    from engine.util.memory import limit_malloc_arenas
    limit_malloc_arenas(cfg.malloc_arenas)  # before any thread of ours exists (Engine.start does it again)
    _raise_fd_limit()
    import torch
    if torch.cuda.is_available():
        print(f"vidar: GPU {torch.cuda.get_device_name(0)}", flush=True)
    elif applied:
        print("vidar: no CUDA GPU found: applying the config's on_cpu overrides: " + ", ".join(applied), flush=True)
    else:
        print("vidar: no CUDA GPU found: running on the CPU", flush=True)
    pools = []
    for name, p in cfg.models.configured().items():
        model = getattr(p, "name", None) or getattr(p, "config", "?")
        weights = getattr(p, "weights", None) or getattr(p, "checkpoint", "?")
        pools.append(f"{name} {model} (weights: {weights}, max_batch {p.max_batch})")
    # the budget (`auto`: chosen after the pools' warm-up) and the endpoints (a default port that is taken moves)
    # are known once the engine has started: the runtime prints them then
    print(f"vidar: pools: {'; '.join(pools)}", flush=True)
    if cfg.metrics.enabled and cfg.metrics.token_generated:  # `auto` made one nobody knows yet: say it once
        print(f"vidar: metrics need the header Authorization: Bearer {cfg.metrics.token}", flush=True)
    return run(Engine(cfg))


def _raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit (as Go's runtime and nginx's worker_rlimit_nofile do): every
    camera, subscriber and page holds descriptors, and a flood of connections that never finish their
    handshake (ZeroMQ has no connection cap) exhausts a low soft limit (1024 on many systems) first."""
    import resource
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            logging.getLogger("vidar").debug("file descriptor limit raised from %d to %d", soft, want)
    except (ValueError, OSError):  # not permitted here: the view's cap follows the limit there is
        pass


def _human(msg: dict) -> str:
    if msg.get("type") == "event":
        return f"event.{msg['stream']} {msg['kind']}: {msg['reason']}"
    head = (f"{msg['type']}.{msg['stream']} seq={msg['seq']} pts={msg['pts']:.3f} "
            f"latency={msg['latency_ms']:.1f}ms")
    if "topk" in msg:
        i, label, p = msg["topk"][0]
        head += f" top1={i} {label!r} p={p:.3f}"
    if msg.get("weights") == "random":
        head += " [random weights]"
    return head


def cmd_subscribe(args: argparse.Namespace) -> int:
    from engine.publish.client import Subscriber

    n = 0
    with Subscriber(args.endpoint, topics=args.topic or [""], curve=_curve_arg(args)) as sub:
        try:
            while args.count is None or n < args.count:
                msg = sub.recv(timeout=args.timeout)
                if msg is None:
                    print(f"vidar subscribe: nothing received for {args.timeout} s", file=sys.stderr)
                    return 1
                if args.json:
                    out = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in msg.items()}
                    print(json.dumps(out), flush=True)
                else:
                    print(_human(msg), flush=True)
                n += 1
        except KeyboardInterrupt:
            pass
    return 0


def cmd_control(args: argparse.Namespace) -> int:
    import yaml
    from engine.control.control_socket import request

    req: dict = {"op": args.op}
    for item in args.args:
        if "=" not in item:
            print(f"vidar control: {item!r}: expected key=value, e.g. stream=cam1 id=3 box=[10,20,200,180]",
                  file=sys.stderr)
            return 2
        key, _, value = item.partition("=")
        req[key] = yaml.safe_load(value)
    try:
        reply = request(args.endpoint, req, timeout=args.timeout, curve=_curve_arg(args))
    except TimeoutError as err:
        print(f"vidar control: {err}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2))
    return 0 if reply.get("ok") else 1


def cmd_keys(args: argparse.Namespace) -> int:
    from engine.security.keys import create_keys
    files = create_keys(args.directory)
    for f in files:
        print(f)
    print(f"Put client public keys (*.key, never *.key_secret) in the directory named by "
          f"security.authorized_clients; the engine uses {args.directory}/server.key_secret.")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    """`vidar cluster up|run|status|drain|down` (engine/cluster: Ray is imported only here)."""
    from engine.cluster import cli
    return cli.main(args)


def _curve_arg(args: argparse.Namespace):
    if args.curve_client_key or args.curve_server_key:
        if not (args.curve_client_key and args.curve_server_key):
            raise SystemExit("vidar: --curve-client-key and --curve-server-key go together")
        return (args.curve_client_key, args.curve_server_key)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vidar", description="Real-time video analytics engine")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the engine on a config")
    r.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set models.classify.max_batch=4 (repeatable)")
    r.set_defaults(func=cmd_run)
    s = sub.add_parser("subscribe", help="print results from a running engine")
    s.add_argument("endpoint", nargs="?", default="tcp://127.0.0.1:5556",
                   help="the engine's publish endpoint (default: publish.endpoint's default; a second engine on the "
                        "machine prints its own at start)")
    s.add_argument("--topic", action="append", help="topic prefix, e.g. classify.cam1 or event. (repeatable)")
    s.add_argument("--json", action="store_true", help="JSON lines (bytes as hex)")
    s.add_argument("--count", type=int, help="exit after this many messages")
    s.add_argument("--timeout", type=float, help="exit 1 if nothing arrives for this many seconds")
    s.set_defaults(func=cmd_subscribe)
    c = sub.add_parser("control", help="send a request to a running engine's control socket",
                       description="ops: list, add_stream stream={id: cam2, url: ..., mode: live}, "
                                   "remove_stream stream=cam2, add_object stream=cam1 id=3 box=[x0,y0,x1,y1] "
                                   "(or points=[[x,y,1]]), remove_object stream=cam1 id=3, reset_stream stream=cam1")
    c.add_argument("op")
    c.add_argument("args", nargs="*", metavar="KEY=VALUE", help="values are YAML")
    c.add_argument("--endpoint", default="tcp://127.0.0.1:5557",
                   help="the engine's control endpoint (default: control.endpoint's default; a second engine on the "
                        "machine prints its own at start)")
    c.add_argument("--timeout", type=float, default=10.0)
    c.set_defaults(func=cmd_control)
    for parser in (s, c):
        parser.add_argument("--curve-client-key", help="CURVE: this client's secret certificate (client.key_secret)")
        parser.add_argument("--curve-server-key", help="CURVE: the engine's public certificate (server.key)")
    k = sub.add_parser("keys", help="create CURVE certificates (server and client) in a directory")
    k.add_argument("directory")
    k.set_defaults(func=cmd_keys)
    cl = sub.add_parser("cluster", help="run across a Ray cluster (needs the extra: pip install -e '.[cluster]')")
    csub = cl.add_subparsers(dest="cluster_cmd", required=True)
    up = csub.add_parser("up", help="start Ray on this machine with vidar's failure-detection settings")
    where = up.add_mutually_exclusive_group(required=True)
    where.add_argument("--head", action="store_true", help="start the head node")
    where.add_argument("--address", help="join the cluster whose head is at HOST:PORT")
    up.add_argument("--node-ip-address", help="this node's address (default: Ray's choice; 127.0.0.1 for one machine)")
    up.add_argument("--port", type=int, default=6379, help="head: the GCS port")
    up.add_argument("--num-gpus", type=int, help="GPUs this node offers (default: Ray detects them)")
    up.add_argument("--labels", help="node labels for cluster.pin, e.g. zone=a,room=2")
    run = csub.add_parser("run", help="run a config (with a cluster: section) across the cluster")
    run.add_argument("config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    for name, helptext in (("status", "engines, their streams, slack and p99"), ("drain", "move every stream off a node"),
                           ("down", "stop the vidar cluster and Ray on this machine")):
        c2 = csub.add_parser(name, help=helptext)
        if name == "drain":
            c2.add_argument("node", help="node id (a unique prefix is enough; see `vidar cluster status`)")
        if name == "status":
            c2.add_argument("--json", action="store_true")
        c2.add_argument("--namespace", default="vidar")
    for c2 in (run,) + tuple(csub.choices[n] for n in ("status", "drain", "down")):
        c2.add_argument("--address", default=None, help="Ray head HOST:PORT (default: RAY_ADDRESS or this machine)")
    cl.set_defaults(func=cmd_cluster)
    args = p.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except VidarError as err:
        print(f"vidar: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
