"""The HTTP routes: OpenAI's chat and text completions and models, the seed's /generate and
/health, a job's status, and Prometheus metrics (the Batch API's are in gateway.batch.routes).
Each request is validated whole before its jobs are enqueued, and every response carries the
request's id in `x-request-id`."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import Match
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from gateway.api_keys import Access, AuthFailures, queue_tenant, tenant_of
from gateway.batch.driver import BatchDriver
from gateway.batch.routes import batch_router
from gateway.batch.store import BatchStore
from gateway.board import add_board
from gateway.edge import Edge, Hosts, Limits
from gateway.errors import api_error_of, headers_of
from gateway.generate import GenerateRequest, GenerateResponse, Health, generate_job
from gateway.head import HeadAsGet
from gateway.idempotency import fingerprint, idempotency_key, scoped_key
from gateway.jobs import Jobs, RequestJobs, collect
from gateway.key_strength import warn_of_weak_keys
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics, read_backlogs
from gateway.rate_headers import EXPOSED_RATE_LIMIT_HEADERS, RateLimitHeaders
from gateway.registry import ModelRegistry, Route
from gateway.settings import GatewaySettings
from gateway.streaming import EventStream, events, opening
from openai_format.errors import APIError, bad_request, echoed, job_error, not_found
from openai_format.job_specs import (
    STRUCTURED_FIELDS,
    JobSpec,
    chat_jobs,
    check_jobs,
    completion_jobs,
    named_as_requested,
    parameter_error,
    parse_body,
)
from openai_format.render import ChatRenderer, CompletionRenderer, Renderer, finish_reason, usage
from openai_format.requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from openai_format.responses import ModelList
from producer_client import AsyncClient, JobResult, MiliError, RateLimited
from producer_client.aio import built_apart
from producer_client.allow import with_head
from producer_client.connection import answered_within, connect_async, describe, one_try_options
from producer_client.errors import InvalidArgument, JobNotFound
from producer_client.keys import NAME_PATTERN
from producer_client.new_job import lane_of
from producer_client.protocol.shards import AUTO
from producer_client.rate_limits import NO_RATE_LIMITS
from producer_client.schema import JobFailed, QueueStats
from producer_client.validation import check_job_id

log = logging.getLogger("gateway")
T = TypeVar("T")
# A body this long is parsed, validated and made into jobs on a thread (producer_client.aio's
# BUILDER: the one for all such work, which holds the GIL, so that more threads would only take
# it from the event loop more often). The pieces of that work written in Python (each message's
# validators) let the interpreter hand the GIL to the event loop every switch interval (5 ms),
# where on the loop a 4 MiB body of 140,000 messages held every other request for 0.5-2.4 s. A
# shorter body takes under a millisecond (40 us a KiB of messages), which a thread's hop (35 us
# at best) would lengthen for nothing.
LONG_BODY_BYTES = 16 << 10
# The methods a route may take (a 405's Allow lists those its path is answered with).
ROUTE_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
# The answer's headers a page on a granted origin may read (cors_origins): none is CORS-safelisted.
EXPOSED_HEADERS = [
    "x-request-id",
    "x-mili-job-ids",
    "retry-after",
    "retry-after-ms",
    "x-should-retry",
    *EXPOSED_RATE_LIMIT_HEADERS,
]


class Gateway:
    """What the routes share: settings, one Redis client for every queue, the model registry,
    the jobs of open requests and the metrics."""

    def __init__(self, settings: GatewaySettings, lifecycle: Lifecycle):
        self.settings = settings
        self.client = AsyncClient(
            settings.redis,
            settings.default_queue,
            prefix=settings.prefix,
            max_queue_depth=settings.max_queue_depth,
            max_connections=settings.max_connections,
            wait_replicas=settings.wait_replicas,
            wait_timeout_ms=settings.wait_timeout_ms,
            placement=settings.placement,
            queue_shards=AUTO if settings.follow_queue_shards else 1,
        )
        self.registry = ModelRegistry(self.client, settings.models, settings.workers_refresh_s)
        self.jobs = Jobs(lifecycle, settings.job_timeout_s, settings.cancel_on_disconnect)
        self.metrics = GatewayMetrics(self.client.placement)
        # /health's own connection: the client's calls retry for seconds (a failover), a probe
        # wants the answer within its timeout.
        self.health_probe = connect_async(settings.redis, **one_try_options(settings.health_timeout_s, True))

    async def health(self) -> Health:
        """Redis answers PING, and which models live workers serve; Unreachable (a 503) once
        health_timeout_s has passed without both."""
        return await answered_within(self.settings.health_timeout_s, self._health())

    async def backlogs(self) -> list[QueueStats] | None:
        """The queues' backlogs for a scrape; None with Redis away. Redis is asked once first, as
        /health asks it (one try, health_timeout_s at most): the client's reads retry for seconds
        (a failover), and a scrape with Redis stopped waited BACKLOG_TIMEOUT_S for them."""
        try:
            await answered_within(self.settings.health_timeout_s, self.health_probe.ping())
        except redis.RedisError as e:
            log.warning("/metrics: Redis did not answer: %s", describe(e))
            return None
        return await read_backlogs(self.client, self.settings.routed_queues())

    async def _health(self) -> Health:
        await self.health_probe.ping()
        cards = (await self.registry.current()).live_cards
        return Health(model_loaded=bool(cards), models=[c.id for c in cards])

    async def submit(
        self,
        request: Request,
        specs: list[JobSpec],
        queue: str,
        body: BaseModel,
        stream: bool = False,
        tokens: int | None = None,
    ) -> RequestJobs:
        """Enqueue the request's jobs (streamed ones for an SSE response); with an Idempotency-Key,
        under ids of the request's tenant, bound to this request (gateway/idempotency.py). The jobs
        are the API key's tenant's: its share of each lane, its quotas and rate limits."""
        client = self.client.on_queue(queue).as_tenant(queue_tenant(tenant_of(request).id))

        def record(jobs: RequestJobs) -> None:
            """The jobs that went in, on the request's answer: with its jobs, or with the refusal
            of the others after them (those are cancelled, Jobs.submit), which names them too."""
            request.state.jobs = f"queue {queue!r} jobs {','.join(jobs.ids)}"  # for the request's log line
            request.state.job_ids = jobs.ids  # x-mili-job-ids on its answer, an error's too (RequestContext)
            request.state.rate_limits = jobs.limits  # the x-ratelimit-* headers (gateway/rate_headers.py)

        key, request_id = scoped_key(request), request.state.request_id
        # The digest binds an Idempotency-Key's jobs to their request, and is of no use without
        # one. It serializes the request whole (130 ms for 140,000 messages): on a thread.
        digest = "" if key is None else await built_apart(fingerprint, request, body)
        jobs = await self.jobs.submit(client, specs, key, digest, request_id, stream, tokens, record)
        record(jobs)
        return jobs

    async def results(self, request: Request, jobs: RequestJobs) -> list[JobResult] | None:
        """The jobs' results; None if the client left first."""
        results = await collect(self.jobs.open_inbox(jobs, stream=False, receive=request.receive))
        if results is None:
            log.info("request %s: the client left before its results", jobs.request_id)
        return results

    async def stream(self, jobs: RequestJobs, renderer: Renderer) -> EventStream:
        """The jobs' stream, once each has begun (or stream_hold_s has passed): a job the worker
        refuses (a prompt longer than the context) is an HTTP error before the stream starts."""
        s = self.settings
        inbox = self.jobs.open_inbox(jobs, stream=True, receive=None)
        first = await opening(inbox, s.stream_hold_s)
        body = events(inbox, first, renderer, s.keepalive_s, self.metrics, s.retry_after_s)
        return EventStream(body)

    async def answer(
        self, request: Request, request_model: type[SamplingRequest], jobs_of, renderer_of, id_prefix: str
    ) -> Response:
        """A chat or text completion: validate it whole, enqueue its jobs, then stream them or
        wait for them. `jobs_of` turns the request into job specs, `renderer_of` makes its renderer."""
        body = await request.body()
        long = len(body) >= LONG_BODY_BYTES
        req, specs = await self.request_of(body, request_model, jobs_of, long)
        prompt_of, lane = [s.prompt_index for s in specs], lane_of(specs[0].service_tier)
        renderer = renderer_of(
            f"{id_prefix}-{answer_id(request)}", req.model, prompt_of, lane, include_usage=include_usage(req)
        )
        try:
            route = await self.registry.route(req.model)
            specs = [replace(spec, adapter=route.adapter) for spec in specs]
            tokens = await (built_apart if long else on_loop)(self.check, specs, req.streams)
            jobs = await self.submit(request, specs, route.queue, req, stream=req.streams, tokens=tokens)
        except InvalidArgument as e:
            raise named_as_requested(e, req) from None
        prompt = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        try:
            if req.streams:
                return await self.stream(jobs, renderer)
            results = await self.results(request, jobs)
        except JobFailed as e:
            raise job_error(e, prompt) from None
        return client_left() if results is None else json_response(renderer.response(results))

    async def request_of(
        self, body: bytes, request_model: type[SamplingRequest], jobs_of, long: bool
    ) -> tuple[SamplingRequest, list[JobSpec]]:
        """The request in `body`, validated whole, and its job specs (`jobs_of(req)`): on a thread
        for a `long` body (LONG_BODY_BYTES), or where the request asks for a grammar (a format,
        tools), whose first job is then checked as its submit will check it. Compiling a grammar
        takes the library up to seconds of CPU (a schema of 60,000 values: 0.8 s), in which it lets
        the GIL go: on the event loop it held every other request, and a key sending such schemas
        held them all. A grammar compiled there is cached (structured.compile_error), which the
        submits on the loop find."""
        if long:
            return await built_apart(self.specs_of_body, body, request_model, jobs_of)
        req = parsed(request_model, body)
        if not asks_for_grammar(req):
            return req, jobs_of(req)
        return req, await asyncio.to_thread(self.checked_specs, req, jobs_of)

    def specs_of_body(
        self, body: bytes, request_model: type[SamplingRequest], jobs_of
    ) -> tuple[SamplingRequest, list[JobSpec]]:
        req = parsed(request_model, body)
        return req, self.checked_specs(req, jobs_of) if asks_for_grammar(req) else jobs_of(req)

    def checked_specs(self, req: SamplingRequest, jobs_of) -> list[JobSpec]:
        specs = jobs_of(req)
        try:
            specs[0].check(self.settings.job_timeout_s)
        except InvalidArgument as e:
            raise named_as_requested(e, req) from None
        return specs

    def check(self, specs: list[JobSpec], stream: bool) -> int | None:
        """Every job of a request passes the client's validation, and together they fit
        max_request_jobs_bytes, before the first is enqueued (check_jobs); returns the request's
        tokens (its jobs' together), which its first job counts against its tenant's
        tokens-per-minute limit (Jobs.submit). A single job needs no check here: `submit`
        validates it before it touches Redis, its body is within the bound (at most
        MAX_BODY_BYTES, which the bound is not below), and it counts its own tokens (None)."""
        if len(specs) == 1:
            return None
        return check_jobs(specs, self.settings.job_timeout_s, stream, self.settings.max_request_jobs_bytes).tokens


