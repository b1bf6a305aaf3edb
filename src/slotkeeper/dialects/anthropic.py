"""The Anthropic dialect: /v1/messages translated to and from the backend's /v1/chat/completions.

Pure: request models and functions read parsed values and return new ones; the stream encoder is a state machine
over already-parsed upstream events. No I/O, no clock, no randomness (ids are handed in).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from slotkeeper.dialects.framing import KeepAlive, UpstreamEvent
from slotkeeper.errors import BadRequest, SlotkeeperError, UpstreamError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}

# llama-server's own sampling and template fields a client may add (SDKs pass them with extra_body); forwarded as
# they are. Anthropic-only fields (service_tier, container, ...) are not: the backend has no use for them.
PASSTHROUGH_FIELDS: frozenset[str] = frozenset({
    "chat_template_kwargs", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
    "frequency_penalty", "seed", "ignore_eos", "n_probs", "samplers", "thinking_budget_tokens",
    "reasoning_budget_tokens", "reasoning_effort", "reasoning_format", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau",
    "mirostat_eta", "sse_ping_interval",
})


def error_body(error: SlotkeeperError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    # Anthropic uses invalid_request_error "for other 4XX status codes not listed" as well.
    fallback = "invalid_request_error" if 400 <= error.status_code < 500 else "api_error"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status_code, fallback),
                                       "message": error.message}}


# -- request models ----------------------------------------------------------------------------------------------


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
    role: Literal["user", "assistant"]
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


# -- request translation -----------------------------------------------------------------------------------------


def system_texts(request: CountTokensRequest) -> list[str]:
    """The system prompt's texts in order, for the session rules (a changed system prompt is another session)."""
    if request.system is None:
        return []
    if isinstance(request.system, str):
        return [request.system]
    return [block.text for block in request.system]


def metadata_user_id(request: MessagesRequest) -> str | None:
    return request.metadata.user_id if request.metadata is not None else None


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's system and messages as OpenAI chat messages, in the order the model will read them."""
    out: list[dict[str, Any]] = []
    system = system_texts(request)
    if any(system):
        out.append({"role": "system", "content": _text_content([t for t in system if t])})
    for message in request.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant_message(message.content))
        else:
            out.extend(_user_messages(message.content))
    return out


def _text_content(texts: list[str]) -> str | list[dict[str, Any]]:
    # One text stays a plain string (what every template can render); several become parts, joined by the backend.
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


def _image_part(block: ImageBlock) -> dict[str, Any]:
    source = block.source
    url = source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _parts_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(p["type"] == "text" for p in parts):
        return _text_content([p["text"] for p in parts])
    return parts


def _user_messages(blocks: Sequence[ContentBlock]) -> list[dict[str, Any]]:
    # OpenAI wants tool results right after the assistant's tool calls, so they come before the user's other parts.
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            tool_messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                  "content": _tool_result_content(block)})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, DocumentBlock):
            parts.append({"type": "text", "text": block.source.data})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block))
        # thinking blocks in a user turn carry nothing the model should read
    if parts or not tool_messages:
        tool_messages.append({"role": "user", "content": _parts_content(parts) if parts else ""})
    return tool_messages


def _tool_result_content(block: ToolResultBlock) -> str | list[dict[str, Any]]:
    if isinstance(block.content, str):
        return block.content
    parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else _image_part(b) for b in block.content]
    return _parts_content(parts) if parts else ""


def _assistant_message(blocks: Sequence[ContentBlock]) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            tool_calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        # redacted thinking is encrypted for Anthropic's own models: nothing a local model can read
    message: dict[str, Any] = {"role": "assistant", "content": _text_content(texts) if texts else ""}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in tools]


def _tool_choice_fields(choice: ToolChoice) -> dict[str, Any]:
    # llama-server takes only "auto" | "required" | "none": a named tool becomes "required" over the same tool list
    # (narrowing the list would change the prompt, and with it the cached prefix of every later turn).
    mapped = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}[choice.type]
    fields: dict[str, Any] = {"tool_choice": mapped}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def count_tokens_body(request: CountTokensRequest) -> dict[str, Any]:
    """The chat body whose prompt the backend counts for /v1/messages/count_tokens."""
    body: dict[str, Any] = {"messages": chat_messages(request)}
    if request.tools:
        body["tools"] = chat_tools(request.tools)
    return body


