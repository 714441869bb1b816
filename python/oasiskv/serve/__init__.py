"""``oasis serve``: an OpenAI-compatible server on the continuous-batching engine.

- :mod:`~oasiskv.serve.app`: the FastAPI app (:func:`build_app`) and
  :class:`ServerThread` (uvicorn in a background thread, for tests and notebooks);
- :mod:`~oasiskv.serve.engine_loop`: the engine thread and the queues between it and HTTP;
- :mod:`~oasiskv.serve.protocol`: the OpenAI request models and response shapes;
- :mod:`~oasiskv.serve.text`: incremental detokenisation and stop strings;
- :mod:`~oasiskv.serve.metrics`: Prometheus metrics;
- :mod:`~oasiskv.serve.config`: :class:`ServeConfig` and the defaults the flags share (no FastAPI);
- :mod:`~oasiskv.serve.cli`: ``oasis serve``'s flags (importable without FastAPI).

Needs the ``serve`` extra (``pip install 'oasiskv[serve]'``: FastAPI, uvicorn, prometheus_client);
the names below are imported on first use, so ``import oasiskv.serve.cli`` works without them.
"""

from __future__ import annotations

_LAZY = {
    "ServeConfig": "config",
    "ServerThread": "app",
    "build_app": "app",
    "EngineLoop": "engine_loop",
    "EngineSnapshot": "engine_loop",
    "Overloaded": "engine_loop",
    "is_loopback": "cli",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
