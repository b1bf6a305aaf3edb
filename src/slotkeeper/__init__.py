"""slotkeeper: a session-aware KV-cache proxy for llama.cpp's llama-server.

It keeps each conversation's slot state hot in a slot while in use and on disk when not, across restarts.
"""

__version__ = "0.1.0"