def chat_body(request: MessagesRequest, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The backend's /v1/chat/completions body for a /v1/messages request (our slot fields are added later).

    Besides the translation it asks for two read-only extras: `return_progress` on streams (prompt progress chunks,
    turned into `ping` events during a long prefill) and `verbose` when there are stop sequences (the backend names
    the stop word it hit only there, and Anthropic reports it).
    """
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request),
                            "max_tokens": request.max_tokens, "stream": request.stream}
    if request.stop_sequences:
        body["stop"] = list(request.stop_sequences)
        body["verbose"] = True
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = chat_tools(request.tools)
        if request.tool_choice is not None:
            body.update(_tool_choice_fields(request.tool_choice))
    if request.thinking is not None:
        if request.thinking.type == "enabled" and request.thinking.budget_tokens is not None:
            body["thinking_budget_tokens"] = request.thinking.budget_tokens
        elif request.thinking.type == "disabled":
            body["reasoning_effort"] = "none"
    body.update({k: v for k, v in raw.items() if k in PASSTHROUGH_FIELDS})
    if request.stream:
        body["return_progress"] = True
    return body


# -- responses ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """Anthropic's token counts: input_tokens excludes what was read from the cache (cache_read_input_tokens)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cache_read_input_tokens": self.cache_read_input_tokens, "cache_creation_input_tokens": 0}


def usage_from(data: Mapping[str, Any]) -> Usage | None:
    """Token counts from a backend answer or chunk: its `timings` (always on the last one), else its `usage`."""
    timings = data.get("timings")
    if isinstance(timings, Mapping) and "prompt_n" in timings:
        return Usage(int(timings.get("prompt_n", 0)), int(timings.get("predicted_n", 0)),
                     int(timings.get("cache_n", 0)))
    usage = data.get("usage")
    if isinstance(usage, Mapping) and "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = int(details.get("cached_tokens", 0)) if isinstance(details, Mapping) else 0
        return Usage(int(usage["prompt_tokens"]) - cached, int(usage.get("completion_tokens", 0)), cached)
    return None


def stop_reason(finish_reason: object, stopping_word: object, stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the backend's finish_reason and the stop word it reported."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    # The template's own end markers are stop words too; only the client's count as a stop sequence.
    if isinstance(stopping_word, str) and stopping_word and stopping_word in stop_sequences:
        return "stop_sequence", stopping_word
    return "end_turn", None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _first_choice(data: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = data.get("choices")
    return _mapping(choices[0]) if isinstance(choices, list) and choices else {}


def _stopping_word(data: Mapping[str, Any]) -> object:
    verbose = data.get("__verbose")
    return verbose.get("stopping_word") if isinstance(verbose, Mapping) else None


def tool_input(arguments: object) -> dict[str, Any]:
    """A tool call's arguments string as Anthropic's input object; text that is not a JSON object is kept whole."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": arguments}


def to_message(data: Mapping[str, Any], *, message_id: str, model: str,
               stop_sequences: Sequence[str] = ()) -> dict[str, Any]:
    """A backend chat completion as an Anthropic message."""
    choice = _first_choice(data)
    message = _mapping(choice.get("message"))
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for i, call in enumerate(message.get("tool_calls") or []):
        function = _mapping(_mapping(call).get("function"))
        content.append({"type": "tool_use", "id": _mapping(call).get("id") or f"toolu_{message_id}_{i}",
                        "name": function.get("name", ""), "input": tool_input(function.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), _stopping_word(data), stop_sequences)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": (usage_from(data) or Usage()).as_dict()}


# -- streaming ---------------------------------------------------------------------------------------------------


def sse(event: Mapping[str, Any]) -> bytes:
    """One Anthropic SSE event: an `event:` line naming data.type (the SDK skips events without one)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def error_event(error: SlotkeeperError) -> bytes:
    return sse(error_body(error))


def upstream_error(event: Mapping[str, Any]) -> SlotkeeperError:
    """The backend's mid-stream `{"error": {...}}` event as an error with its status."""
    inner = event.get("error")
    code = inner.get("code") if isinstance(inner, Mapping) else None
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    return UpstreamError(status, json.dumps(event).encode())


class MessageStreamEncoder:
    """Turns the backend's chat stream into Anthropic's event sequence.

    message_start goes out with the first upstream event (with return_progress on, that is the first progress chunk,
    sent as soon as the prompt starts processing, so its counts are known); every progress chunk and backend
    keep-alive becomes a `ping`; text, thinking and each tool call become blocks with contiguous indices; finish()
    closes the open block and sends message_delta (stop reason, final usage) and message_stop.
    """

    def __init__(self, message_id: str, model: str, stop_sequences: Sequence[str] = ()) -> None:
        self.message_id = message_id
        self.model = model
        self.stop_sequences = tuple(stop_sequences)
        self._started = False
        self._ended = False
        self._index = -1  # index of the open block, or of the last closed one
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._tool_index: object = None  # the backend's index of the open tool call
        self._tool_id: object = None
        self._finish_reason: object = None
        self._stopping_word: object = None
        self._usage: Usage | None = None

    def feed(self, event: UpstreamEvent) -> bytes:
        if self._ended:
            return b""
        if isinstance(event, KeepAlive):
            return self._start() + sse({"type": "ping"})
        if "error" in event:
            return self.fail(upstream_error(event))
        out = [self._start(event)]
        if (word := _stopping_word(event)) is not None:
            self._stopping_word = word
        self._usage = usage_from(event) or self._usage
        if "prompt_progress" in event:
            out.append(sse({"type": "ping"}))
        choice = _first_choice(event)
        delta = _mapping(choice.get("delta"))
        if isinstance(reasoning := delta.get("reasoning_content"), str) and reasoning:
            out.append(self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if isinstance(text := delta.get("content"), str) and text:
            out.append(self._open_block("text", {"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            out.append(self._tool_call(call))
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
        return b"".join(out)

    def finish(self) -> bytes:
        """The end of the backend's stream: close the message, or report an answer that never finished."""
        if self._ended:
            return b""
        if self._finish_reason is None:
            return self.fail(SlotkeeperError("the backend ended the stream before the answer was complete"))
        self._ended = True
        reason, sequence = stop_reason(self._finish_reason, self._stopping_word, self.stop_sequences)
        usage = (self._usage or Usage()).as_dict()
        return b"".join([self._start(), self._close_block(),
                         sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                              "usage": usage}),
                         sse({"type": "message_stop"})])

    def fail(self, error: SlotkeeperError) -> bytes:
        """An error after the response started: one `event: error`, and nothing after it."""
        if self._ended:
            return b""
        self._ended = True
        return error_event(error)

    def _start(self, first: Mapping[str, Any] | None = None) -> bytes:
        if self._started:
            return b""
        self._started = True
        usage = Usage()
        progress = first.get("prompt_progress") if first is not None else None
        if isinstance(progress, Mapping):
            cached = int(progress.get("cache", 0))
            usage = Usage(int(progress.get("total", 0)) - cached, 0, cached)
        return sse({"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage.as_dict()}})

    def _open_block(self, kind: str, block: dict[str, Any]) -> bytes:
        if self._open == kind and kind != "tool_use":
            return b""
        closed = self._close_block()
        self._index += 1
        self._open = kind
        return closed + sse({"type": "content_block_start", "index": self._index, "content_block": block})

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        self._tool_index = self._tool_id = None
        return sse({"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _tool_call(self, call: object) -> bytes:
        if not isinstance(call, Mapping):
            return b""
        function = _mapping(call.get("function"))
        out = b""
        # The backend streams tool calls one after another, each starting with its id and name; a new index (or a
        # new id) starts the next tool_use block. Blocks cannot be reopened, and the backend never goes back.
        index, call_id = call.get("index", 0), call.get("id")
        if self._open != "tool_use" or index != self._tool_index or (call_id and call_id != self._tool_id):
            block_id = call_id or f"toolu_{self.message_id}_{self._index + 1}"
            out += self._open_block("tool_use", {"type": "tool_use", "id": block_id,
                                                 "name": function.get("name") or "", "input": {}})
            self._tool_index, self._tool_id = index, block_id
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            out += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return out
