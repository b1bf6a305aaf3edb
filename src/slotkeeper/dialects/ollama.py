"""The Ollama dialect: /api/chat and /api/generate translated to and from the backend's OpenAI-style API.

Pure functions and value types: they read parsed values and return new ones; they never do I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slotkeeper.dialects.framing import UpstreamEvent
from slotkeeper.errors import BadRequest, NotFound, SlotkeeperError
from slotkeeper.types import BackendInfo

# -- errors -----------------------------------------------------------------------------------------------------------


def error_body(error: SlotkeeperError) -> dict[str, Any]:
    """Ollama's error shape: a plain string under "error"."""
    return {"error": error.message}


def error_line(error: SlotkeeperError) -> bytes:
    """An error after the stream has started: one final NDJSON line (the status is already 200)."""
    return ndjson(error_body(error))


def ndjson(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


# -- request models ---------------------------------------------------------------------------------------------------


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


class _Generation(_Lenient):
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


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template: str | None = None


class GenerateRequest(_Generation):
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


# -- model names ------------------------------------------------------------------------------------------------------


def advertised_name(model_id: str) -> str:
    """The served model as Ollama names it: `name:tag`, the tag `latest` unless the id has one."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else f"{model_id}:latest"


def is_served(requested: str, model_id: str) -> bool:
    """The bare name and `name:latest` both name the served model."""
    return requested in (model_id, advertised_name(model_id)) or requested.removesuffix(":latest") == model_id


def model_not_found(requested: str, served: str | None = None) -> NotFound:
    hint = f": slotkeeper serves only '{served}' and does not download models" if served else ""
    return NotFound(f"model '{requested}' not found{hint}")


# -- describing the served model (/api/tags, /api/show, /api/ps) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What Ollama's model listings say about a model, gathered from the backend's /props and /v1/models."""

    name: str
    architecture: str
    n_ctx_slot: int
    n_params: int
    size: int
    quantization: str
    template: str
    capabilities: tuple[str, ...]
    modified_at: str
    digest: str
    stop: str


def model_facts(backend: BackendInfo, architecture: str | None, modified_at: str) -> ModelFacts:
    props, meta = backend.props, backend.meta
    caps = props.get("chat_template_caps") or {}
    template = str(props.get("chat_template") or "")
    capabilities = ["completion"]
    if caps.get("supports_tools"):
        capabilities.append("tools")
    if (props.get("modalities") or {}).get("vision"):
        capabilities.append("vision")
    if caps.get("supports_reasoning_effort") or "enable_thinking" in template or "<think>" in template:
        capabilities.append("thinking")
    return ModelFacts(
        name=advertised_name(backend.model_id), architecture=architecture or "unknown",
        n_ctx_slot=backend.n_ctx_slot, n_params=int(meta.get("n_params") or 0), size=int(meta.get("size") or 0),
        quantization=quantization_level(str(props.get("model_ftype") or meta.get("ftype") or "")),
        template=template, capabilities=tuple(capabilities), modified_at=modified_at,
        digest=hashlib.sha256(backend.fingerprint.encode()).hexdigest(), stop=str(props.get("eos_token") or ""),
    )


def quantization_level(ftype: str) -> str:
    """llama.cpp's file type name ("Q4_K - Medium") in Ollama's spelling ("Q4_K_M")."""
    words = {"Small": "S", "Medium": "M", "Large": "L"}
    parts = [p.strip() for p in ftype.split(" - ")]
    return "_".join(words.get(p, p) for p in parts if p)


def parameter_size(n_params: int) -> str:
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 2)):
        if n_params >= scale:
            return f"{n_params / scale:.{digits}f}{unit}"
    return str(n_params)


def model_details(facts: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": facts.architecture, "families": [facts.architecture],
            "parameter_size": parameter_size(facts.n_params), "quantization_level": facts.quantization}


def tags_entry(facts: ModelFacts) -> dict[str, Any]:
    return {"name": facts.name, "model": facts.name, "modified_at": facts.modified_at, "size": facts.size,
            "digest": facts.digest, "details": model_details(facts), "capabilities": list(facts.capabilities)}


