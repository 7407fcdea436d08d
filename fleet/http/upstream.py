"""The router's calls that are not the request itself: the engine's /tokenize, the directory's
/v1/score, the engines' /health and /v1/models. Every call has a deadline and none raises: a
failure is an answer the caller routes by (a fallback reason), never an error to the client.

State: the shared httpx client (passed in), the /v1/models cache (adapter -> base model, with a
TTL), the metrics it observes. Touched only by the router's event loop (the health poll is a task on
it).

Primitives in call order: Upstream(settings, client, engines, metrics); await tokens(plan) ->
tuple[int, ...] | reason; await model_names(plan.model) -> (model, lora); await score(...) ->
list[Score] | reason; run_health_poll() (a task for the router's lifetime); await models() ->
(status, body) for GET /v1/models.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import structlog

from app.errors import ProtocolError
from fleet.http.calls import RouterCalls
from fleet.http.router_metrics import RouterMetrics
from fleet.router import Engine, Engines, Score, parse_scores
from fleet.router_config import RouterSettings
from fleet.tokenize import MAX_SCORED_TOKENS, RequestPlan, lora_split

__all__ = ["Upstream"]

log = structlog.get_logger("kvdepot.route")

MAX_SMALL_ANSWER = 16 * 1024 * 1024  # /v1/score, /v1/models


async def _read_capped(resp: httpx.Response, cap: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > cap:
            raise ProtocolError(f"answer larger than {cap} bytes")
        parts.append(chunk)
    return b"".join(parts)


class Upstream(RouterCalls):
    def __init__(
        self, settings: RouterSettings, client: httpx.AsyncClient, engines: Engines, metrics: RouterMetrics
    ) -> None:
        super().__init__(settings, client, engines, metrics)
        self._parents: dict[str, str | None] = {}
        self._default_model: str | None = None
        self._models_at = -1e18

    def _headers(self, to_engine: bool) -> dict[str, str]:
        """The router's own calls to an engine carry `engine_api_key` (vLLM's `--api-key`)."""
        key = self.settings.engine_api_key
        if to_engine and key is not None:
            return {"authorization": f"Bearer {key.get_secret_value()}"}
        return {}

    async def _post_json(
        self, url: str, body: dict[str, Any], deadline_s: float, cap: int, *, to_engine: bool
    ) -> Any:
        """POST `body`, the parsed JSON answer; any failure (deadline included) raises."""
        async with asyncio.timeout(deadline_s):
            headers = {"content-type": "application/json", **self._headers(to_engine)}
            req = self.client.build_request(
                "POST", url, content=orjson.dumps(body), headers=headers, timeout=httpx.Timeout(deadline_s)
            )
            resp = await self.client.send(req, stream=True)
            try:
                data = await _read_capped(resp, cap)
            finally:
                await resp.aclose()
        if resp.status_code != 200:
            raise ProtocolError(f"HTTP {resp.status_code}: {data[:200]!r}")
        return orjson.loads(data)

    async def tokens(self, plan: RequestPlan) -> tuple[int, ...] | str:
        """The request's prompt tokens: carried by the request, or from an engine's /tokenize (the
        least loaded healthy one; tokenizing is cheap and every engine of a fleet serves the same
        model). A string is the fallback reason."""
        if plan.token_ids is not None:
            return plan.token_ids
        assert plan.tokenize_body is not None
        engine = self.engines.least_loaded()
        if engine is None:
            return "tokenize_failed"
        start = time.perf_counter()
        try:
            deadline = self.settings.tokenize_timeout_s
            answer = await self._post_json(
                engine.url + "/tokenize", plan.tokenize_body, deadline, MAX_SMALL_ANSWER, to_engine=True
            )
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if isinstance(tokens, list) and len(tokens) > MAX_SCORED_TOKENS:
                return "too_long"
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise ProtocolError("/tokenize answer has no list of int `tokens`")
            return tuple(tokens)
        except Exception as exc:
            self.metrics.errors.labels("tokenize").inc()
            if isinstance(exc, (httpx.ConnectError, httpx.TimeoutException, TimeoutError)):
                # an engine's frontend answers /tokenize at once even while it computes: it is down
                self.engines.mark_failed(engine, f"tokenize: {_describe(exc)}")
            log.warning("tokenize_failed", engine=engine.shown, error=_describe(exc))
            return "tokenize_failed"
        finally:
            self.metrics.tokenize_seconds.observe(time.perf_counter() - start)

    async def model_names(self, model: str | None) -> tuple[str | None, str | None]:
        """(base model, LoRA adapter) of the request's `model`, from the engines' /v1/models (cached
        `models_ttl_s`); no `model` = the engines' first base model, as vLLM defaults."""
        if time.monotonic() - self._models_at > self.settings.models_ttl_s:
            await self._refresh_models()
        if model is None:
            return self._default_model, None
        return lora_split(model, self._parents)

    async def _refresh_models(self) -> None:
        """The engines' model list; when none answers, the old one stays for another TTL (a fleet
        whose /v1/models fails must not cost every request a round of failing calls)."""
        self._models_at = time.monotonic()
        for engine in self.engines.candidates():
            status, body = await self._get(engine, "/v1/models", self.settings.tokenize_timeout_s)
            if status != 200:
                continue
            try:
                cards = orjson.loads(body)["data"]
                parents = {str(c["id"]): _parent(c) for c in cards}
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            self._parents = parents
            self._default_model = next((m for m, p in parents.items() if p is None), None)
            return
        log.warning("models_unknown", error="no engine answered GET /v1/models")

    async def score(
        self, model: str | None, tokens: tuple[int, ...], salt: str | None, lora: str | None
    ) -> list[Score] | str:
        """The directory's instances for these tokens, best first; a string is the fallback reason
        (`no_directory`, `directory_timeout`, `directory_down`)."""
        url = self.settings.directory_url
        if url is None:
            return "no_directory"
        if model is None:
            return "no_model"
        body = {"model": model, "token_ids": list(tokens), "cache_salt": salt, "lora_name": lora}
        start = time.perf_counter()
        try:
            deadline = self.settings.directory_timeout_ms / 1000
            answer = await self._post_json(
                url + "/v1/score", body, deadline, MAX_SMALL_ANSWER, to_engine=False
            )
            return parse_scores(answer)
        except TimeoutError:
            self.metrics.errors.labels("directory").inc()
            return "directory_timeout"
        except Exception as exc:
            self.metrics.errors.labels("directory").inc()
            log.warning("directory_failed", error=_describe(exc))
            return "directory_timeout" if isinstance(exc, httpx.TimeoutException) else "directory_down"
        finally:
            self.metrics.directory_seconds.observe(time.perf_counter() - start)

    async def _get(
        self, engine: Engine, path: str, deadline_s: float, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """GET an engine's `path` (with the router's own key, or `headers`): (status, body);
        (0, b"") when it did not answer in time."""
        try:
            async with asyncio.timeout(deadline_s):
                req = self.client.build_request(
                    "GET",
                    engine.url + path,
                    headers=self._headers(True) if headers is None else headers,
                    timeout=httpx.Timeout(deadline_s),
                )
                resp = await self.client.send(req, stream=True)
                try:
                    return resp.status_code, await _read_capped(resp, MAX_SMALL_ANSWER)
                finally:
                    await resp.aclose()
        except Exception:
            return 0, b""

    async def models(self, authorization: str | None) -> tuple[int, bytes]:
        """GET /v1/models of the first healthy engine that answers it, for a client: with the
        client's own Authorization header, never the router's key."""
        headers = {} if authorization is None else {"authorization": authorization}
        for engine in self.engines.candidates():
            status, body = await self._get(engine, "/v1/models", self.settings.connect_timeout_s, headers)
            if status != 0:
                return status, body
        return 0, b""

    async def run_health_poll(self) -> None:
        """Poll every engine's /health each `health_interval_s`: a failed poll marks the engine
        unhealthy (avoided while another is healthy), a good one clears it."""
        while True:
            results = await asyncio.gather(
                *(self._get(e, "/health", self.settings.connect_timeout_s) for e in self.engines.all)
            )
            for engine, (status, _) in zip(self.engines.all, results, strict=True):
                if status == 200:
                    self.engines.mark_healthy(engine)
                else:
                    self.engines.mark_failed(engine, f"health poll: HTTP {status or 'no answer'}")
            await asyncio.sleep(self.settings.health_interval_s)


def _parent(card: Any) -> str | None:
    parent = card.get("parent")
    return None if parent is None else str(parent)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
