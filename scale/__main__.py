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


def start_ray(args) -> None:
    """A one-node cluster of this process (it ends with it), every port on loopback; or the given cluster, with
    this checkout shipped to it as the replicas' code."""
    if args.address is None:
        # Without this Ray takes the machine's outward address as the node's, and its servers listen on it.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        # The replicas are this machine's processes, started by this one: they import this checkout.
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray
    if args.address is None:
        ray.init(include_dashboard=False, _metrics_export_port=args.metrics_export_port or None,
                 configure_logging=False, log_to_driver=False)
    else:
        ray.init(address=args.address, runtime_env={"working_dir": str(ROOT), "excludes": [
            ".git", "data", "bench-results", "docs", "*.png"]}, configure_logging=False)


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(ROOT))
    start_ray(args)
    from ray import serve

    from .app import APP_NAME, application
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application(replica_settings(args), args.replicas, args.threads, args.min_replicas,
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
