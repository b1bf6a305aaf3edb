"""The served model as Ollama's listings describe it: /api/tags, /api/show and /api/ps, and model names.

Built from the backend's /props and /v1/models (BackendInfo); pure functions of those values.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from slotkeeper.errors import NotFound
from slotkeeper.types import BackendInfo


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
