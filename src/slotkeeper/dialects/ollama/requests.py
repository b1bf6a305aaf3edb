"""The Ollama requests as pydantic models: what /api/chat, /api/generate and the other routes accept.

Validation errors become one readable 400 (parse); keep_alive's durations are read here too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slotkeeper.errors import BadRequest


class _Lenient(BaseModel):
    # Clients send fields we do not know (newer Ollama versions, OpenWebUI extras): accept and ignore them.
    model_config = ConfigDict(extra="allow")


class Options(_Lenient):
    """The `options` map. Known keys are typed, so a wrong type is a 400; unknown keys are kept and reported."""

    num_predict: int | None = None
    num_keep: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    num_ctx: int | None = None


class ToolFunction(_Lenient):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: int | None = None


class ToolCall(_Lenient):
    id: str | None = None
    function: ToolFunction


class ChatMessage(_Lenient):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


M = TypeVar("M", bound=BaseModel)
Format = Literal["", "json"] | dict[str, Any] | None
Think = bool | Literal["low", "medium", "high", "max", "none"] | None


class Generation(_Lenient):
    model: str = Field(min_length=1)
    stream: bool = True
    format: Format = None
    keep_alive: float | str | None = None
    options: Options = Field(default_factory=Options)
    think: Think = None
    # OpenWebUI's payload converter can put num_predict at the root as well as in options.
    num_predict: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatRequest(Generation):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template: str | None = None


class GenerateRequest(Generation):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class ModelRequest(_Lenient):
    """/api/show, /api/pull, /api/delete: the model under `model`, or the deprecated `name`."""

    model: str | None = None
    name: str | None = None
    stream: bool = True
    verbose: bool = False

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""


class EmbedRequest(_Lenient):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None


class EmbeddingsRequest(_Lenient):
    model: str = Field(min_length=1)
    prompt: str = ""


def parse(model: type[M], body: Mapping[str, Any]) -> M:
    """Validate a parsed body, or a 400 whose message names each bad field in one line."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc)) from exc


def describe_validation_error(exc: ValidationError) -> str:
    problems: list[str] = []
    for err in exc.errors():
        # Union members add their type names to the location; they mean nothing to the person reading this.
        where = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES)))
        if err["type"] == "missing":
            problems.append(f"'{where}' is required")
        else:
            problems.append(f"'{where}': {err['msg'].rstrip('.')}")
    unique = list(dict.fromkeys(problems))
    return "invalid request: " + "; ".join(unique[:5]) + ("; ..." if len(unique) > 5 else "")


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "literal", "function-after", "none"})


# -- keep_alive -------------------------------------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Seconds from a number or a duration such as "5m" or "1h30m"; None when absent. Negative means forever."""
    if value is None or isinstance(value, float | int):
        return None if value is None else float(value)
    text = value.strip()
    if not text:
        return None
    try:
        return float(text)  # a number in a string is seconds, as Ollama reads it
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if text[0] in "+-" else text
    parts = _DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise BadRequest(f"keep_alive {value!r} is not a duration (use seconds, or a value such as \"5m\" or \"1h\")")
    return sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def unloads(request: Generation) -> bool:
    seconds = keep_alive_seconds(request.keep_alive)
    return seconds is not None and seconds == 0
