"""OpenAI's Files and Batch API over the queue: upload a JSONL file of requests, create a batch of
it, and the gateways run its lines as queue jobs (gateway.batch.driver) until its output and error
files are ready to download. Files and batches belong to the API key that created them (its
tenant: gateway.api_keys); another key finds neither, unless it is an admin key.

    POST /v1/files (purpose=batch)   GET /v1/files/{id}   GET /v1/files/{id}/content   DELETE /v1/files/{id}
    POST /v1/batches   GET /v1/batches/{id}   GET /v1/batches   POST /v1/batches/{id}/cancel
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator

import redis
from fastapi import APIRouter, File, Form, Request, UploadFile
from pydantic import ValidationError
from starlette.datastructures import FormData
from starlette.responses import StreamingResponse

from gateway.api_keys import tenant_of
from gateway.batch.schema import ENDED, Batch, CreateBatch, ExpiresAfter, FileDeleted, FileObject, RequestCounts
from gateway.batch.store import BatchStore, text_pieces
from gateway.settings import GatewaySettings, duration_s
from openai_format.batch_lines import ENDPOINTS, jsonl_lines, without_bom
from openai_format.errors import APIError, bad_request, bound_code, echoed, not_found
from openai_format.job_specs import parameter_error, parse_body
from producer_client.connection import is_other_type

FILE_ID = re.compile(r"file-[0-9a-f]{32}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
MAX_LIST = 100
MAX_FILE_LIST = 10_000  # the spec's default and bound of a file listing's limit


def batch_router(store: BatchStore, settings: GatewaySettings) -> APIRouter:
    router = APIRouter()
    add_file_routes(router, store, settings)
    add_batch_routes(router, store, settings)
    return router


def add_file_routes(router: APIRouter, store: BatchStore, settings: GatewaySettings) -> None:
    """/v1/files: upload (purpose batch), list, retrieve, content, delete; of the caller's tenant."""

    @router.post("/v1/files")
    async def upload_file(
        request: Request,
        file: UploadFile = File(...),
        purpose: str = Form(...),
        # The SDK sends `expires_after` as these two form fields.
        expires_anchor: str | None = Form(None, alias="expires_after[anchor]"),
        expires_seconds: str | None = Form(None, alias="expires_after[seconds]"),
    ):
        one_of_each_field(await request.form())  # parsed already, for the fields above
        if purpose != "batch":
            raise bad_request(f"purpose {purpose!r} is not supported: only `batch` files are", "purpose")
        ttl_s = upload_ttl_s(expires_anchor, expires_seconds, settings.batch_ttl_s)
        text = check_upload(await file.read(settings.batch_max_file_bytes + 1), settings)
        saved = await store.put_file(
            f"file-{uuid.uuid4().hex}",
            file.filename or "input.jsonl",
            "batch",
            each(text_pieces(text)),
            int(time.time()),
            ttl_s,
            tenant_of(request).id,
        )
        if saved is None:
            raise bad_request("the file is empty", "file")
        return saved

    @router.get("/v1/files")
    async def list_files(
        request: Request,
        after: str | None = None,
        limit: int = MAX_FILE_LIST,
        order: str = "desc",
        purpose: str | None = None,
    ):
        check_limit(limit, MAX_FILE_LIST)
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", "order")
        tenant = tenant_of(request)
        return await store.list_files(after, limit, order == "desc", purpose, None if tenant.admin else tenant.id)

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str):
        return await owned_file(store, request, file_id)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str):
        await owned_file(store, request, file_id)
        return StreamingResponse(encoded(await store.file_text(file_id)), media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str):
        await owned_file(store, request, file_id)
        if not await store.delete_file(file_id):
            raise file_not_found(file_id)
        return FileDeleted(id=file_id)


def check_limit(limit: int, most: int) -> None:
    """A listing's `limit`, refused with OpenAI's code for the bound it passes, as a body's number is."""
    if limit < 1:
        raise bad_request(f"limit must be 1 to {most}", "limit", bound_code(below=True, decimal=False))
    if limit > most:
        raise bad_request(f"limit must be 1 to {most}", "limit", bound_code(below=False, decimal=False))


def add_batch_routes(router: APIRouter, store: BatchStore, settings: GatewaySettings) -> None:
    """/v1/batches: create, retrieve, list, cancel; of the caller's tenant."""

    @router.post("/v1/batches")
    async def create_batch(request: Request):
        req = check_create(parse_body(CreateBatch, await request.body()), settings)
        file = await store.file(checked_file_id(req.input_file_id), tenant_of(request).owns)
        if file is None or file.purpose != "batch":
            raise bad_request(
                f"input_file_id {echoed(req.input_file_id)!r} is not an uploaded batch file",
                "input_file_id",
                "file_not_found",
            )
        if not await holds_a_request(store, file.id):
            raise bad_request(
                f"input_file_id {file.id!r} holds no request: its lines are all blank", "input_file_id", "empty_file"
            )
        batch = new_batch(req, int(time.time()))
        output = req.output_expires_after
        await store.create_batch(batch, settings.batch_ttl_s, tenant_of(request).id, output and output.seconds)
        return batch

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        return await existing_batch(store, request, batch_id)

    @router.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = 20):
        check_limit(limit, MAX_LIST)
        tenant = tenant_of(request)
        return await store.list_batches(after, limit, None if tenant.admin else tenant.id)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        batch = await existing_batch(store, request, batch_id)
        status = await store.transition(
            batch.id, "validating in_progress", "cancelling", "cancelling_at", int(time.time())
        )
        if status in ENDED - {"cancelled"}:
            # A 400, not a 409: the SDK retries a 409 (a conflict that may pass), and this one will not.
            raise bad_request(f"batch {batch_id} has ended ({status}): there is nothing to cancel", None, "batch_ended")
        return await existing_batch(store, request, batch_id)


