"""The embedded SGLang-compatible inference server (CPU, or CUDA when present).

``python -m arealite.server --model-path P --port N`` serves a Hugging Face
causal LM over SGLang's HTTP protocol subset (see docs/internals.md), with
continuous batching on a dedicated model thread. In-process use:
``create_server(ServerArgs(...))`` + ``build_app(server)``, or ``serve(args)``.
"""

from .args import ServerArgs, parse_args
from .app import ENGINE_NAME, EmbeddedServer, build_app, create_server, serve

__all__ = ["ServerArgs", "parse_args", "EmbeddedServer", "build_app", "create_server", "serve",
           "ENGINE_NAME"]
