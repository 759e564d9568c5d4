"""Image URLs in API requests: data: URLs decoded; http(s) URLs fetched from the operator's allowed hosts only,
within a total deadline and a byte cap, following no redirect off the list and reaching no address on the server's
own networks unless the operator allows it. Every fetch failure reads the same to the client: an API that told
"refused" from "timed out" would be a port scanner for the server's network."""
from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import socket
import time
from urllib.parse import urljoin, urlparse

import httpx

from .errors import ApiError

log = logging.getLogger(__name__)

MAX_REDIRECTS = 3


class FetchRefused(Exception):
    """A fetch that must not happen or did not work; logged with its reason, shown to the client generically."""


class ImageFetcher:
    """`fetcher(url)` is the image's (or, with what="video", the clip's) bytes or an ApiError. Blocking: call it off
    the event loop."""

    def __init__(self, allowed_hosts: tuple[str, ...], max_bytes: int, private_networks: bool, deadline_s: float,
                 what: str = "image"):
        self.allowed_hosts = frozenset(host.lower() for host in allowed_hosts)
        self.max_bytes, self.private_networks, self.deadline_s = max_bytes, private_networks, deadline_s
        self.what = what  # "image" or "video": the part's name in messages and error codes

    def __call__(self, url: str) -> bytes:
        if url.startswith("data:"):
            return self._data_url(url)
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https"):
            raise ApiError(400, f"{self.what}_url must be a data: URL (file paths are never read)",
                           code=f"{self.what}_url_not_allowed", param="messages")
        if (parsed.hostname or "").lower() not in self.allowed_hosts:
            raise self._not_allowed()
        try:
            return self._fetch(url)
        except FetchRefused as exc:
            log.warning("%s fetch from %s refused or failed: %s", self.what, parsed.hostname, exc)
            raise ApiError(400, f"could not fetch the {self.what} from {parsed.hostname}",
                           code=f"{self.what}_fetch_failed", param="messages") from None

    def _data_url(self, url: str) -> bytes:
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ApiError(400, f"{self.what} data URLs must be base64 encoded (data:{self.what}/..;base64,...)",
                           code=f"invalid_{self.what}", param="messages")
        if len(payload) * 3 // 4 > self.max_bytes + 3:
            raise self._too_large()
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"the {self.what} data URL is not valid base64", code=f"invalid_{self.what}",
                           param="messages") from None
        if len(data) > self.max_bytes:
            raise self._too_large()
        return data

    def _fetch(self, url: str) -> bytes:
        deadline = time.monotonic() + self.deadline_s
        # Reads wait a quarter of the deadline at most, so a trickling host overruns it by that much at worst.
        timeout = httpx.Timeout(self.deadline_s / 4)
        with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                self._check_address(url)
                try:
                    with client.stream("GET", url) as response:
                        if response.is_redirect:
                            target = urljoin(url, response.headers.get("location", ""))
                            if (urlparse(target).hostname or "").lower() not in self.allowed_hosts:
                                raise FetchRefused(f"redirect to a host off the list: {urlparse(target).hostname}")
                            url = target
                            continue
                        if response.status_code != 200:
                            raise FetchRefused(f"status {response.status_code}")
                        declared = response.headers.get("content-length", "")
                        if declared.isdigit() and int(declared) > self.max_bytes:
                            raise self._too_large()
                        data = bytearray()
                        for part in response.iter_bytes():
                            data += part
                            if len(data) > self.max_bytes:
                                raise self._too_large()
                            if time.monotonic() > deadline:
                                raise FetchRefused(f"over the {self.deadline_s:.0f} s deadline")
                        return bytes(data)
                except httpx.HTTPError as exc:
                    raise FetchRefused(f"{type(exc).__name__}: {exc}") from None
            raise FetchRefused("too many redirects")

    def _check_address(self, url: str) -> None:
        """Every address the host resolves to must be public, unless the operator allows private networks."""
        parsed = urlparse(url)
        try:
            infos = socket.getaddrinfo(parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80),
                                       proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            raise FetchRefused(f"cannot resolve: {exc}") from None
        if self.private_networks:
            return
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if not address.is_global or address.is_multicast:
                raise FetchRefused(f"{parsed.hostname} resolves to {address}, not a public address")

    def _not_allowed(self) -> ApiError:
        return ApiError(400, f"remote {self.what} URLs are refused: send the {self.what} as a data: URL, or allow its "
                             "host in VLSCOPE_API_IMAGE_HOSTS", code=f"{self.what}_url_not_allowed",
                        param="messages")

    def _too_large(self) -> ApiError:
        return ApiError(413, f"{'a' if self.what == 'video' else 'an'} {self.what} is over the "
                             f"{self.max_bytes // 1_000_000} MB limit", code=f"{self.what}_too_large",
                        param="messages")