def create_app(settings: GatewaySettings, lifecycle: Lifecycle):
    """The ASGI app: FastAPI's routes inside the request-id and metrics middleware."""
    warn_of_weak_keys(settings.api_keys, settings.admin_api_keys)
    gw = Gateway(settings, lifecycle)
    batch_store = BatchStore(gw.client)
    batch_driver = BatchDriver(batch_store, gw.client, gw.registry, settings)
    gw.metrics.count_batches(batch_driver.budget)
    app = FastAPI(
        title="MILI gateway",
        lifespan=lifespan_of(gw, lifecycle, batch_driver),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # A path with a trailing slash is one the gateway has not, answered as OpenAI answers it (a
        # 404 unknown_url), not redirected: a spec client expects an error object, and the SDK
        # followed the 307, a POST's body sent again.
        redirect_slashes=False,
    )
    add_error_handlers(app, settings.retry_after_s)
    app.include_router(batch_router(batch_store, settings))
    add_openai_routes(app, gw)
    add_mili_routes(app, gw, settings.default_queue)
    add_operations_routes(app, gw)
    failures = AuthFailures(settings.auth_failures_per_minute)
    add_board(app, gw.client, settings, failures)
    return edge_of(app, gw.client, settings, failures, gw.metrics)


def lifespan_of(gw: Gateway, lifecycle: Lifecycle, batch_driver: BatchDriver):
    """The app's start (ready, the batch driver running) and its stop (the driver, then the
    connections)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        lifecycle.started()
        batch_driver.start()
        # What the gateway made to start (modules, schemas, the app: some 80,000 objects) will live
        # as long as it does: frozen, no collection walks it again. A full collection holds the
        # GIL, and so every request, for as long as it walks (50 ms for these alone, on this VM):
        # with a 4 MiB body's objects being made on a thread (LONG_BODY_BYTES), /health was held
        # up to 1.2 s, under 0.1 s once they were frozen (bench/RESULTS.md, "Large request bodies").
        gc.freeze()
        yield
        await batch_driver.stop()
        await gw.client.aclose()
        await gw.health_probe.aclose()

    return lifespan


def add_openai_routes(app: FastAPI, gw: Gateway) -> None:
    """OpenAI's chat completions, completions and models (the Files and Batch API: gateway.batch)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await gw.answer(request, ChatCompletionRequest, chat_jobs, ChatRenderer, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await gw.answer(request, CompletionRequest, completion_jobs, CompletionRenderer, "cmpl")

    @app.get("/v1/models")
    async def list_models():
        return json_response(ModelList(data=(await gw.registry.current()).cards))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if not model:
            raise no_route()
        card = next((c for c in (await gw.registry.current(force=True)).cards if c.id == model), None)
        if card is None:
            raise not_found(
                f"the model `{echoed(model)}` does not exist (no live worker serves it)", "model_not_found", "model"
            )
        return json_response(card)

    @app.post("/v1/embeddings")
    async def embeddings():
        # OpenAI's route, which the SDK's clients.embeddings calls: a 404 would read as a wrong
        # base_url, where the answer is that MILI generates text only (docs/http-api.md, Not supported).
        raise bad_request(
            "embeddings are not supported by this server: MILI generates text (/v1/chat/completions, /v1/completions)",
            code="unsupported_endpoint",
        )


