"""Layer 10, ``moeforge serve``: an OpenAI-compatible HTTP server over ``LLMEngine`` (FastAPI + uvicorn), with
Prometheus metrics. ``create_app`` builds the app over an engine; ``serve`` runs an artifact until SIGTERM.

Modules: protocol (request/response bodies), engine_loop (the one thread that drives the engine), streams
(loop thread -> asyncio bridge, admission), logprobs (logprobs in the API's shapes; the text comes from the
engine's RequestOutput), serving (the generation endpoints), api_errors (OpenAI error bodies), metrics
(Prometheus), app (the FastAPI app), connections (limits on connections before a request exists),
lingering_close (a connection answered before its body ended reads the rest before it closes), listener (the
listening sockets, bound before the model loads), runner (uvicorn, signals).
"""

from moeforge.serve.app import ServerConfig, create_app
from moeforge.serve.runner import ServeOptions, serve

__all__ = ["ServeOptions", "ServerConfig", "create_app", "serve"]
