"""The Serve application: the front over N replicas, each replica one engine on its own cores."""
from __future__ import annotations

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from server.settings import load_settings

from .front import Front
from .records import HEAD_NODE
from .replica import Replica
from .router import ConversationRouter

APP_NAME = "vlscope"
FRONT = "Front"
SLACK = 8  # calls a replica takes beyond its engine's batch and queue, so Ray never holds one back: the engine
# refuses those itself, with a 429 and Retry-After


def capacity(engine) -> int:
    """What one replica's engine (its EngineConfig) takes at once: its batch plus its queue."""
    return engine.max_batch + engine.max_queue


def application(settings: dict[str, str], replicas: int = 2, threads: int = 1, min_replicas: int | None = None,
                max_replicas: int | None = None):
    """`settings`: VLSCOPE_* variables for every replica and the front. With min and max replicas Ray scales
    between them on the requests each replica holds (half its capacity as the target)."""
    loaded = load_settings(settings)
    room, server = capacity(loaded.engine), loaded.server
    scaling = dict(num_replicas=replicas) if min_replicas is None else dict(autoscaling_config=AutoscalingConfig(
        min_replicas=min_replicas, max_replicas=max_replicas or min_replicas, target_ongoing_requests=max(1, room // 2),
        upscale_delay_s=server.scale_upscale_delay_s, downscale_delay_s=server.scale_downscale_delay_s,
        # The load is averaged over the upscale delay (30 s at most, Ray's default): a burst counts within it.
        look_back_period_s=max(1.0, min(30.0, server.scale_upscale_delay_s))))
    replica = serve.deployment(Replica, name="Replica", ray_actor_options={"num_cpus": threads},
                               max_ongoing_requests=room + SLACK, health_check_period_s=2, health_check_timeout_s=30,
                               graceful_shutdown_timeout_s=5, request_router_config=RequestRouterConfig(
                                   request_router_class=ConversationRouter,
                                   request_router_kwargs={"balance_threshold": server.scale_balance_threshold,
                                                          "capacity": room}),
                               **scaling)
    # The front stays on the head node, beside the record store: a worker node lost takes only replicas with it.
    front = serve.deployment(serve.ingress()(Front), name=FRONT, num_replicas=1, max_ongoing_requests=10_000,
                             ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE: 0.001}})
    return front.bind(replica.bind(dict(settings, VLSCOPE_THREADS=str(threads)), FRONT), settings)
