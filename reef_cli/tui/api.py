"""The TUI's asynchronous view of the daemon's HTTP API.

The TUI never blocks its event loop on the network: every call here is a coroutine on an ``httpx.AsyncClient``
(over ``$REEF_HOME/reef.sock``, or TCP with the token when ``REEF_URL`` is set), run from Textual workers.
Error bodies become ``daemon.errors`` instances exactly as in the synchronous CLI client, and a daemon that
cannot be reached is ``DaemonNotRunning``. ``Source`` is the interface the screens use; tests hand the app a
``Source`` with fixed data for deterministic snapshots.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from daemon.config import Config
from daemon.errors import DaemonNotRunning, ReefError, Unavailable
from reef_cli.client import _error_from, tcp_token

Progress = Callable[[dict[str, Any]], Awaitable[None]]


class Source(Protocol):
    """What the screens need from the daemon."""

    def where(self) -> str: ...
    async def healthz(self) -> dict[str, Any]: ...
    async def status(self) -> dict[str, Any]: ...
    async def scenarios(self) -> list[dict[str, Any]]: ...
    async def releases(self, scenario: str, *, all_: bool = False, limit: int | None = None) -> dict[str, Any]: ...
    async def release(self, release_id: str) -> dict[str, Any]: ...
    async def records(self, *, limit: int = 50, scenario: str | None = None) -> list[dict[str, Any]]: ...
    async def record(self, receipt: str) -> dict[str, Any]: ...
    async def steer(self, op: str, scenario: str, release_id: str, expected_head: str | None) -> dict[str, Any]: ...
    async def canary(self, scenario: str, release_id: str, share: float) -> dict[str, Any]: ...
    async def page(self, release_id: str) -> tuple[str, bytes]: ...
    def pages_dir(self) -> Path: ...
    async def canary_end(self, scenario: str, *, promote: bool) -> dict[str, Any]: ...
    async def evaluation(self, scenario: str, *, measure: bool = False, transfer: str | None = None,
                         progress: Progress | None = None) -> dict[str, Any]: ...
    def events(self, after: int | None) -> AsyncIterator[dict[str, Any]]: ...
    async def aclose(self) -> None: ...


class Api:
    """``Source`` over the real daemon."""

    def __init__(self, config: Config, *, timeout: float = 15.0) -> None:
        self.config = config
        if config.url:
            token = tcp_token(config)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._http = httpx.AsyncClient(base_url=config.url.rstrip("/"), headers=headers, timeout=timeout)
        else:
            transport = httpx.AsyncHTTPTransport(uds=str(config.socket_path), verify=False)  # no TLS on a socket
            self._http = httpx.AsyncClient(base_url="http://localhost", transport=transport, timeout=timeout)

    def where(self) -> str:
        return self.config.url or str(self.config.socket_path)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, raw: bool = False, **kwargs: Any) -> Any:
        try:
            resp = await self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, OSError) as e:
            from reef_cli.reach import unreachable

            raise unreachable(self.config, e) from None
        except httpx.TimeoutException:
            raise Unavailable(f"the daemon at {self.where()} did not answer {method} {path} in time") from None
        if resp.status_code >= 400:
            raise _error_from(resp)
        return resp if raw else resp.json()

    async def _get(self, path: str, **params: Any) -> Any:
        return await self._request("GET", path, params={k: v for k, v in params.items() if v is not None})

    async def healthz(self) -> dict[str, Any]:
        return dict(await self._request("GET", "/healthz", timeout=3.0))

    async def status(self) -> dict[str, Any]:
        return dict(await self._get("/reef/status"))

    async def scenarios(self) -> list[dict[str, Any]]:
        return list((await self._get("/reef/scenarios"))["scenarios"])

    async def releases(self, scenario: str, *, all_: bool = False, limit: int | None = None) -> dict[str, Any]:
        return dict(await self._get(f"/reef/scenarios/{scenario}/releases", all="1" if all_ else None, limit=limit))

    async def release(self, release_id: str) -> dict[str, Any]:
        return dict(await self._get(f"/reef/releases/{release_id}", diff="1"))

    async def records(self, *, limit: int = 50, scenario: str | None = None) -> list[dict[str, Any]]:
        data = await self._get("/reef/records", scenario=scenario, limit=limit, order="desc", kind="exchange")
        return list(data["records"])

    async def record(self, receipt: str) -> dict[str, Any]:
        return dict(await self._get(f"/reef/records/{receipt}"))

    async def steer(self, op: str, scenario: str, release_id: str, expected_head: str | None) -> dict[str, Any]:
        body = {"release_id": release_id, "expected_head": expected_head}
        return dict(await self._request("POST", f"/reef/scenarios/{scenario}/{op}", json=body, timeout=120.0))

    async def page(self, release_id: str) -> tuple[str, bytes]:
        """A release's page (``GET /reef/releases/{id}/page``): its full id and the HTML."""
        resp = await self._request("GET", f"/reef/releases/{release_id}/page", raw=True)
        return resp.headers.get("x-reef-release-id") or release_id, resp.content

    def pages_dir(self) -> Path:
        """Where pages are written (as ``reef releases open`` writes them)."""
        return self.config.home / "pages"

    async def canary(self, scenario: str, release_id: str, share: float) -> dict[str, Any]:
        body = {"release_id": release_id, "share": share}
        return dict(await self._request("POST", f"/reef/scenarios/{scenario}/canary", json=body))

    async def canary_end(self, scenario: str, *, promote: bool) -> dict[str, Any]:
        return dict(await self._request("POST", f"/reef/scenarios/{scenario}/canary/end", json={"promote": promote},
                                        timeout=120.0))

    async def evaluation(self, scenario: str, *, measure: bool = False, transfer: str | None = None,
                         progress: Progress | None = None) -> dict[str, Any]:
        """``reef eval`` of a scenario (``daemon/evaluation.py``): what is known, or (``measure``) measured, each
        release's progress handed to ``progress``."""
        path = f"/reef/scenarios/{scenario}/eval"
        query = {"transfer": transfer} if transfer else {}
        if not measure:
            return dict(await self._get(path, **query))
        try:
            async with self._http.stream("POST", path, params=query, timeout=httpx.Timeout(5.0, read=None)) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _error_from(resp)
                async for line in resp.aiter_lines():
                    item = json.loads(line) if line.strip() else {}
                    if "progress" in item and progress is not None:
                        await progress(item["progress"])
                    elif "error" in item:
                        raise ReefError(item["error"].get("message") or "the evaluation failed")
                    elif "result" in item:
                        return dict(item["result"])
        except (httpx.TransportError, OSError) as e:
            raise DaemonNotRunning(f"lost the daemon at {self.where()}: {e}") from None
        raise ReefError("the daemon ended the evaluation without a result")

    async def events(self, after: int | None) -> AsyncIterator[dict[str, Any]]:
        """Follow ``/reef/events`` from ``after``; ends when the daemon closes the stream."""
        params = {"after": after} if after is not None else {}
        try:
            async with self._http.stream("GET", "/reef/events", params=params, timeout=httpx.Timeout(5.0, read=60.0)) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _error_from(resp)
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        yield json.loads(line[6:])
        except (httpx.TransportError, OSError) as e:
            raise DaemonNotRunning(f"lost the daemon at {self.where()}: {e}") from None
