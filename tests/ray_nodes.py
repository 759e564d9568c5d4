"""Two Ray nodes on this machine, a head and a worker of one CPU each, every port on loopback, as `ray start` on two
machines would make them; for the cluster tests.

    python -m tests.ray_nodes         # prints the head's address; `kill-worker` on stdin ends the worker node at
                                      # once (as a machine that dies); end of input stops both
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

# Read when Ray is imported: the nodes take loopback as their address instead of the machine's outward one.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# A node that stops answering is declared dead after three missed checks half a second apart (Ray's default
# takes about 15 s), so a test sees the cluster heal in seconds.
os.environ.update(RAY_health_check_period_ms="500", RAY_health_check_timeout_ms="500",
                  RAY_health_check_failure_threshold="3")


class RayNodes:
    """The nodes in a child process of their own (Ray reads its address settings once per process)."""

    def __init__(self, timeout_s: float = 120):
        self.process = subprocess.Popen([sys.executable, "-m", "tests.ray_nodes"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        started = time.time()
        self.address = self.process.stdout.readline().strip()
        if not self.address or time.time() - started > timeout_s:
            self.stop()
            raise RuntimeError("the two Ray nodes did not start")

    def kill_worker(self) -> None:
        self.process.stdin.write("kill-worker\n")
        self.process.stdin.flush()
        if self.process.stdout.readline().strip() != "killed":
            raise RuntimeError("the worker node was not killed")

    def stop(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(60)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            self.process.kill()
            self.process.wait(10)


def main() -> None:
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    for line in sys.stdin:
        if line.strip() == "kill-worker":
            cluster.remove_node(worker, allow_graceful=False)
            print("killed", flush=True)
    cluster.shutdown()


if __name__ == "__main__":
    main()
