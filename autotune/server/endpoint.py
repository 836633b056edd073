"""The HTTP checks of a running vLLM (or OpenAI-compatible) server: health, served models, version, metrics.

One place for the requests the launcher's readiness check, the liveness check during measurement and
``autotune bench`` send. Each answer is a value (a status code, a list of model ids), or ``None`` when the
server could not be reached or answered something unreadable; callers decide what that means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

import httpx


class Endpoint:
    """A server's base URL (``http://host:port``) with a client, as a context manager."""

    def __init__(
        self, base_url: str, *, timeout: float = 5.0, headers: Mapping[str, str] | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(timeout=timeout, trust_env=False, headers=dict(headers or {}))
        self.last_error = ""
        """Why the last request could not reach the server ("" after one that did)."""
        self.refused: str | None = None
        """The server's words when ``/v1/models`` refused the request's key (HTTP 401 or 403)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()

    def get(self, path: str) -> httpx.Response | None:
        """``GET path``, or ``None`` when the server cannot be reached."""
        try:
            response = self._client.get(self.base_url + path)
        except httpx.HTTPError as exc:
            self.last_error = str(exc) or type(exc).__name__
            return None
        self.last_error = ""
        return response

    def health(self) -> int | None:
        """The status code of ``/health`` (200: the engine is healthy), or ``None`` when unreachable."""
        response = self.get("/health")
        return None if response is None else response.status_code

    def models(self) -> list[str] | None:
        """The model ids ``/v1/models`` lists, or ``None`` when it does not answer a readable 200 (see
        :attr:`refused` for a server that refused the request's key)."""
        response = self.get("/v1/models")
        self.refused = _refusal(response)
        if response is None or response.status_code != 200:
            return None
        try:
            return [str(item.get("id")) for item in response.json().get("data", [])]
        except (ValueError, AttributeError):
            return None

    def serves(self, model: str) -> bool:
        """Whether the server is ready to serve ``model``: ``/health`` 200 and the model listed."""
        if self.health() != 200:
            return False
        models = self.models()
        return models is not None and model in models

    def version(self) -> str | None:
        """``/version``'s version string, or ``None``."""
        response = self.get("/version")
        if response is None or response.status_code != 200:
            return None
        try:
            version = response.json().get("version")
        except (ValueError, AttributeError):
            return None
        return version if isinstance(version, str) else None

    def metrics_status(self) -> int | None:
        """The status code of ``/metrics``, or ``None`` when unreachable."""
        response = self.get("/metrics")
        return None if response is None else response.status_code


def _refusal(response: httpx.Response | None) -> str | None:
    """``HTTP 401: {"error": "Unauthorized"}`` for a refused request, else None."""
    if response is None or response.status_code not in (401, 403):
        return None
    return f"HTTP {response.status_code}: {response.text.strip()[:200]}"