def add_mili_routes(app: FastAPI, gw: Gateway, default_queue: str) -> None:
    """MILI's own: /generate (one prompt, its text) and a job's status by id."""

    @app.get("/v1/jobs/{job_id:path}")
    async def job_status(request: Request, job_id: str):
        if not job_id:
            raise no_route()
        # Another tenant's job is answered as a missing one, before any read: its existence is not told.
        if not tenant_of(request).owns_job(check_job_id(job_id)):
            raise JobNotFound(job_id)
        return json_response(await gw.client.status(job_id))

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.body()
        parse = built_apart if len(body) >= LONG_BODY_BYTES else on_loop
        req = await parse(parse_body, GenerateRequest, body)
        spec = generate_job(req)
        route = Route(default_queue) if req.model is None else await gw.registry.route(req.model)
        jobs = await gw.submit(request, [replace(spec, adapter=route.adapter)], route.queue, req)
        results = await gw.results(request, jobs)
        if results is None:
            return client_left()
        (result,) = results
        answer = GenerateResponse(
            generated_text=result.text, finish_reason=finish_reason(result)[0], usage=usage([result], [0])
        )
        return json_response(answer)


def add_operations_routes(app: FastAPI, gw: Gateway) -> None:
    """/health for probes, /metrics for Prometheus (the queues' backlogs read at each scrape, once
    Redis has answered a PING: Gateway.backlogs)."""

    @app.get("/health")
    async def health():
        return json_response(await gw.health())

    @app.get("/metrics")
    async def metrics():
        gw.metrics.backlogs.stats = await gw.backlogs()
        return Response(gw.metrics.exposition(), media_type="text/plain; version=0.0.4")


