"""Ray's ports on the node's own address, never on every address."""
from __future__ import annotations


def serve_grpc_on_node_address() -> None:
    """Ray Serve 2.60 opens each replica's inter-deployment gRPC server on every address ("[::]:0", fixed in its
    replica.py) while Ray's own servers listen on the node's address only: called in a replica's constructor, before
    Serve opens that server, this opens it on the node's address (loopback on a cluster started by `python -m
    scale`). The proxy and the handles reach a replica at its node's address, so nothing else changes."""
    from ray.serve._private import replica as serve_replica
    from ray.util import get_node_ip_address

    if getattr(serve_replica.add_port_to_grpc_server, "on_node_address", False):
        return
    node = get_node_ip_address()
    host = f"[{node}]" if ":" in node else node
    every_address = serve_replica.add_port_to_grpc_server

    def on_node_address(server, address: str):
        return every_address(server, f"{host}:0" if address == "[::]:0" else address)

    on_node_address.on_node_address = True
    serve_replica.add_port_to_grpc_server = on_node_address
