"""`cupyllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra) over N slots with
continuous batching (engine.py) and llama.cpp-style introspection (/props, /slots, /metrics). docs/server.md."""
from .engine import Engine, QueueFull, Request, Result

__all__ = ["Engine", "QueueFull", "Request", "Result", "create_app"]


def create_app(model, parallel: int = 1, **options):
    """The FastAPI app serving `model` (a cupyllm.Model) with `parallel` slots; options: app.create_app's."""
    from .app import create_app as _create_app
    return _create_app(model, parallel=parallel, **options)