def edge_of(app, client: AsyncClient, settings: GatewaySettings, failures: AuthFailures, metrics: GatewayMetrics):
    """The routes behind, from the outside in: the trusted proxies' view of the client (address
    and scheme), the request's id, metrics and log line, CORS only where configured, the tenant's
    rate-limit headers, the edge's checks of key, body size and type (gateway/edge.py), and HEAD
    answered as GET (gateway/head.py). The headers go outside the edge so that its refusals of a
    known tenant (413, 415, 408) carry them too: the promise is every answer to the tenant."""
    access = Access(settings.api_keys, settings.admin_api_keys)
    limits = Limits(
        settings.max_json_bytes, settings.batch_max_file_bytes, settings.monitoring_needs_key, settings.body_timeout_s
    )
    hosts = Hosts.of(settings.allowed_hosts, access.required)
    guarded = RateLimitHeaders(
        Edge(HeadAsGet(app), access, limits, failures, hosts, frozenset(settings.cors_origins)), client
    )
    if settings.cors_origins:
        # Any request header from the origins granted: the official SDKs send headers of their own
        # (x-stainless-*, openai-organization...), and a preflight that refuses one stops every
        # request.
        guarded = CORSMiddleware(
            guarded,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
            expose_headers=EXPOSED_HEADERS,
        )
    keys = [*settings.api_keys, *settings.admin_api_keys]
    return ProxyHeadersMiddleware(RequestContext(guarded, metrics, keys), trusted_hosts=settings.trusted_proxies)


