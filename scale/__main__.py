"""python -m scale: N replicas of vlscope's API on Ray Serve, on a one-node cluster started here or on a cluster
given by address, until Ctrl-C.

    python -m scale --replicas 2 --threads 1                  # this machine, two one-thread replicas, port 8000
    python -m scale --address 10.0.0.5:6379 --replicas 4      # a cluster started with `ray start` (docs/hosting.md)
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="replicas to run (without autoscaling)")
    parser.add_argument("--min-replicas", type=int, help="scale between this and --max-replicas on load")
    parser.add_argument("--max-replicas", type=int)
    parser.add_argument("--threads", type=int, default=1, help="threads (and Ray CPUs) of each replica")
    parser.add_argument("--dtype", help="each replica's precision (VLSCOPE_DTYPE)")
    parser.add_argument("--model", help="each replica's model (VLSCOPE_MODEL)")
    parser.add_argument("--host", default="127.0.0.1", help="where the HTTP proxy listens (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--address", help="an existing Ray cluster (host:port of its head); default: start one here, "
                                          "every port on loopback")
    parser.add_argument("--metrics-export-port", type=int, default=0, help="Ray's own Prometheus port (local cluster)")
    args = parser.parse_args(argv)
    if (args.min_replicas is None) != (args.max_replicas is None):
        parser.error("--min-replicas and --max-replicas go together")
    if args.min_replicas is not None and not 1 <= args.min_replicas <= args.max_replicas:
        parser.error("want 1 <= --min-replicas <= --max-replicas")
    if args.replicas < 1 or args.threads < 1:
        parser.error("--replicas and --threads are at least 1")
    return args


def replica_settings(args) -> dict[str, str]:
    from engine.config import variable
    from server.settings import server_settings_in_environment
    settings = server_settings_in_environment()
    for name in ("dtype", "model"):
        if getattr(args, name):
            settings[variable(name)] = getattr(args, name)
    return settings


def start_ray(args) -> str:
    """A one-node cluster of this process (it ends with it), every port on loopback, whatever RAY_ADDRESS says; or
    the cluster --address names, with this checkout shipped to it as the replicas' code. Returns the one line that
    says which cluster this is."""
    if args.address is None:
        os.environ.pop("RAY_ADDRESS", None)
        # Read when Ray is imported: without it Ray takes the machine's outward address as the node's, and its
        # servers listen on it.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        # The replicas are this machine's processes, started by this one: they import this checkout.
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray
    if args.address is None:
        context = ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False,
                           _metrics_export_port=args.metrics_export_port or None)
        return (f"Ray cluster: a new one on this machine ({context.address_info['gcs_address']}), every port on "
                "loopback; it stops with this command")
    reachable(args.address)
    ray.init(address=args.address, runtime_env={"working_dir": str(ROOT), "excludes": [
        ".git", "data", "bench-results", "docs", "*.png"]}, configure_logging=False)
    nodes = [node for node in ray.nodes() if node["Alive"]]
    cpus = sum(node["Resources"].get("CPU", 0) for node in nodes)
    return f"Ray cluster: joined {args.address} ({len(nodes)} nodes, {cpus:g} CPUs)"


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """Exit with one line when nothing answers at a cluster's address, rather than wait on it."""
    import socket
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        sys.exit(f"python -m scale: no Ray cluster answers at --address {address} ({exc}); start one with "
                 "`ray start --head` there, or leave --address out to start one here")


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(ROOT))
    print(start_ray(args), flush=True)
    import ray
    from ray import serve

    from server.settings import load_settings

    from .app import APP_NAME, application
    from .records import start_records
    settings = replica_settings(args)
    records = start_records(load_settings(settings).engine)
    print(f"Records of every replica: {ray.get(records.path.remote())} on the head node", flush=True)
    # One HTTP entrance, on the head node beside the front: clients reach the cluster at the head's address.
    serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
    serve.run(application(settings, args.replicas, args.threads, args.min_replicas,
                          args.max_replicas), name=APP_NAME, route_prefix="/", blocking=False)
    print(f"vlscope on Ray Serve: http://{args.host}:{args.port} (OpenAI API at /v1, /health, /metrics); Ctrl-C stops",
          flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
