"""Ollama-compatible routes (/, /api/version, /api/tags, /api/show, /api/ps, /api/chat, /api/generate, ...)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
