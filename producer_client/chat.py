"""The wire models of a chat: its messages (with the assistant's reasoning and tool calls, and the
tools' answers), the tools a job offers the model, and which of them it may or must call. OpenAI's
shapes, so that a message the gateway returned can be sent back as history unchanged."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

T = TypeVar("T")

MAX_TOOLS = 128  # OpenAI's bound on `tools`
# OpenAI's rule for a function's name; it also keeps names free of the characters that would let a
# name break out of the chat template's JSON.
FUNCTION_NAME_CHARS = 64
FUNCTION_NAME = re.compile(rf"[A-Za-z0-9_-]{{1,{FUNCTION_NAME_CHARS}}}")


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionSpec(Wire):
    """What the model is told about a function: rendered into the prompt by the chat template."""

    # The length bound besides the pattern's: a name too long is refused as too long (pydantic
    # checks it first), not as a name of other characters.
    name: str = Field(pattern=f"^{FUNCTION_NAME.pattern}$", max_length=FUNCTION_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None


class Tool(Wire):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(Wire):
    name: str
    arguments: str  # a JSON object, as text: the model's own output, which the caller should check


class ToolCall(Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionName(Wire):
    name: str


class NamedToolChoice(Wire):
    """OpenAI's `{"type": "function", "function": {"name": ...}}`: the model must call that one."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(Wire):
    """One message of a conversation. An assistant message may carry the reasoning it showed
    (`reasoning_content`) and the calls it made (`tool_calls`, content then optional); a `tool`
    message answers one of those calls (`tool_call_id`). Each rule is checked on its field, after
    the fields it depends on, so that an error names the field."""

    role: Literal["system", "user", "assistant", "tool"]
    reasoning_content: str | None = Field(None, validate_default=True)
    tool_calls: list[ToolCall] | None = Field(None, validate_default=True)
    tool_call_id: str | None = Field(None, validate_default=True)
    content: str | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("reasoning_content", "tool_calls")
    @classmethod
    def _assistant_only(cls, value: T, info: ValidationInfo) -> T:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("belongs to assistant messages only")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _on_tool_messages(cls, value: str | None, info: ValidationInfo) -> str | None:
        if (value is not None) != (info.data.get("role") == "tool"):
            raise ValueError("is required on tool messages, and only there")
        return value

    @field_validator("content")
    @classmethod
    def _given(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("is required (only an assistant message with tool_calls may leave it out)")
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: Qwen3's renders `arguments` text as is."""
        return self.model_dump(exclude_none=True)


def tool_names(tools: list[Tool]) -> list[str]:
    return [tool.function.name for tool in tools]


def tool_call_id(job_id: str, index: int) -> str:
    """The id of a job's index-th tool call: the same for whoever reads the job, streamed or not,
    and however often, so that a retried request gets the ids it got before."""
    return "call_" + hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]
