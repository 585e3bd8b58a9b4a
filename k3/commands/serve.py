"""`k3 serve MODEL`: an OpenAI-compatible HTTP server with continuous batching
(docs/SERVER.md; the library is k3.server).

One background thread owns the engine, loaded for --max-batch sequences at --max-context
positions each (the memory plan covers them, and a plan that does not fit is refused
before anything listens: exit 1); requests join the batch and leave it between steps.
stdout gets the URL and a curl example once it listens; stderr the plan and notes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .. import interrupt
from ..errors import EXIT_OK, EXIT_RUNTIME, K3Error, UsageError
from .common import (CompileReport, add_budget_args, add_model_args, add_prompt_cache_args, add_sampling_args,
                     add_spec_args, budgets_from_args, check_model_dir, check_prompt_cache_args, err, sampling_from_args,
                     spec_corpus_from_args, load_options)

HELP = "serve the model over OpenAI- and Anthropic-compatible HTTP APIs (continuous batching)"
DESCRIPTION = ("Serve MODEL over HTTP: /v1/chat/completions, /v1/completions (streaming or not), /v1/messages "
               "(Anthropic's Messages API), /v1/models, /health, /metrics. Requests are decoded together, joining and "
               "leaving the batch between steps; --spec drafts tokens per sequence and verifies them in the same pass.")
DEFAULT_MAX_BATCH = 4
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_CONTEXT = 4096
DEFAULT_MAX_BODY = 1 << 20
DEFAULT_PREFIX_ENTRIES = 16
DEFAULT_PREFIX_GB = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder (config.json, shards, tiktoken.model)")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    net.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every request (401 "
                     "otherwise)")
    net.add_argument("--api-key-file", metavar="FILE", help="read the API key from this file (keeps it out of the "
                     "process list)")
    net.add_argument("--served-model-name", metavar="NAME", help="the model id clients use (default: the folder's "
                     "name)")
    lim = p.add_argument_group("batching and limits")
    lim.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                     help=f"most requests decoded together (default {DEFAULT_MAX_BATCH}); the memory plan holds N "
                          "sequences at --max-context")
    lim.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                     help=f"most requests waiting for a slot (default {DEFAULT_MAX_QUEUE}); more get 429")
    lim.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT, metavar="N",
                     help=f"most positions (prompt + answer) of one request (default {DEFAULT_MAX_CONTEXT})")
    lim.add_argument("--max-tokens", type=int, default=None, metavar="N",
                     help="most tokens one answer may ask for (default: the rest of the context)")
    lim.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, metavar="N",
                     help=f"largest request body (default {DEFAULT_MAX_BODY}); larger gets 413")
    lim.add_argument("--prefix-cache", type=int, default=DEFAULT_PREFIX_ENTRIES, metavar="N",
                     help=f"states kept for prefix reuse (default {DEFAULT_PREFIX_ENTRIES}; 0: off)")
    lim.add_argument("--prefix-cache-gb", type=float, default=DEFAULT_PREFIX_GB, metavar="X",
                     help=f"most memory the kept states may hold (default {DEFAULT_PREFIX_GB:g} GB; less when the "
                          "memory plan leaves less)")
    chat = p.add_argument_group("chat")
    chat.add_argument("--no-think", action="store_true", help="thinking off unless a request asks for it")
    chat.add_argument("--thinking-effort", choices=("low", "medium", "high", "max"), default="max",
                      help="K3 thinking effort when a request does not give reasoning_effort (default max)")
    chat.add_argument("--format", choices=("auto", "xtml", "jinja"), default="auto",
                      help="chat format: K3 XTML or the folder's Jinja chat_template (default: by model)")
    add_prompt_cache_args(p)
    add_model_args(p)
    add_sampling_args(p)
    add_spec_args(p)
    add_budget_args(p)


def _api_key(args) -> str | None:
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError("give --api-key or --api-key-file, not both.")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: cannot read it ({e}).") from None
    if key is not None and (not key or any(c.isspace() for c in key) or not key.isprintable()):
        raise UsageError("the API key must be non-empty printable text without spaces.")
    return key


def _check(args) -> None:
    check_model_dir(args.model)
    for flag, v, lo in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                        ("--max-context", args.max_context, 2), ("--max-body-bytes", args.max_body_bytes, 1024),
                        ("--prefix-cache", args.prefix_cache, 0)):
        if v < lo:
            raise UsageError(f"{flag} must be >= {lo}, got {v}.")
    if args.max_tokens is not None and not 1 <= args.max_tokens < args.max_context:
        raise UsageError(f"--max-tokens must be in 1..{args.max_context - 1} (below --max-context), "
                         f"got {args.max_tokens}.")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}.")
    if not args.prefix_cache_gb >= 0:
        raise UsageError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}.")
    check_prompt_cache_args(args)


def run(args) -> int:
    from ..config import check_layers, load_config
    from .. import env
    from ..decode import set_threads
    from ..loader import load
    from ..server.app import Server, bind, is_loopback, make_server
    from ..server.metrics import Metrics
    from ..server.protocol import ModelContext, ServeDefaults, prepare_constraints
    from ..server.scheduler import Scheduler
    from ..units import human

    _check(args)
    key = _api_key(args)
    budgets = budgets_from_args(args)
    kw = {k: getattr(args, k) for k in ("kv", "prefill_chunk") if getattr(args, k, None) is not None}
    if args.spec:  # the memory plan holds the drafts of every sequence in the batch
        kw["spec"] = args.spec
    launch = env.launch()
    if launch is not None and launch[0]:  # a pipeline rank other than 0: rank 0 serves HTTP, this one its layers
        set_threads(args.threads)
        return load(args.model, load_options(args, budgets, max_context=args.max_context, max_batch=args.max_batch,
                                             **kw)).serve_stage()
    cfg = load_config(args.config or args.model)
    check_layers(cfg, args.layers)
    sampling_from_args(args, args.model)  # the flags and generation_config.json are checked now, not per request
    defaults = ServeDefaults(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                             greedy=args.greedy, thinking=not args.no_think, thinking_effort=args.thinking_effort,
                             max_tokens=args.max_tokens)
    name = args.served_model_name or Path(args.model).resolve().name
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise K3Error(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}). Choose another --port (or "
                      "stop what uses it).") from None
    sched = None
    try:
        err(cfg.summary())
        if args.layers is not None:
            err(f"WARNING: --layers {args.layers}: only the first {args.layers} of {cfg.num_hidden_layers} layers run. "
                "Output is NOT the full model.")
        say = (lambda m="": err(m)) if args.verbose else (lambda m="": err(m) if m.startswith(("auto:", "ultra:", "note:",
                                                                                             "pipeline:")) else None)
        metrics = Metrics()
        t0 = time.perf_counter()
        report = CompileReport()
        opts = load_options(args, budgets, max_context=args.max_context, max_batch=args.max_batch, **kw)
        sched = Scheduler(lambda: load(args.model, opts, log=say, notice=report.notice,
                                       compile_progress=report.progress),
                          max_queue=args.max_queue, metrics=metrics, prefix_entries=args.prefix_cache,
                          threads=args.threads, log=err, prompt_cache=args.prompt_cache,
                          prompt_cache_bytes=int(args.prompt_cache_gb * 1e9))
        try:
            try:
                eng = sched.start()  # a plan that does not fit raises here, before anything is served
            finally:
                report.close()
        except K3Error as e:
            if str(e).startswith("REFUSING"):  # the KV cache alone, or the whole plan: a refusal to start, exit 1
                raise K3Error(f"{e}\nk3 serve: the memory plan covers --max-batch {args.max_batch} sequences of "
                              f"--max-context {args.max_context} positions each; lower either.", EXIT_RUNTIME) from None
            raise
        if not args.verbose:
            err(eng.plan.summary())
        eng.check_spec(args.spec)
        sched.spec, sched.spec_corpus = args.spec, spec_corpus_from_args(args, eng.tokenizer)
        room = max(0, int(0.95 * eng.plan.available) - eng.plan.total) if eng.plan.available else 1 << 62
        sched.prefix_bytes = min(int(args.prefix_cache_gb * 1e9), room)
        if sched.prefix is not None and sched.prefix.memory is not None:
            sched.prefix.memory.max_bytes = sched.prefix_bytes
        ctx = ModelContext(name, args.model, eng.cfg, eng.tokenizer, eng.max_context, defaults, chat_kind=args.format)
        prepare_constraints(ctx)   # the grammar engine's tables now, not on the first constrained request
        if eng.tokenizer is None:
            err(f"note: {args.model} has no usable tokenizer ({eng.tokenizer_error or 'no tiktoken.model'}): only "
                "/v1/completions with token ids will work.")
        state = {"signals": 0}

        def on_signal(sig, first):
            state["signals"] += 1
            if first:
                sched.drain()
                err(f"\nk3 serve: draining - {sched.active} in flight, {sched.queued} queued; new requests are "
                    "refused (Ctrl-C again to stop at once)")
            else:
                err("\nk3 serve: stopping now")
                sched.stop(now=True, timeout=0)

        app = Server(sched, ctx, metrics, api_key=key, max_body=args.max_body_bytes, log=err)
        server, serve = make_server(app, sock, verbose=args.verbose, on_signal=on_signal)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}"
        err(f"k3 serve: {name} loaded in {time.perf_counter() - t0:.1f} s | up to {eng.max_batch} requests together, "
            f"{eng.max_context} positions each, {args.max_queue} queued | prefix cache "
            f"{'off' if not args.prefix_cache else f'{args.prefix_cache} states, {human(sched.prefix_bytes)}'}"
            f"{f' + {args.prompt_cache} (disk)' if args.prompt_cache else ''}"
            f"{' | API key required' if key else ''}")
        if not is_loopback(args.host) and not key:
            err(f"WARNING: listening on {args.host} without --api-key: anyone who can reach this port can use it.")
        auth = ' -H "Authorization: Bearer $K3_API_KEY"' if key else ""
        body = '{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}]}' % name.replace('"', '\\"')
        interrupt.check()  # a signal before this line: 130 / 143 (after it: a drained stop, make_server)
        print(f"k3 serve: listening on {url}/v1 (Ctrl-C drains and stops)", flush=True)
        print(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
              flush=True)
        serve()
    except BaseException:
        # a Ctrl-C / SIGTERM before the server listened (k3.interrupt: raised before the
        # listening line), or a failure: the engine thread stops with the process
        if sched is not None and sched.engine is not None:
            sched.stop(now=True, timeout=5.0)
        raise
    finally:
        sock.close()
    forced = server.force_exit or state["signals"] > 1
    sched.stop(now=forced, timeout=0)
    deadline = time.monotonic() + 5.0
    while sched.thread.is_alive() and not (forced and time.monotonic() > deadline):
        sched.thread.join(0.1)
        if not forced and interrupt.pending() is not None:  # a signal once uvicorn let go of them: stop at once
            forced, deadline = True, time.monotonic() + 5.0
            err("\nk3 serve: stopping now")
            sched.stop(now=True, timeout=0)
    err(f"k3 serve: stopped ({sched.served} requests served)")
    if sched.error is not None and not isinstance(sched.error, KeyboardInterrupt):
        raise K3Error(f"the engine thread failed: {sched.error}")
    return (interrupt.exit_code() if interrupt.pending() is not None else 130) if forced else EXIT_OK

