"""The `k3` command line: command names mapped to the modules of k3.commands, and the
one wrapper that turns errors into exit codes.

Each command module has ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``
(and optionally ``DESCRIPTION`` / ``EPILOG``); none imports torch at import time, so
`k3 --help` stays fast. Generated text goes to stdout; banners, plans and statistics to
stderr, so the output can be piped. User mistakes end with one clear paragraph and a
documented exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import env, interrupt
from .version import __version__
from .errors import EXIT_CHECKPOINT, EXIT_OK, EXIT_PIPELINE, EXIT_READ, EXIT_RUNTIME, EXIT_USAGE, K3Error

#: command name -> module in k3.commands, in the order `k3 --help` lists them
COMMANDS = {
    "run": "run",
    "chat": "chat",
    "serve": "serve",
    "synth": "synth",
    "pack-trunk": "pack_trunk",
    "doctor": "doctor",
    "presets": "presets",
    "cache-sim": "cache_sim",
    "demo": "demo",
}

#: the commands that look at a recorded signal between their steps (k3.interrupt); the
#: others raise it at once, as Python does
DEFERRED = ("run", "chat", "serve")

EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK}  success
  {EXIT_RUNTIME}  refused to start or failed while running (memory plan, forward failure)
  {EXIT_USAGE}  usage error: bad flags, unreadable config, token id outside the vocabulary
  {EXIT_CHECKPOINT}  checkpoint malformed, truncated or incomplete (missing shard or tensor)
  {EXIT_READ}  a weight read failed during the run: the output is invalid
  {EXIT_PIPELINE}  a pipeline over several processes (torchrun) cannot go on: a rank differs, died or hung
  130 interrupted (Ctrl-C)
  143 terminated (SIGTERM)
"""
EXIT_TERMINATED = interrupt.EXIT_TERMINATED
Terminated = interrupt.Terminated


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3", description="k3: exact Kimi K3 / Kimi-Linear inference on ordinary machines.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"k3 {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f".commands.{module}", __package__)
        sp = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", None),
                            epilog=getattr(mod, "EPILOG", EXIT_CODES_HELP),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(fn=mod.run)
    return p


def err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    # Ctrl-C and SIGTERM are recorded and acted on between steps (k3.interrupt), from
    # here on: raised where the program is, they could land inside compiled code.
    # Without argv this is the program (the `k3` script, python -m k3): the handlers
    # then stay until the process ends (_exit_on_signal).
    interrupt.clear(sigterm=True)
    handlers = interrupt.deferred()
    handlers.__enter__()
    if argv is None:
        import atexit
        atexit.register(_exit_on_signal)  # registered before torch and numba: run after theirs
    try:
        rc = _main(argv)
        if interrupt.pending() is not None and rc not in (interrupt.EXIT_INTERRUPTED, interrupt.EXIT_TERMINATED):
            # the signal came after the last safe point (the results were being written: whole)
            rc = _said(interrupt.error(), err)
        _exit["rc"] = rc
        return rc
    finally:
        if argv is not None:
            handlers.__exit__(None, None, None)
            interrupt.clear(sigterm=True)  # in-process callers (tests, the API) start clean


_exit = {"rc": EXIT_RUNTIME}


def _exit_on_signal() -> None:
    """The program's last step, after the threads are joined and every other exit
    function ran (the files are written and closed): the process ends here with main's
    code, or 130 / 143 for a signal recorded since. Left to the interpreter's shutdown,
    a signal then met the default actions (Python restores them): killed by it,
    without the message."""
    code = _exit["rc"]
    if interrupt.pending() is not None and code not in (interrupt.EXIT_INTERRUPTED, interrupt.EXIT_TERMINATED):
        code = _said(interrupt.error(), err)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _main(argv) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its message; usage errors are exit 2
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if not getattr(args, "fn", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.cmd in DEFERRED:
        return _run(args)
    # the other commands have no safe points to look at the record: a signal raises at once
    with interrupt.raising():
        return _run(args)


def _run(args) -> int:
    """args.fn(args), with every error turned into its exit code. A pipeline rank other
    than 0 (under torchrun) prints only its errors: rank 0 speaks for the run."""
    launch = env.launch()
    if launch is None or not launch[0]:
        return _guarded(args)
    import contextlib
    import os
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        return _guarded(args, sys.__stderr__, f"rank {launch[0]}")


def _guarded(args, out=None, who: str | None = None) -> int:
    def err(msg: str) -> None:
        if who is not None and msg.startswith("k3: "):
            msg = f"k3 [{who}]: " + msg[len("k3: "):]
        print(msg, file=out or sys.stderr, flush=True)
    try:
        return args.fn(args)
    except K3Error as e:
        err(f"k3: {e}")
        if e.exit_code == EXIT_READ:
            err("RUN INVALID: a weight read failed, so no token from the failed step was produced; "
                "nothing was written for it (no --out result).")
        return e.exit_code
    except (KeyboardInterrupt, Terminated) as e:
        return _said(e, err)
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # a bug in k3, not a user mistake: one line, the traceback on request
        if env.debug():
            raise
        err(f"k3: internal error ({type(e).__name__}: {e}). This is a bug in k3; run again with K3_DEBUG=1 "
            "for the traceback and report it.")
        return EXIT_RUNTIME


def _said(e: BaseException, err) -> int:
    """The message and exit code of an interrupt (130) or a SIGTERM (143)."""
    if isinstance(e, Terminated):
        err("k3: terminated (SIGTERM); nothing was written for the unfinished step.")
        return EXIT_TERMINATED
    err("k3: interrupted.")
    return interrupt.EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
