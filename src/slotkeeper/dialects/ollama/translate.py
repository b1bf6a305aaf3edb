"""An Ollama chat, generate or embed request as the backend's body: options, images, tools, format, think.

Pure functions: parsed requests in (dialects/ollama/requests.py), the dict for llama-server out.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from slotkeeper.dialects.ollama.requests import (
    ChatMessage,
    ChatRequest,
    EmbedRequest,
    Format,
    GenerateRequest,
    Generation,
    Think,
    keep_alive_seconds,
)
from slotkeeper.errors import BadRequest

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


def sampling(request: Generation) -> Sampling:
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


def _logprob_fields(request: Generation) -> dict[str, Any]:
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


def embed_body(request: EmbedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"input": [request.input] if isinstance(request.input, str) else list(request.input)}
    if request.dimensions is not None:
        body["dimensions"] = request.dimensions
    return body
