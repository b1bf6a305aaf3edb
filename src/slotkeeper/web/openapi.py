"""What /openapi.json says: request bodies, answer content types and each dialect's error shape, declared by hand.

The routes read their raw bodies themselves, so that bad input is answered in the client's own dialect rather than
with FastAPI's 422; FastAPI therefore cannot infer any of this from their parameters. The schema is what the API fuzz
tests (tests/protocol/test_openapi_fuzz.py) generate requests from and check answers against.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from slotkeeper.web.errors import Dialect, dialect_of

JSON = "application/json"

# -- error shapes -----------------------------------------------------------------------------------------------------


class OllamaError(BaseModel):
    error: str


class OpenAIErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")  # a backend's own error passes through with its extra fields

    message: str
    type: str


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class LlamaErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: int
    message: str
    type: str


class LlamaError(BaseModel):
    """llama-server's own error shape."""

    error: LlamaErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


_ERROR_MODELS: dict[Dialect, type[BaseModel]] = {
    Dialect.OLLAMA: OllamaError, Dialect.ANTHROPIC: AnthropicError, Dialect.OPENAI: OpenAIError,
    Dialect.LLAMA: LlamaError, Dialect.OURS: OpenAIError,
}

# -- request bodies and answers, for the route decorators -------------------------------------------------------------


def json_body(schema: type[BaseModel] | dict[str, Any], description: str = "") -> dict[str, Any]:
    """`openapi_extra` declaring a required JSON body: a pydantic model's schema (references inlined) or a schema."""
    resolved = _inlined(schema.model_json_schema()) if isinstance(schema, type) else schema
    body: dict[str, Any] = {"required": True, "content": {JSON: {"schema": resolved}}}
    if description:
        body["description"] = description
    return {"requestBody": body}


def answers(*media_types: str) -> dict[int | str, dict[str, Any]]:
    """`responses` for a route whose 200 comes in any of these content types (JSON, or a stream when asked)."""
    return {200: {"description": "the answer", "content": {m: {} for m in media_types}}}


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A model schema with its `$defs` references replaced by the definitions: a request body in OpenAPI cannot
    point into its own `$defs`. Discriminator mappings name those definitions too, so they go (the `oneOf` stays,
    and each branch's constant `type` still tells the branches apart)."""
    definitions: dict[str, Any] = schema.get("$defs", {})

    def resolve(value: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(value, list):
            return [resolve(v, seen) for v in value]
        if not isinstance(value, dict):
            return value
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            assert name not in seen, f"the schema of a recursive model ({name}) cannot be inlined"
            return resolve(definitions[name], (*seen, name))
        return {k: resolve(v, seen) for k, v in value.items() if k not in ("$defs", "discriminator")}

    resolved: dict[str, Any] = resolve(schema, ())
    return resolved


# -- the whole document -----------------------------------------------------------------------------------------------


class SlotkeeperAPI(FastAPI):
    """FastAPI whose OpenAPI document also declares every operation's errors in the shape its path's dialect renders
    them (any 4xx or 5xx, the guard's 401, 403 and 413 included), and drops FastAPI's 422, which no route here
    ever answers."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            with warnings.catch_warnings():
                # FastAPI gives every method of a multi-method route the same operation id, and warns; _unique_ids
                # below names them apart.
                warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
                document = super().openapi()
            _unique_ids(document)
            _declare_errors(document)
        assert self.openapi_schema is not None
        return self.openapi_schema


def _unique_ids(document: dict[str, Any]) -> None:
    seen: set[str] = set()
    for operations in document.get("paths", {}).values():
        for method, operation in operations.items():
            name = operation.get("operationId")
            if name in seen:
                operation["operationId"] = name = f"{name}_{method}"
            seen.add(name)


def _declare_errors(document: dict[str, Any]) -> None:
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for model in set(_ERROR_MODELS.values()):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in document.get("paths", {}).items():
        model = _ERROR_MODELS[dialect_of(path)]
        error = {"content": {JSON: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses.setdefault("4XX", {"description": f"refused (bad input, key, Host, size, route), in the "
                                                        f"{model.__name__} shape", **error})
            responses.setdefault("5XX", {"description": f"server or backend failure, in the {model.__name__} shape",
                                         **error})
