"""`vidar cluster ...` commands."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine.errors import ConfigError

# Ray's default health check takes ~13 s to declare a killed node dead and ~66 s a frozen one
# (shared/STACK.md); these make it 1-1.5 s and ~3 s. They must be set before the head starts.
HEALTH_CHECK = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                "RAY_health_check_failure_threshold": "3"}


def _ray_exe() -> str:
    exe = Path(sys.executable).with_name("ray")
    if exe.exists():
        return str(exe)
    found = shutil.which("ray")
    if found is None:
        raise ConfigError("cluster: Ray is not installed; install the extra: pip install -e '.[cluster]'")
    return found


def cmd_up(args: argparse.Namespace) -> int:
    cmd = [_ray_exe(), "start"]
    cmd += ["--head", f"--port={args.port}"] if args.head else [f"--address={args.address}"]
    if args.node_ip_address:
        cmd.append(f"--node-ip-address={args.node_ip_address}")
    if args.num_gpus is not None:
        cmd.append(f"--num-gpus={args.num_gpus}")
    if args.labels:
        cmd.append(f"--labels={args.labels}")
    env = {**os.environ, **HEALTH_CHECK, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    print("vidar cluster up: " + " ".join(f"{k}={v}" for k, v in HEALTH_CHECK.items()) + " " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def cmd_run(args: argparse.Namespace) -> int:
    import copy

    import yaml

    from engine.config import set_dotted, build_config, parse_override
    from engine.cluster.driver import run
    try:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"config file {args.config!r} not found")
        tree = yaml.safe_load(path.read_text()) or {}
        for item in args.set:  # applied to the tree the engines get, not only to the head's copy
            set_dotted(tree, *parse_override(item))
        if args.address:
            tree.setdefault("cluster", {})["address"] = args.address
        cfg, _ = build_config(copy.deepcopy(tree), source=args.config)
    except (ConfigError, yaml.YAMLError) as err:
        print(f"vidar: {err}", file=sys.stderr)
        return 2
    return run(tree, cfg)


def _controller(args: argparse.Namespace):
    from engine.config import ClusterConfig
    from engine.cluster.driver import connect, controller
    cc = ClusterConfig(namespace=args.namespace)
    ray = connect(args.address, cc.namespace)
    return ray, controller(ray, {}, cc, create=False)[0]


def _call(args: argparse.Namespace, req: dict) -> dict:
    ray, ctl = _controller(args)
    return ray.get(ctl.control.remote(req), timeout=30)


def cmd_status(args: argparse.Namespace) -> int:
    engines, streams = _call(args, {"op": "list_engines"}), _call(args, {"op": "list"})
    if args.json:
        print(json.dumps({"engines": engines.get("engines"), "pending": engines.get("pending"),
                          "streams": streams.get("streams")}, indent=2))
        return 0
    for name, e in engines["engines"].items():
        busy = ", ".join(f"{p} {b:.0%}" for p, b in e["busy"].items()) or "-"
        p99 = "-" if e["p99_ms"] is None else f"{e['p99_ms']:.0f} ms"
        print(f"{name}  node {e['node_id'][:12]} ({e['node_ip']})  GPU {','.join(e['gpus']) or '-'}  "
              f"streams {len(e['streams'])}  busy {busy}  slack {e['slack']:.2f}  p99 {p99}  "
              f"relocated in {e['relocated_in']}" + ("  DRAINING" if e["draining"] else ""))
    for name, why in engines["pending"].items():
        print(f"{name}  pending: {why}")
    for sid, s in streams["streams"].items():
        where = f"on {s['engine']}" if s["engine"] else f"{s['state']}: {s.get('waiting', '-')}"
        print(f"  {sid:<12} {s['state']:<10} {where}  {s.get('fps', '-')} fps ({s.get('fps_from', '-')})  "
              f"relocations {s['relocations']}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    reply = _call(args, {"op": "drain_node", "node": args.node})
    print(json.dumps(reply, indent=2))
    return 0 if reply.get("ok") else 1


def cmd_down(args: argparse.Namespace) -> int:
    try:
        ray, ctl = _controller(args)
        ray.get(ctl.shutdown.remote(), timeout=60)
        ray.kill(ctl, no_restart=True)
        ray.shutdown()
    except ConfigError as err:
        print(f"vidar cluster down: {err}", flush=True)
    return subprocess.call([_ray_exe(), "stop"])


def main(args: argparse.Namespace) -> int:
    commands = {"up": cmd_up, "run": cmd_run, "status": cmd_status, "drain": cmd_drain, "down": cmd_down}
    try:
        return commands[args.cluster_cmd](args)
    except ConfigError as err:
        print(f"vidar: {err}", file=sys.stderr)
        return 2
