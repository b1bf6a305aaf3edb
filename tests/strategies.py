"""Hypothesis strategies for request bodies: any JSON-like value, valid requests of each dialect, and near-valid ones
(a valid request with exactly one thing broken: a value of the wrong type, a deleted key, an extra level of nesting).

Valid bodies hold only what JSON can carry (finite numbers, real characters); the broken ones may hold anything
Python's json module produces or accepts, NaN and lone surrogates included.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from typing import Any

from hypothesis import strategies as st


def examples(n: int) -> int:
    """n examples, times SLOTKEEPER_FUZZ_SCALE for a deeper run than the suite's (e.g. SLOTKEEPER_FUZZ_SCALE=20)."""
    return n * int(os.environ.get("SLOTKEEPER_FUZZ_SCALE", "1"))


# -- any JSON-like value ----------------------------------------------------------------------------------------------

# Lone UTF-16 surrogates: valid \uXXXX escapes in JSON text, but not characters (no UTF-8 form).
SURROGATES = st.characters(categories=["Cs"])
ODD_TEXT = st.text(st.characters() | SURROGATES, max_size=12)
EXTREME_NUMBERS = st.sampled_from([
    0, -1, 2**31, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 1e308, -1e308, 5e-324, float("nan"), float("inf"),
    float("-inf"),
])
ODD_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | EXTREME_NUMBERS | ODD_TEXT
               | st.sampled_from(["", " ", "\x00", "\ud800", "\udfff", "null", "{}", "[]"]))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(ODD_TEXT, children, max_size=4)


ANY_VALUE: st.SearchStrategy[Any] = st.recursive(ODD_SCALARS, _containers, max_leaves=16)
ANY_OBJECT: st.SearchStrategy[dict[str, Any]] = st.dictionaries(ODD_TEXT, ANY_VALUE, max_size=6)

# What JSON itself can carry, for the valid bodies.
TEXT = st.text(max_size=24)
NAME = st.text(min_size=1, max_size=12)
# Session ids may not hold control characters (a documented 400), and surrounding spaces are trimmed.
SESSION_ID = st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=12)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**63) | FINITE | TEXT
JSON_VALUE: st.SearchStrategy[Any] = st.recursive(
    JSON_SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=8)
JSON_OBJECT: st.SearchStrategy[dict[str, Any]] = st.dictionaries(TEXT, JSON_VALUE, max_size=4)

_PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(24)).decode()
_JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + bytes(24)).decode()
# Real image headers, text that is no base64 at all, data URLs, and an image without data.
IMAGE = st.sampled_from([_PNG, _JPEG, "not base64!", "", "data:image/png;base64,AAAA", "iVBOR"]) | TEXT

# -- Ollama /api/chat and /api/generate -------------------------------------------------------------------------------

OLLAMA_ROLES = st.sampled_from(["system", "user", "assistant", "tool", "USER", "Assistant"]) | NAME
OLLAMA_ARGUMENTS = JSON_OBJECT | TEXT | st.sampled_from(['{"a": 1}', "{not json", "[1, 2]", "null", ""])
OLLAMA_TOOL_CALL = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": TEXT}, optional={"arguments": OLLAMA_ARGUMENTS,
                                                                 "index": st.integers(0, 8)})},
    optional={"id": TEXT},
)
OLLAMA_MESSAGE = st.fixed_dictionaries(
    {"role": OLLAMA_ROLES},
    optional={"content": TEXT | st.none(), "thinking": TEXT, "images": st.lists(IMAGE, max_size=2),
              "tool_calls": st.lists(OLLAMA_TOOL_CALL, max_size=2), "tool_name": TEXT, "tool_call_id": TEXT,
              "x_unknown": JSON_VALUE},
)
OLLAMA_OPTIONS = st.fixed_dictionaries({}, optional={
    "num_predict": st.integers(-2, 10**6), "num_keep": st.integers(-1, 64), "temperature": FINITE,
    "top_k": st.integers(0, 100), "top_p": FINITE, "min_p": FINITE, "repeat_penalty": FINITE,
    "seed": st.integers(-1, 2**32), "stop": st.lists(TEXT, max_size=3) | TEXT, "num_ctx": st.integers(1, 10**6),
    "mirostat": st.integers(0, 2), "num_thread": st.integers(1, 64), "tfs_z": FINITE, "some_new_option": JSON_VALUE,
})
KEEP_ALIVE = (st.none() | st.integers(-10, 10**6) | FINITE
              | st.sampled_from(["5m", "1h30m", "-1", "0", "10s", "1.5h", "", " 300 ", "250ms", "-1m"]))
FORMAT = st.none() | st.sampled_from(["", "json"]) | JSON_OBJECT
THINK = st.none() | st.booleans() | st.sampled_from(["low", "medium", "high", "max", "none"])
_GENERATION_FIELDS = {
    "stream": st.booleans(), "format": FORMAT, "keep_alive": KEEP_ALIVE, "options": OLLAMA_OPTIONS, "think": THINK,
    "num_predict": st.integers(-2, 10**6), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
}

OLLAMA_CHAT = st.fixed_dictionaries(
    {"model": NAME, "messages": st.lists(OLLAMA_MESSAGE, max_size=5)},
    optional={**_GENERATION_FIELDS, "tools": st.lists(JSON_OBJECT, max_size=2), "template": TEXT},
)
# Only the combinations slotkeeper serves: raw prompts alone, templated ones with a system prompt and images.
OLLAMA_GENERATE = st.fixed_dictionaries(
    {"model": NAME, "prompt": TEXT}, optional={**_GENERATION_FIELDS, "raw": st.just(False), "system": TEXT,
                                               "template": TEXT, "images": st.lists(IMAGE, max_size=2)},
) | st.fixed_dictionaries({"model": NAME, "prompt": TEXT, "raw": st.just(True)}, optional=_GENERATION_FIELDS)

