"""``tgraph serve``: an OpenAI-compatible HTTP server over an :class:`~tgraph.runtime.llm.LLM`.

``build_app`` makes the ASGI application (FastAPI); ``serve`` runs it with uvicorn until SIGINT or
SIGTERM, then drains the requests in flight and closes the model.
"""
from __future__ import annotations

from tgraph.serve.app import ServerConfig, build_app
from tgraph.serve.server import ServerThread, serve

__all__ = ["ServerConfig", "ServerThread", "build_app", "serve"]