def show_answer(facts: ModelFacts) -> dict[str, Any]:
    arch = facts.architecture
    parameters = [f"num_ctx {facts.n_ctx_slot}"] + ([f"stop {json.dumps(facts.stop)}"] if facts.stop else [])
    return {
        "modelfile": f"# served by slotkeeper from llama-server\nFROM {facts.name}\n"
                     + "".join(f"PARAMETER {p}\n" for p in parameters),
        "parameters": "\n".join(parameters),
        "template": facts.template,
        "details": model_details(facts),
        # Clients (Maki, OpenWebUI) read the usable context from here: it is the per-slot size, not the training one.
        "model_info": {"general.architecture": arch, "general.parameter_count": facts.n_params,
                       f"{arch}.context_length": facts.n_ctx_slot},
        "capabilities": list(facts.capabilities),
        "modified_at": facts.modified_at,
    }


def ps_entry(facts: ModelFacts, expires_at: str) -> dict[str, Any]:
    return {"name": facts.name, "model": facts.name, "size": facts.size, "digest": facts.digest,
            "details": model_details(facts), "expires_at": expires_at, "size_vram": 0,
            "context_length": facts.n_ctx_slot}


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


def unloads(request: _Generation) -> bool:
    seconds = keep_alive_seconds(request.keep_alive)
    return seconds is not None and seconds == 0


# -- options ----------------------------------------------------------------------------------------------------------

# Ollama option name -> the backend's sampling field of the same meaning.
_SAMPLING = {
    "num_keep": "n_keep", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "typical_p": "typical_p", "repeat_last_n": "repeat_last_n", "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
    "mirostat": "mirostat", "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta",
}
# Fixed when llama-server starts (context size, threads, GPU layers...): they cannot change per request.
LAUNCH_TIME_OPTIONS = frozenset({
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread", "numa", "low_vram",
    "f16_kv", "vocab_only", "embedding_only", "logits_all", "draft_num_predict",
})


@dataclass(frozen=True, slots=True)
class Sampling:
    """The backend's sampling fields for one request, and the Ollama options that had no per-request meaning."""

    fields: dict[str, Any]
    ignored: tuple[str, ...] = ()


def sampling(request: _Generation) -> Sampling:
    """Raises BadRequest for a keep_alive that is not a duration, so every generating request checks it."""
    keep_alive_seconds(request.keep_alive)
    opts = request.options
    fields: dict[str, Any] = {}
    num_predict = opts.num_predict if opts.num_predict is not None else request.num_predict
    if num_predict is not None:
        # -2 is Ollama's "fill the context"; llama-server's -1 (until the context is full) is the same thing.
        fields["n_predict"] = -1 if num_predict == -2 else num_predict
    for name, upstream in _SAMPLING.items():
        value = getattr(opts, name)
        if value is not None:
            fields[upstream] = value
    if opts.stop is not None:
        fields["stop"] = [opts.stop] if isinstance(opts.stop, str) else list(opts.stop)
    ignored = [name for name in ("num_ctx",) if getattr(opts, name) is not None]
    ignored += sorted((opts.model_extra or {}).keys())
    return Sampling(fields, tuple(ignored))


# -- chat and generate -> upstream bodies -----------------------------------------------------------------------------


def check_images(images: Sequence[str], vision: bool) -> None:
    if images and not vision:
        raise BadRequest("this model cannot read images: the backend has no vision projector "
                         "(start llama-server with --mmproj for a vision model)")


def all_images(request: ChatRequest | GenerateRequest) -> list[str]:
    if isinstance(request, GenerateRequest):
        return list(request.images or [])
    return [image for m in request.messages for image in (m.images or [])]


def image_url(image: str) -> str:
    """Ollama sends raw base64; the backend wants a data URL with the image's real type."""
    if image.startswith("data:"):
        return image
    try:
        head = base64.b64decode(image[:24] + "=" * (-len(image[:24]) % 4), validate=False)
    except (binascii.Error, ValueError):
        head = b""
    return f"data:{_sniff_mime(head)};base64,{image}"