# -- Anthropic /v1/messages -------------------------------------------------------------------------------------------

TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}, optional={"cache_control": JSON_OBJECT})
IMAGE_BLOCK = st.fixed_dictionaries({"type": st.just("image"), "source": st.one_of(
    st.fixed_dictionaries({"type": st.just("base64"), "media_type": st.sampled_from(["image/png", "image/jpeg"]),
                           "data": IMAGE}),
    st.fixed_dictionaries({"type": st.just("url"), "url": TEXT}),
)})
DOCUMENT_BLOCK = st.fixed_dictionaries({"type": st.just("document"), "source": st.fixed_dictionaries(
    {"type": st.just("text"), "data": TEXT}, optional={"media_type": st.just("text/plain")})})
TOOL_USE_BLOCK = st.fixed_dictionaries({"type": st.just("tool_use"), "id": NAME, "name": NAME, "input": JSON_OBJECT})
TOOL_RESULT_BLOCK = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": NAME},
    optional={"content": TEXT | st.lists(TEXT_BLOCK | IMAGE_BLOCK, max_size=2), "is_error": st.booleans()},
)
THINKING_BLOCK = st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT},
                                       optional={"signature": TEXT})
REDACTED_BLOCK = st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": TEXT})
USER_BLOCK = TEXT_BLOCK | IMAGE_BLOCK | DOCUMENT_BLOCK | TOOL_RESULT_BLOCK
ASSISTANT_BLOCK = TEXT_BLOCK | TOOL_USE_BLOCK | THINKING_BLOCK | REDACTED_BLOCK
ANTHROPIC_MESSAGE = (
    st.fixed_dictionaries({"role": st.just("user"), "content": TEXT | st.lists(USER_BLOCK, max_size=3)})
    | st.fixed_dictionaries({"role": st.just("assistant"), "content": TEXT | st.lists(ASSISTANT_BLOCK, max_size=3)})
)
ANTHROPIC_TOOL = st.fixed_dictionaries({"name": NAME}, optional={"description": TEXT, "input_schema": JSON_OBJECT,
                                                                 "type": st.just("custom")})
TOOL_CHOICE = (st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])},
                                     optional={"disable_parallel_tool_use": st.booleans()})
               | st.fixed_dictionaries({"type": st.just("tool"), "name": NAME}))
ANTHROPIC_COUNT_TOKENS = st.fixed_dictionaries(
    {"model": TEXT, "messages": st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=4)},
    optional={"system": TEXT | st.lists(TEXT_BLOCK, max_size=2), "tools": st.lists(ANTHROPIC_TOOL, max_size=2),
              "tool_choice": TOOL_CHOICE, "thinking": st.one_of(
                  st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                                        optional={"budget_tokens": st.integers(0, 10**5)}))},
)
ANTHROPIC_MESSAGES = st.builds(
    lambda base, extra: {**base, **extra}, ANTHROPIC_COUNT_TOKENS,
    st.fixed_dictionaries({"max_tokens": st.integers(1, 10**6)}, optional={
        "stop_sequences": st.lists(TEXT, max_size=3), "stream": st.booleans(), "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1), "top_k": st.integers(0, 100), "metadata": st.fixed_dictionaries(
            {}, optional={"user_id": TEXT}), "seed": st.integers(0, 2**32), "min_p": FINITE,
        "chat_template_kwargs": JSON_OBJECT, "service_tier": TEXT,
    }),
)

# -- OpenAI /v1/chat/completions (passed through: only `messages` is checked) ----------------------------------------

OPENAI_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": OLLAMA_ROLES, "content": TEXT}), min_size=1, max_size=4)},
    optional={"model": TEXT, "stream": st.booleans(), "temperature": FINITE, "max_tokens": st.integers(1, 4096),
              "session_id": SESSION_ID, "id_slot": st.integers(-1, 8), "cache_prompt": st.booleans(),
              "tools": st.lists(JSON_OBJECT, max_size=2)},
)

# -- one thing broken -------------------------------------------------------------------------------------------------

WRONG_VALUES = ANY_VALUE | st.sampled_from([None, True, -1, 0, 2**64, 1e308, float("nan"), float("inf"), "", [], {},
                                            "\ud800", [[]], {"": None}, [{}], "5m", {"type": "unknown"}])


def _locations(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a value: the root, each dict key and each list index, depth first."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _locations(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _locations(item, (*path, index))
    return found


@st.composite
def broken(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A valid body with one thing broken at one place: replaced by any value, deleted, wrapped in a list or an
    object, or joined by a key nobody knows."""
    body = copy.deepcopy(draw(valid))
    path = draw(st.sampled_from(_locations(body)))
    how = draw(st.sampled_from(["replace", "delete", "wrap-list", "wrap-object", "unknown-key"]))
    old = _get(body, path)
    if how == "unknown-key" and isinstance(old, dict):
        old[draw(ODD_TEXT)] = draw(WRONG_VALUES)
        return body
    if how == "delete" and path:
        parent = _get(body, path[:-1])
        del parent[path[-1]]
        return body
    if how == "wrap-list":
        return _set(body, path, [old])
    if how == "wrap-object":
        return _set(body, path, {"value": old})
    return _set(body, path, draw(WRONG_VALUES))


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _set(body: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    _get(body, path[:-1])[path[-1]] = new
    return body


def as_json(body: Any) -> bytes:
    """The bytes a client would send: Python's json.dumps, which writes NaN and escapes lone surrogates."""
    return json.dumps(body).encode("ascii")
