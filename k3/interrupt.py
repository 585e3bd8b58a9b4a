"""Ctrl-C (SIGINT) and SIGTERM: a flag, acted on between steps.

A signal handler that raises lands wherever the main thread happens to be, and that
can be inside a numba or torch call: numba then reports ``SystemError: ... returned a
result with an exception set`` (an "internal error" instead of exit 130 / 143). So
while k3 works, the handlers (:func:`deferred`) only record the signal, and the work
looks at the record at its safe points (:func:`check`): between decode steps, between
layers (so between prefill pieces too), between load stages and kernel warm-up jobs,
and before result files are written. :func:`check` raises KeyboardInterrupt for
SIGINT and :class:`Terminated` for SIGTERM, in pure Python, where nothing compiled is
on the stack; the CLI turns them into exit 130 and 143.

Where a wait is pure Python and raising at once is wanted (``k3 chat`` reading the
next message), :func:`raising` puts handlers back that raise immediately.

:func:`check` acts in the main thread, and in a thread that asked to (:func:`follow`:
``k3 serve`` loading its model in the engine thread), so an engine thread serving
requests is stopped by the server's drain, not here. Nothing is recorded unless a
front end installed the handlers: the Python API keeps Python's own behaviour.
"""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: int | None = None  # the signal waiting to be acted on (SIGTERM outranks SIGINT)
_followers: set[int] = set()  # threads other than the main one that check() acts in


class Terminated(BaseException):
    """SIGTERM, raised at a safe point so that files being written are cleaned up (an
    atomic write leaves the old file) and the run ends with 143."""


def _record(signum, frame) -> None:
    global _pending
    if _pending != signal.SIGTERM:
        _pending = signum


def _raise_now(signum, frame) -> None:
    raise error(signum)


def pending() -> int | None:
    """The signal recorded and not yet cleared (signal.SIGINT / SIGTERM), or None."""
    return _pending


def clear(sigterm: bool = False) -> None:
    """Forget a Ctrl-C recorded (``k3 chat``: the one that stopped an answer); a SIGTERM
    recorded stays unless ``sigterm`` (a fresh start: k3.cli.main)."""
    global _pending
    if sigterm or _pending != signal.SIGTERM:
        _pending = None


def error(signum: int | None = None) -> BaseException:
    """The exception for ``signum`` (default: the one recorded)."""
    signum = _pending if signum is None else signum
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def check() -> None:
    """Raise KeyboardInterrupt / Terminated if a signal is recorded (it stays recorded
    until :func:`clear`, so every layer of the program sees it on the way out). In the
    main thread and in threads inside :func:`follow`; elsewhere nothing."""
    if _pending is not None and (threading.current_thread() is threading.main_thread()
                                 or threading.get_ident() in _followers):
        raise error()


@contextlib.contextmanager
def follow():
    """:func:`check` acts in this thread too for the duration (a load done for the main
    thread, which waits)."""
    me = threading.get_ident()
    _followers.add(me)
    try:
        yield
    finally:
        _followers.discard(me)


def exit_code(signum: int | None = None) -> int:
    signum = _pending if signum is None else signum
    return EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED


def _install(handler) -> dict | None:
    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers live in the main thread; elsewhere nothing changes
    return {s: signal.signal(s, handler) for s in _SIGNALS}


def _restore(prev: dict | None) -> None:
    if prev is not None:
        for s, h in prev.items():
            signal.signal(s, h)


@contextlib.contextmanager
def deferred():
    """SIGINT and SIGTERM only recorded for the duration (in the main thread)."""
    prev = _install(_record)
    try:
        yield
    finally:
        _restore(prev)


@contextlib.contextmanager
def raising():
    """SIGINT and SIGTERM raise at once for the duration: for pure-Python waits such as
    reading a line. A signal recorded before is raised on entry."""
    prev = _install(_raise_now)
    try:
        check()
        yield
    finally:
        _restore(prev)
