"""An OpenAI-compatible HTTP server over a :class:`~specdec.Generator` (the ``serve`` extra).

``specdec serve MODEL`` runs it from the command line; :func:`build_app` gives the ASGI app
for any server, :func:`serve` runs it on uvicorn with a graceful drain. See docs/serving.md.
"""

from specdec.server.app import build_app
from specdec.server.config import ServerConfig
from specdec.server.run import make_server, serve

__all__ = ["ServerConfig", "build_app", "make_server", "serve"]
