"""Run an app on uvicorn with a graceful drain: :func:`serve`.

On SIGINT or SIGTERM the server stops listening, answers 503 to new requests on open
connections, lets the in-flight ones finish (at most ``drain_timeout_s``), then exits; a
second signal exits at once (uvicorn's rule).
"""

from __future__ import annotations

import socket

import uvicorn

from specdec.server.app import build_app
from specdec.server.config import ServerConfig

__all__ = ["make_server", "serve"]


class _DrainingServer(uvicorn.Server):
    """uvicorn, telling the app to refuse new work as soon as the exit signal arrives."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig, frame) -> None:
        self._state.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once shut down (SIGINT then ends in a KeyboardInterrupt
        # traceback); a server that drained as asked exits normally instead, status 0.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def make_server(generator, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> uvicorn.Server:  # fmt: skip
    """A uvicorn server of ``generator``'s app that drains on SIGINT/SIGTERM (run it with
    ``.run()``; set ``.should_exit`` to stop it from another thread). Its app is
    ``server.config.app``."""
    app = build_app(generator, config)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=config.drain_timeout_s)  # fmt: skip
    return _DrainingServer(uv_config, app.state.specdec)


def serve(generator, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None, log_level: str = "info") -> None:  # fmt: skip
    """Serve ``generator`` until SIGINT/SIGTERM, then drain and return.

    ``sock``: an already bound socket (tests bind port 0 and read the port first).
    """
    server = make_server(generator, config, host=host, port=port, log_level=log_level)
    server.run(sockets=None if sock is None else [sock])