def _sniff_mime(head: bytes) -> str:
    if head.startswith(b"\x89PNG"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith(b"GIF8"):
        return "image/gif"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"BM"):
        return "image/bmp"
    return "image/jpeg"


def upstream_message(message: ChatMessage) -> dict[str, Any]:
    """One Ollama message as an OpenAI chat message (tool arguments become JSON strings, images content parts)."""
    out: dict[str, Any] = {"role": message.role.lower()}
    text = message.content or ""
    if message.images:
        out["content"] = [{"type": "text", "text": text}] if text else []
        out["content"] += [{"type": "image_url", "image_url": {"url": image_url(i)}} for i in message.images]
    else:
        out["content"] = text
    if message.thinking:
        out["reasoning_content"] = message.thinking
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id or f"call_{i}", "type": "function",
             "function": {"name": call.function.name, "arguments": arguments_text(call.function.arguments)}}
            for i, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_name:
        out["name"] = message.tool_name
    return out


def arguments_text(arguments: Mapping[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def arguments_object(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """OpenAI's argument string as Ollama's object. Text that is not a JSON object is kept under `_raw_arguments`
    rather than lost (Ollama clients require an object here)."""
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        parsed = json.loads(text)
    except ValueError:
        return {"_raw_arguments": text}
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": text}


def _format_fields(fmt: Format, route: Literal["chat", "completion"]) -> dict[str, Any]:
    if fmt is None or fmt == "":
        return {}
    schema: dict[str, Any] | None = None if fmt == "json" else dict(fmt)
    if route == "completion":
        return {"json_schema": schema if schema is not None else {"type": "object"}}
    if schema is None:
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}}


def _think_fields(think: Think) -> dict[str, Any]:
    if think is None:
        return {}
    if think is False or think == "none":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if think is True:
        return {"chat_template_kwargs": {"enable_thinking": True}}
    return {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": think}}


def _logprob_fields(request: _Generation) -> dict[str, Any]:
    if not request.logprobs and not request.top_logprobs:
        return {}
    return {"logprobs": True, "top_logprobs": max(request.top_logprobs or 0, 1)}


def chat_body(request: ChatRequest, opts: Sampling) -> dict[str, Any]:
    """The backend's /v1/chat/completions body for an Ollama chat (without id_slot and cache_prompt)."""
    body: dict[str, Any] = {"messages": [upstream_message(m) for m in request.messages], "stream": request.stream}
    if request.tools:
        body["tools"] = request.tools
    return {**body, **opts.fields, **_format_fields(request.format, "chat"), **_think_fields(request.think),
            **_logprob_fields(request)}


def generate_messages(request: GenerateRequest) -> list[ChatMessage]:
    """A templated generate is a chat of (system,) user prompt."""
    messages = [ChatMessage(role="system", content=request.system)] if request.system else []
    return [*messages, ChatMessage(role="user", content=request.prompt, images=request.images)]


def check_generate(request: GenerateRequest) -> None:
    if request.raw and (request.template or request.system or request.context):
        raise BadRequest("raw mode does not support template, system or context")
    if request.suffix:
        raise BadRequest("suffix (fill-in-the-middle) is not supported by slotkeeper; send the prompt alone")
    if request.raw and request.images:
        raise BadRequest("images are not supported in raw mode; send them without raw")
    if request.context:
        # The backend's chat route cannot take token ids, and templated prompts go through it.
        raise BadRequest("context (token ids of an earlier answer) is not supported; send the conversation as "
                         "messages to /api/chat instead")


def generate_body(request: GenerateRequest, opts: Sampling) -> tuple[str, dict[str, Any]]:
    """The backend path and body for an Ollama generate: raw prompts go to /completion untemplated, the rest
    through the chat template as a (system,) user chat."""
    if request.raw:
        body = {"prompt": request.prompt, "stream": request.stream, **opts.fields,
                **_format_fields(request.format, "completion")}
        return "/completion", body
    chat = ChatRequest(model=request.model, messages=generate_messages(request), stream=request.stream,
                       format=request.format, think=request.think, logprobs=request.logprobs,
                       top_logprobs=request.top_logprobs)
    return "/v1/chat/completions", chat_body(chat, opts)


# -- answers ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Metrics:
    """The final line's numbers, mapped the way Ollama maps llama-server's timings (durations in ns)."""

    total_ns: int
    load_ns: int
    prompt_eval_count: int = 0
    prompt_eval_ns: int = 0
    eval_count: int = 0
    eval_ns: int = 0

    @classmethod
    def of(cls, timings: Mapping[str, Any] | None, total_ns: int, load_ns: int) -> Metrics:
        t = timings or {}
        return cls(
            total_ns=total_ns, load_ns=load_ns,
            # Ollama counts the whole prompt, the part served from the cache included.
            prompt_eval_count=int(t.get("cache_n", 0)) + int(t.get("prompt_n", 0)),
            prompt_eval_ns=round(float(t.get("prompt_ms", 0.0)) * 1e6),
            eval_count=int(t.get("predicted_n", 0)),
            eval_ns=round(float(t.get("predicted_ms", 0.0)) * 1e6),
        )

    def fields(self) -> dict[str, int]:
        return {"total_duration": self.total_ns, "load_duration": self.load_ns,
                "prompt_eval_count": self.prompt_eval_count, "prompt_eval_duration": self.prompt_eval_ns,
                "eval_count": self.eval_count, "eval_duration": self.eval_ns}


def done_reason(finish_reason: object = None, stop_type: object = None) -> str:
    """`length` when the token limit or the context ended the answer, otherwise `stop` (tool calls included)."""
    return "length" if finish_reason == "length" or stop_type == "limit" else "stop"


def load_answer(kind: Literal["chat", "generate"], model: str, created_at: str, unload: bool) -> dict[str, Any]:
    """The answer to an empty chat or prompt: Ollama's "load the model" request (or unload, with keep_alive 0)."""
    body: dict[str, Any] = {"model": model, "created_at": created_at}
    body.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
    return {**body, "done": True, "done_reason": "unload" if unload else "load"}


def tool_calls_out(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        entry: dict[str, Any] = {"function": {"index": i, "name": function.get("name") or "",
                                              "arguments": arguments_object(function.get("arguments"))}}
        if call.get("id"):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def logprobs_out(logprobs: object) -> list[dict[str, Any]] | None:
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list):
        return None
    return [{"token": item.get("token", ""), "logprob": item.get("logprob", 0.0),
             "top_logprobs": [{"token": t.get("token", ""), "logprob": t.get("logprob", 0.0)}
                              for t in item.get("top_logprobs") or []]}
            for item in content if isinstance(item, Mapping)]


@dataclass
class Piece:
    """Generated output in dialect-neutral form: one stream step or a whole answer."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class AnswerShape:
    """How one request's answers look: `message` for chat, `response` for generate; the model echoed as asked."""

    def __init__(self, kind: Literal["chat", "generate"], model: str) -> None:
        self.kind = kind
        self.model = model

    def line(self, piece: Piece, created_at: str) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": created_at}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": piece.content}
            if piece.thinking:
                message["thinking"] = piece.thinking
            if piece.tool_calls:
                message["tool_calls"] = piece.tool_calls
            out["message"] = message
        else:
            out["response"] = piece.content
            if piece.thinking:
                out["thinking"] = piece.thinking
            if piece.tool_calls:
                out["tool_calls"] = piece.tool_calls
        if piece.logprobs:
            out["logprobs"] = piece.logprobs
        return {**out, "done": False}

    def final(self, piece: Piece, created_at: str, reason: str, metrics: Metrics) -> dict[str, Any]:
        return {**self.line(piece, created_at), "done": True, "done_reason": reason, **metrics.fields()}


def unary_answer(shape: AnswerShape, data: Mapping[str, Any], created_at: str, total_ns: int,
                 load_ns: int) -> dict[str, Any]:
    """A whole backend answer (/v1/chat/completions or /completion) as one Ollama object."""
    timings = data.get("timings") if isinstance(data.get("timings"), Mapping) else None
    metrics = Metrics.of(timings, total_ns, load_ns)
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        choice = choices[0]
        message = choice.get("message") or {}
        piece = Piece(str(message.get("content") or ""), str(message.get("reasoning_content") or ""),
                      tool_calls_out(message.get("tool_calls") or []), logprobs_out(choice.get("logprobs")))
        return shape.final(piece, created_at, done_reason(choice.get("finish_reason")), metrics)
    piece = Piece(str(data.get("content") or ""))
    return shape.final(piece, created_at, done_reason(stop_type=data.get("stop_type")), metrics)


class StreamEncoder:
    """Re-frames the backend's stream events as Ollama NDJSON objects, one `feed` per event.

    Content and thinking go out as they come; tool-call fragments are gathered and sent as one line when the
    answer ends (Ollama clients want whole argument objects); `finish` gives the single `done: true` line.
    """

    def __init__(self, shape: AnswerShape) -> None:
        self.shape = shape
        self.reason: str | None = None
        self.timings: dict[str, Any] | None = None
        self.failed = False
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, event: UpstreamEvent, created_at: str) -> list[dict[str, Any]]:
        if not isinstance(event, dict) or self.failed:
            return []  # keep-alive comments have no NDJSON form
        if "error" in event:
            self.failed = True
            return [{"error": _error_text(event["error"])}]
        if isinstance(event.get("timings"), dict):
            self.timings = event["timings"]
        choices = event.get("choices")
        if isinstance(choices, list):
            return self._chat_event(choices, created_at)
        if "content" in event or "stop" in event:
            return self._completion_event(event, created_at)
        return []

    def _chat_event(self, choices: list[Any], created_at: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in choices:
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                self._gather(call)
            piece = Piece(str(delta.get("content") or ""), str(delta.get("reasoning_content") or ""),
                          logprobs=logprobs_out(choice.get("logprobs")))
            if piece.content or piece.thinking or piece.logprobs:
                out.append(self.shape.line(piece, created_at))
            if choice.get("finish_reason"):
                self.reason = done_reason(choice["finish_reason"])
                if self._calls:
                    calls = [self._calls[i] for i in sorted(self._calls)]
                    out.append(self.shape.line(Piece(tool_calls=tool_calls_out(calls)), created_at))
                    self._calls = {}
        return out

    def _gather(self, call: Mapping[str, Any]) -> None:
        index = int(call.get("index") or 0)
        slot = self._calls.setdefault(index, {"id": None, "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""

    def _completion_event(self, event: Mapping[str, Any], created_at: str) -> list[dict[str, Any]]:
        content = str(event.get("content") or "")
        out = [self.shape.line(Piece(content), created_at)] if content else []
        if event.get("stop"):
            self.reason = done_reason(stop_type=event.get("stop_type"))
        return out

    def finish(self, created_at: str, total_ns: int, load_ns: int) -> list[dict[str, Any]]:
        """The `done: true` line, unless the stream already ended with an error line."""
        if self.failed:
            return []
        metrics = Metrics.of(self.timings, total_ns, load_ns)
        return [self.shape.final(Piece(), created_at, self.reason or "stop", metrics)]


def _error_text(error: object) -> str:
    if isinstance(error, Mapping):
        return str(error.get("message") or error)
    return str(error)


# -- embeddings -------------------------------------------------------------------------------------------------------


def embed_body(request: EmbedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"input": [request.input] if isinstance(request.input, str) else list(request.input)}
    if request.dimensions is not None:
        body["dimensions"] = request.dimensions
    return body


def _vectors(data: Mapping[str, Any]) -> list[list[float]]:
    items = [d for d in data.get("data") or [] if isinstance(d, Mapping)]
    return [list(d.get("embedding") or []) for d in sorted(items, key=lambda d: int(d.get("index") or 0))]


def embed_answer(model: str, data: Mapping[str, Any], total_ns: int) -> dict[str, Any]:
    usage = data.get("usage") or {}
    return {"model": model, "embeddings": _vectors(data), "total_duration": total_ns, "load_duration": 0,
            "prompt_eval_count": int(usage.get("prompt_tokens") or 0)}


def embeddings_answer(data: Mapping[str, Any]) -> dict[str, Any]:
    vectors = _vectors(data)
    return {"embedding": vectors[0] if vectors else []}