def check_create(req: CreateBatch, settings: GatewaySettings) -> CreateBatch:
    """A batch's endpoint and completion window, among those this gateway serves."""
    if req.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint {req.endpoint!r} is not {' or '.join(ENDPOINTS)}", "endpoint")
    if req.completion_window not in settings.batch_completion_windows:
        allowed = ", ".join(settings.batch_completion_windows)
        raise bad_request(f"completion_window {req.completion_window!r} is not one of {allowed}", "completion_window")
    return req


async def holds_a_request(store: BatchStore, file_id: str) -> bool:
    """Whether the file has a line that is not blank (its byte order mark aside): a batch of none
    would `complete` having done nothing. Its pieces are read up to the first such line: the
    first piece of any file of requests. A text of another type (WRONGTYPE) is left to the batch's
    validation, which fails it naming the file (BatchRun.validate)."""
    try:
        pieces = await store.file_text(file_id)
        first = True
        async for piece in pieces:
            if (without_bom(piece) if first else piece).strip():
                return True
            first = False
    except redis.ResponseError as e:
        if not is_other_type(e):
            raise
        return True
    return False


def new_batch(req: CreateBatch, now: int) -> Batch:
    """The batch `req` asks for, created at `now` (epoch seconds): validating, nothing counted yet."""
    return Batch(
        id=f"batch_{uuid.uuid4().hex}",
        endpoint=req.endpoint,
        input_file_id=req.input_file_id,
        completion_window=req.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + duration_s(req.completion_window),
        request_counts=RequestCounts(),
        metadata=req.metadata,
    )


def upload_ttl_s(anchor: str | None, seconds: str | None, default_s: int) -> int:
    """How long an upload is kept: its `expires_after` policy's seconds where it has one, else
    `default_s` (batch_ttl_s)."""
    if anchor is None and seconds is None:
        return default_s
    given = {name: value for name, value in (("anchor", anchor), ("seconds", seconds)) if value is not None}
    try:
        return ExpiresAfter.model_validate(given).seconds
    except ValidationError as e:
        first = e.errors()[0]
        raise parameter_error([{**first, "loc": ("body", "expires_after", *first["loc"])}]) from None


def one_of_each_field(form: FormData) -> None:
    """An upload's form fields each given once: FastAPI takes the last of a field given twice (two
    `file` parts stored the second and dropped the first, unsaid)."""
    for name in dict.fromkeys(form.keys()):
        given = len(form.getlist(name))
        if given > 1:
            raise bad_request(f"{name}: given {given} times: an upload takes one", name)


def check_upload(data: bytes, settings: GatewaySettings) -> str:
    """An upload's text, within the limits: bytes, UTF-8, lines."""
    if len(data) > settings.batch_max_file_bytes:
        raise bad_request(f"the file exceeds {settings.batch_max_file_bytes} bytes", "file", "file_too_large")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the file is not UTF-8 text: {e}", "file") from None
    lines = sum(1 for line in jsonl_lines(text) if line.strip())
    if lines > settings.batch_max_lines:
        raise bad_request(
            f"the file holds {lines} requests, the limit is {settings.batch_max_lines}", "file", "too_many_lines"
        )
    return text


async def existing_batch(store: BatchStore, request: Request, batch_id: str) -> Batch:
    """The batch, if the request's tenant may see it; another tenant's is not found, as one that
    does not exist (its existence is not told)."""
    batch = await store.batch(batch_id, tenant_of(request).owns) if BATCH_ID.fullmatch(batch_id) else None
    if batch is None:
        raise not_found(f"no batch {echoed(batch_id)!r} (never created, or expired)", "batch_not_found")
    return batch


async def owned_file(store: BatchStore, request: Request, file_id: str) -> FileObject:
    file = await store.file(checked_file_id(file_id), tenant_of(request).owns)
    if file is None:
        raise file_not_found(file_id)
    return file


def checked_file_id(file_id: str) -> str:
    if not FILE_ID.fullmatch(file_id):
        raise file_not_found(file_id)
    return file_id


def file_not_found(file_id: str) -> APIError:
    return not_found(f"no file {echoed(file_id)!r} (never uploaded, deleted, or expired)", "file_not_found")


async def each(items: list[str]) -> AsyncIterator[str]:
    for item in items:
        yield item


async def encoded(pieces: AsyncIterator[str]) -> AsyncIterator[bytes]:
    async for piece in pieces:
        yield piece.encode()
