"""Ollama's non-streamed answers: a whole backend answer, the load/unload answer, embeddings and errors.

AnswerShape and Piece are shared with the stream encoder (dialects/ollama/stream.py), which sends the same lines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from slotkeeper.errors import SlotkeeperError


def error_body(error: SlotkeeperError) -> dict[str, Any]:
    """Ollama's error shape: a plain string under "error"."""
    return {"error": error.message}


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


# -- embeddings -------------------------------------------------------------------------------------------------------


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
