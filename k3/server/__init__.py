"""`k3 serve`: an OpenAI-compatible HTTP server with continuous batching (docs/SERVER.md).

* :mod:`k3.server.protocol` - the OpenAI request checks (with OpenAI-style error
  bodies), prompt rendering (chat formats, tools), sampling per request, and the answer
  builders (``reasoning_content``, ``tool_calls``, stop strings). No web stack. It
  re-exports them from :mod:`~k3.server.checks`, :mod:`~k3.server.chat`,
  :mod:`~k3.server.constraints`, :mod:`~k3.server.completions`,
  :mod:`~k3.server.tool_calls` and :mod:`~k3.server.answers`.
* :mod:`k3.server.scheduler` - the one thread that owns the engine: it loads it, admits
  requests into one :class:`k3.decode.Batch` between steps, frees a slot as soon as a
  client goes away, and keeps finished states for prefix reuse (the engine's
  :mod:`k3.prompt_cache`, memory tier and, with --prompt-cache, disk tier).
* :mod:`k3.server.metrics` - counters and their Prometheus text.
* :mod:`k3.server.app` - the ASGI application (Starlette) and the uvicorn server that
  drains on Ctrl-C.

Only :mod:`k3.server.app` imports the web stack; :mod:`k3.commands.serve` imports it
inside ``run()``, so `k3 --help` stays cheap.
"""
