"""The Anthropic requests as pydantic models: what /v1/messages and /v1/messages/count_tokens accept.

Validation errors become one readable 400 naming every wrong field (describe_validation_error).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from slotkeeper.errors import BadRequest


class _Model(BaseModel):
    # Unknown keys (cache_control, citations, newer API fields) are accepted and ignored, as Anthropic's SDKs add
    # fields faster than any proxy can follow.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class Base64Source(_Model):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(_Model):
    type: Literal["url"]
    url: str


class ImageBlock(_Model):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class PlainTextSource(_Model):
    type: Literal["text"]
    data: str
    media_type: str = "text/plain"


class DocumentBlock(_Model):
    """Only plain-text documents: a text model cannot read a PDF."""

    type: Literal["document"]
    source: PlainTextSource


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(_Model):
    # "system" too: Claude Code sends `[user, system]` when it opens or resumes a conversation, and llama-server's own
    # /v1/messages takes it as a system message in its place.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Model):
    name: str = Field(min_length=1)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None

    @model_validator(mode="after")
    def _client_tools_only(self) -> Tool:
        if self.type not in (None, "custom"):
            raise ValueError(f"server tool type {self.type!r} is not supported; only client tools are")
        return self


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _tool_needs_name(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a 'name'")
        return self


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class Metadata(_Model):
    user_id: str | None = None


class CountTokensRequest(_Model):
    """The body of /v1/messages/count_tokens; /v1/messages adds the generation fields."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None


def parse_messages_request(body: Mapping[str, Any]) -> MessagesRequest:
    """Validate a /v1/messages body, or raise a 400 naming every field that is wrong."""
    return _validated(MessagesRequest, body)


def parse_count_tokens_request(body: Mapping[str, Any]) -> CountTokensRequest:
    return _validated(CountTokensRequest, body)


_M = TypeVar("_M", bound=BaseModel)


def _validated(model: type[_M], body: Mapping[str, Any]) -> _M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc)) from exc


def describe_validation_error(exc: ValidationError) -> str:
    """One readable line per problem, e.g. `messages.0.content: ...`, without pydantic's union-branch noise."""
    errors: list[tuple[str, str, bool]] = []
    for error in exc.errors(include_url=False):
        # Union branches appear in the location as type names (`str`, `list[...]`, `function-after[...]`).
        loc = error["loc"]
        path = ".".join(str(p) for p in loc if not (isinstance(p, str) and (p == "str" or "[" in p)))
        errors.append((path, str(error["msg"]).removeprefix("Value error, "), bool(loc) and loc[-1] == "str"))
    lines: list[str] = []
    for path, message, string_branch in errors:
        # "should be a string" says nothing useful when the list form of the same field has a deeper problem.
        if string_branch and any(other.startswith(path + ".") for other, _, _ in errors):
            continue
        line = f"{path}: {message}" if path else message
        if line not in lines:
            lines.append(line)
    return "invalid request: " + "; ".join(lines[:8])
