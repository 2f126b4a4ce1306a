"""The Batch API's shapes, as OpenAI's SDK reads them and its OpenAPI spec states them: the file
object, the batch object (its statuses, timestamps and request counts) and their lists. A field
the spec makes optional and not nullable is left out while it has no value."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from openai_format.batch_lines import LineErrorBody
from openai_format.requests import Metadata
from openai_format.responses import Omitted

BatchStatus = Literal[
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
]
# A batch in one of these has ended: its driver is done with it, and it expires after batch_ttl_s.
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


class Shape(BaseModel):
    model_config = ConfigDict(frozen=True)


class FileObject(Shape):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"


class FileDeleted(Shape):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ExpiresAfter(Shape):
    """OpenAI's expiration policy of a file (an upload's `expires_after`, a batch's
    `output_expires_after`): `seconds` after the file's creation, from an hour to 30 days."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class CreateBatch(Shape):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None


class RequestCounts(Shape):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrors(Shape):
    object: Literal["list"] = "list"
    data: list[LineErrorBody]


class Batch(Shape):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = Omitted
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = Omitted
    error_file_id: str | None = Omitted
    created_at: int
    in_progress_at: int | None = Omitted
    expires_at: int
    finalizing_at: int | None = Omitted
    completed_at: int | None = Omitted
    failed_at: int | None = Omitted
    expired_at: int | None = Omitted
    cancelling_at: int | None = Omitted
    cancelled_at: int | None = Omitted
    request_counts: RequestCounts
    metadata: dict[str, str] | None = Omitted

    def fields(self) -> dict[str, str | int]:
        """The batch's hash: what from_fields reads back."""
        fields: dict[str, str | int] = {
            k: v for k, v in self.model_dump(exclude={"errors", "metadata", "request_counts"}).items() if v is not None
        }
        fields.update(self.request_counts.model_dump())
        if self.metadata is not None:
            fields["metadata"] = json.dumps(self.metadata)
        if self.errors is not None:
            fields["errors"] = self.errors.model_dump_json()
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> Batch:
        """From the batch's hash: JSON for the nested fields, numbers as Redis keeps them."""
        nested = {"errors", "metadata"}
        counts = {"total", "completed", "failed"}
        values: dict[str, Any] = {k: v for k, v in fields.items() if k in cls.model_fields and k not in nested}
        for name in nested & fields.keys():
            values[name] = json.loads(fields[name])
        values["request_counts"] = RequestCounts(**{k: int(fields.get(k, 0)) for k in counts})
        return cls.model_validate(values)


class BatchList(Shape):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = Omitted
    last_id: str | None = Omitted
    has_more: bool


class FileList(Shape):
    """The spec requires first_id and last_id as strings, which an empty list has none of: null then."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