def no_route() -> StarletteHTTPException:
    """The router's 404 (router_error: unknown_url), for a path a `:path` parameter matched empty:
    `/v1/models/` is `/v1/models` with a trailing slash, as `/v1/batches/` is, not a model named ''."""
    return StarletteHTTPException(404)


def client_left() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


def json_response(model: BaseModel, headers: dict[str, str] | None = None, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


async def on_loop(function: Callable[..., T], *args: Any) -> T:
    """function(*args), here: built_apart's twin for work too short for a thread's hop."""
    return function(*args)


def parsed(request_model: type[SamplingRequest], body: bytes) -> SamplingRequest:
    req = parse_body(request_model, body)
    check_stream_options(req)
    return req


def asks_for_grammar(req: SamplingRequest) -> bool:
    return any(getattr(req, name, None) for name in (*STRUCTURED_FIELDS, "tools"))


def check_stream_options(req: SamplingRequest) -> None:
    if req.stream_options is not None and not req.streams:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def include_usage(req: SamplingRequest) -> bool:
    return req.stream_options is not None and bool(req.stream_options.include_usage)


def answer_id(request: Request) -> str:
    """An answer's id: the Idempotency-Key, so that a retried request answers under the same id."""
    return idempotency_key(request) or request.state.request_id


def add_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    def error_response(error: APIError) -> Response:
        return json_response(error.body, headers_of(error), error.status)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError):
        return error_response(error)

    # The router's own errors keep their headers, and a 405 says every method its path takes in
    # Allow, which HTTP requires (RFC 9110 15.5.6).
    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: HTTPException):
        headers = dict(error.headers or {})
        if error.status_code == 405:
            headers["Allow"] = allowed_methods(request)
        api_error = router_error(request, error.status_code, headers.get("Allow"), str(error.detail))
        return json_response(api_error.body, headers, api_error.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError):
        return error_response(parameter_error(list(error.errors())))

    # Client-library and Redis errors have their status codes; anything else is a bug, answered
    # by Starlette's last-resort handler (which logs it) in the same shape.
    @app.exception_handler(MiliError)
    @app.exception_handler(redis.RedisError)
    async def on_queue_error(request: Request, error: Exception):
        if isinstance(error, RateLimited) and error.limits is not None:
            request.state.rate_limits = error.limits  # the headers say the limits that refused it
        elif isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
            # Redis has just not answered this request (a /health probe's 503 too): the headers'
            # read would wait its bound out on the same silence, so the answer goes without them.
            request.state.rate_limits = NO_RATE_LIMITS
        return error_response(api_error_of(error, retry_after_s))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, error: Exception):
        return error_response(APIError(500, "internal error", "server_error"))


