"""llama-server's own dialect (/infill, /completion, /tokenize, /props, /slots...), for the tools that speak it:
llama.vim and llama.vscode autocomplete, Maki's llama.cpp provider.

The backend speaks it natively, so most of it is a pass-through; what is here is what slotkeeper decides itself: the
checks it makes before a slot is taken, `response_fields` applied on our side (so that the turn's timings are seen),
the read-only view of /props, the /slots view from the pool, and errors in llama-server's shape
(`{"error": {"code", "message", "type"}}`). Pure functions: they never do I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from slotkeeper.errors import BadRequest, SlotkeeperError, UpstreamError

# -- errors -----------------------------------------------------------------------------------------------------------

# llama-server's error types (server-common.h, error_type), by the status slotkeeper answers with.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 501: "not_supported_error", 502: "unavailable_error", 503: "unavailable_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(error: SlotkeeperError) -> dict[str, Any]:
    """`{"error": {"code", "message", "type"}}` as llama-server answers its errors. The backend's own error is
    passed on as it came, with `code` and `type` added where it lacks them."""
    if isinstance(error, UpstreamError):
        try:
            parsed = json.loads(error.body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            detail = dict(parsed["error"])
            detail.setdefault("code", error.status_code)
            if not isinstance(detail.get("message"), str):
                detail["message"] = error.message
            detail.setdefault("type", error_type(error.status_code))
            return {**parsed, "error": detail}
    return {"error": {"code": error.status_code, "message": error.message, "type": error_type(error.status_code)}}


def error_event(error: SlotkeeperError) -> bytes:
    """An error after a stream started: one `data:` event, as the backend sends one."""
    return b"data: " + json.dumps(error_body(error)).encode("utf-8") + b"\n\n"


# -- checks before a slot is taken ------------------------------------------------------------------------------------


def check_infill_request(body: Mapping[str, Any]) -> None:
    """What llama-server's /infill requires (it answers a 500 for some of it, after a slot was taken)."""
    for field in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(field), str):
            raise BadRequest(f'"{field}" is required and must be a string')
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise BadRequest('"prompt" must be a string')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise BadRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("text"), str):
            raise BadRequest('each "input_extra" chunk must have a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise BadRequest('an "input_extra" chunk\'s "filename" must be a string')


def check_completion_request(body: Mapping[str, Any]) -> None:
    if "prompt" not in body:
        raise BadRequest('"prompt" is required')


# -- response_fields --------------------------------------------------------------------------------------------------


def response_fields(body: Mapping[str, Any]) -> list[str] | None:
    """The request's `response_fields`, when it is a list of strings (llama-server ignores any other value)."""
    fields = body.get("response_fields")
    if isinstance(fields, list) and all(isinstance(f, str) for f in fields) and fields:
        return fields
    return None


def select_fields(answer: Any, fields: Sequence[str] | None) -> Any:
    """llama-server's `response_fields` on a final answer (json_get_nested_values): only the listed paths, a path
    with slashes taken from inside nested objects and put at the top under its whole name, missing ones left out.
    An array of answers (several completions) is filtered one by one."""
    if fields is None:
        return answer
    if isinstance(answer, list):
        return [select_fields(a, fields) for a in answer]
    if not isinstance(answer, dict):
        return answer
    selected: dict[str, Any] = {}
    for path in fields:
        current: Any = answer
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            selected[path] = current
    return selected


class FinalEventFilter:
    """Applies `response_fields` to the final event (`"stop": true`) of a /completion or /infill stream, as the
    backend does when it is asked to; every other event passes unchanged, as soon as it is complete."""

    def __init__(self, fields: Sequence[str]) -> None:
        self._fields = fields
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        complete, self._pending = data[:end + 2], data[end + 2:]
        return b"".join(self._event(e) for e in complete.split(b"\n\n")[:-1])

    def finish(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data:") and b'"stop"' in event:
            try:
                parsed = json.loads(event[5:])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and parsed.get("stop") is True:
                return b"data: " + json.dumps(select_fields(parsed, self._fields)).encode("utf-8") + b"\n\n"
        return event + b"\n\n"


# -- the read-only views ----------------------------------------------------------------------------------------------

# The props a client may read: the model, its context and template, the server's build and switches. Anything else
# (a newer build's field) is left out until it is known not to carry another request's text.
_PROPS_KEPT = frozenset({
    "default_generation_settings", "total_slots", "model_alias", "model_ftype", "model_path", "modalities",
    "media_marker", "endpoint_slots", "endpoint_props", "endpoint_metrics", "ui", "ui_settings", "chat_template",
    "chat_template_caps", "chat_template_tool_use", "bos_token", "eos_token", "build_info", "is_sleeping", "role",
    "n_ctx", "webui", "cors_proxy_enabled",
})
# default_generation_settings: older builds put slot 0's state there (its prompt, its next token...).
_GENERATION_KEPT = frozenset({"n_ctx", "params", "model"})
# Sampling parameters that can hold a request's own text (a slot's last task on older builds).
_PARAMS_DROPPED = frozenset({
    "prompt", "generation_prompt", "grammar", "grammar_triggers", "preserved_tokens", "stop", "logit_bias",
    "json_schema", "response_fields", "lora", "dry_sequence_breakers",
})


def props_view(props: Mapping[str, Any], n_ctx_slot: int) -> dict[str, Any]:
    """The backend's /props minus whatever could show another session's request or reach the slot actions: only the
    known top-level fields, and of the generation settings only the context and the sampling defaults (without the
    fields that can hold text). A top-level `n_ctx` (the context of one slot) is added where the backend gives
    none, for clients that read it there (Maki)."""
    view = {k: v for k, v in props.items() if k in _PROPS_KEPT}
    settings = props.get("default_generation_settings")
    if isinstance(settings, Mapping):
        kept = {k: v for k, v in settings.items() if k in _GENERATION_KEPT}
        params = kept.get("params")
        if isinstance(params, Mapping):
            kept["params"] = {k: v for k, v in params.items() if k not in _PARAMS_DROPPED}
        kept.setdefault("n_ctx", n_ctx_slot)
        view["default_generation_settings"] = kept
    else:
        view["default_generation_settings"] = {"n_ctx": n_ctx_slot}
    if not isinstance(view.get("n_ctx"), int):
        view["n_ctx"] = view["default_generation_settings"].get("n_ctx", n_ctx_slot)
    return view


def slots_view(slots: Iterable[tuple[int, bool, int]], n_ctx_slot: int) -> list[dict[str, Any]]:
    """GET /slots from slotkeeper's own view, never the backend's (which shows each slot's prompt): for each slot
    (id, busy, tokens held) its id, context, whether it is processing, and how many tokens it holds."""
    return [{"id": slot_id, "n_ctx": n_ctx_slot, "is_processing": busy, "n_tokens": n_tokens}
            for slot_id, busy, n_tokens in slots]
