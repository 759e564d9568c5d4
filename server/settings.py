"""The server's settings: who may reach the server and its app, and what its API accepts. Read as the engine's are
(engine/config.py's reader), and with them in `load_settings`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from engine.config import SKELETON_DIR, EngineConfig, read_settings, setting_names, settings_in_environment


@dataclass(frozen=True)
class ServerSettings:
    """Who may reach the server and what its API accepts."""

    # API keys: when any is set, the API answers 401 without `Authorization: Bearer <key>`.
    api_keys: tuple[str, ...] = ()
    # Hosts the API may fetch http(s) image URLs from; empty: images come only as data: URLs.
    api_image_hosts: tuple[str, ...] = ()
    # 0: what an allowed request can need, one image at max_image_bytes in base64 plus 1 MiB of text and structure.
    api_max_body_bytes: int = 0
    # A request body must arrive within this many seconds: a client sending a byte a second is cut off.
    api_body_seconds: float = 30.0
    # A connection's request headers must be complete this long after it opens (or after its last response).
    api_header_seconds: float = 10.0
    # HTTP connections one client address may hold open at once (the app's websockets are not counted).
    api_max_connections_per_address: int = 64
    # Image URLs from the allowed hosts may resolve to loopback, private or link-local addresses (off: refused, so
    # a redirect or a DNS answer cannot point the server at its own network).
    api_image_private_networks: bool = False
    api_image_fetch_seconds: float = 10.0  # one image URL's whole fetch, redirects included
    # vLLM's `ignore_eos` for API clients: a request that ignores end tokens holds the worker for max_tokens.
    api_allow_ignore_eos: bool = False
    # Host header values the API answers besides this machine's names and IP literals (DNS rebinding guard).
    allowed_hosts: tuple[str, ...] = ()
    # Web origins (https://tool.example) whose pages may call the API from a browser; others are refused.
    allowed_origins: tuple[str, ...] = ()
    # A shared password for the app, for a small team without an OIDC provider.
    app_password: str = ""
    # Failed passwords within five minutes from one browser session or client address before it is locked out.
    sign_in_attempts: int = 10
    # Who may change the Settings page when sign-in is on: signed-in users with these emails (OIDC), or anyone who
    # enters the admin password. With sign-in off, everyone who reaches the app is an admin.
    admins: tuple[str, ...] = ()
    admin_password: str = ""
    # A cluster (python -m scale): requests a conversation's replica may hold beyond the least-loaded replica's
    # before the conversation's next request goes to another (which encodes its pictures again).
    scale_balance_threshold: int = 2
    # With --min-replicas/--max-replicas: how long the queue must stay above (below) its target before a replica
    # is added (removed); Ray Serve's own defaults.
    scale_upscale_delay_s: float = 30.0
    scale_downscale_delay_s: float = 600.0
    # What the app loads when the configured hub model cannot be reached.
    fallback_model: str = str(SKELETON_DIR)

    def __post_init__(self) -> None:
        if self.api_max_body_bytes < 0:
            raise ValueError("api_max_body_bytes must be >= 0 (0: sized to the image limit)")
        if self.api_body_seconds <= 0 or self.api_header_seconds <= 0:
            raise ValueError("api_body_seconds and api_header_seconds must be above 0")
        if self.sign_in_attempts < 1:
            raise ValueError("sign_in_attempts must be at least 1")
        if self.scale_balance_threshold < 0:
            raise ValueError("scale_balance_threshold must be >= 0")
        if self.scale_upscale_delay_s < 0 or self.scale_downscale_delay_s < 0:
            raise ValueError("scale_upscale_delay_s and scale_downscale_delay_s must be >= 0")
        if self.api_max_connections_per_address < 1:
            raise ValueError("api_max_connections_per_address must be at least 1")


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig
    server: ServerSettings


def load_settings(env: Mapping[str, str] | None = None, secrets: Mapping | None = None) -> Settings:
    """The engine's and the server's settings, from the environment over the secrets over the defaults."""
    return Settings(read_settings(EngineConfig, env, secrets), read_settings(ServerSettings, env, secrets))


def all_setting_names() -> list[str]:
    """Every setting's environment variable name: the engine's, then the server's."""
    return setting_names(EngineConfig, ServerSettings)


def server_settings_in_environment() -> dict[str, str]:
    """Every setting's variable set in this process's environment, the engine's and the server's: what a
    cluster's replicas and front are given, to serve as this server would."""
    return settings_in_environment(EngineConfig, ServerSettings)