def allowed_methods(request: Request) -> str:
    """The methods the request's path is answered with, HEAD beside GET (producer_client.allow),
    each found by matching the path again with it: the router's 405 named only the first route of
    the path's (PUT /v1/batches said POST, not GET)."""
    routes = request.app.router.routes
    methods = [
        method
        for method in ROUTE_METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    ]
    return with_head(", ".join(methods))


def router_error(request: Request, status: int, allow: str | None, detail: str) -> APIError:
    """The router's answer for a path no route has (OpenAI's 404 `unknown_url`, in its words) or a
    method its route has not (a 405 naming the methods it takes, as its Allow header does)."""
    asked = f"{request.method} {echoed(request.url.path)}"
    if status == 404:
        return not_found(
            f"Unknown request URL: {asked}. Please check the URL for typos, or see docs/http-api.md for the routes.",
            "unknown_url",
        )
    if status == 405:
        return APIError(
            405, f"Method not allowed: {asked} (this path takes {allow})", "invalid_request_error", "method_not_allowed"
        )
    return APIError(status, detail, "invalid_request_error")


class RequestContext:
    """ASGI middleware: a request id for every request (the client's `x-request-id` if usable),
    sent back in `x-request-id`; the request count by route and status, and the time to the
    first byte of the body; one log line per request, with its jobs and their queue. The line's
    path shows `***` for any API key in it: a client that put its key in the URL
    (`/v1/models/KEY`, a base URL ending in it) must not have it written to the log."""

    def __init__(self, app, metrics: GatewayMetrics, api_keys: list[str]):
        self.app = app
        self.metrics = metrics
        self.api_keys = api_keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500
        first_byte = True

        async def send_with_context(message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), *context_headers(request_id, scope["state"])]
            elif first_byte and message.get("body"):
                first_byte = False
                self.metrics.time_to_first_byte.labels(endpoint(scope)).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_with_context)
        finally:
            self.metrics.requests.labels(endpoint(scope), str(status)).inc()
            log.info(
                "request %s: %s %r -> %d in %.1f ms%s",
                request_id,
                scope["method"],
                self.shown_path(scope["path"]),
                status,
                (time.perf_counter() - started) * 1000,
                f"; {scope['state']['jobs']}" if "jobs" in scope["state"] else "",
            )

    def shown_path(self, path: str) -> str:
        for key in self.api_keys:
            path = path.replace(key, "***")
        return path


def context_headers(request_id: str, state: dict) -> list[tuple[bytes, bytes]]:
    """x-request-id, and x-mili-job-ids once the request has jobs: on every answer, an error's
    after they were enqueued too (one the worker found, a deadline), so that they can be looked up."""
    headers = [(b"x-request-id", request_id.encode())]
    if job_ids := state.get("job_ids"):
        headers.append((b"x-mili-job-ids", ",".join(job_ids).encode()))
    return headers


def request_id_of(scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if NAME_PATTERN.fullmatch(given):
                return given
    return uuid.uuid4().hex


def endpoint(scope) -> str:
    route = scope.get("route")
    return route.path if route is not None else "unmatched"
