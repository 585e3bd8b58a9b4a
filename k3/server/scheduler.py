"""The one thread that owns the engine, and the jobs the HTTP side hands it.

The thread loads the model (``load()``: k3.load with max_batch and max_context, so the
memory plan covers that many sequences at that context, and a plan that does not fit is
refused before the server listens), then drives one :class:`k3.decode.Batch`:

    loop:  drop the jobs whose clients went away (Batch.remove: the slot is free now)
           admit waiting jobs while there are free slots (Batch.add; a kept state whose
           tokens prefix the prompt is continued instead of prefilling them again: the
           engine's k3.prompt_cache.PromptCache, memory tier and optional disk tier)
           one Batch.step(): a pass over the weights for every sequence in the batch
           hand each job its new tokens; a finished job leaves the batch

Jobs wait in a bounded queue (full: 429). The HTTP side reads a job's events from an
asyncio queue filled from this thread (``loop.call_soon_threadsafe``):
``{"type": "admitted", "cached": n}``, ``{"type": "tokens", "tokens": [...], "finish": f}``
(f: None, "stop" or "length"; with the request's logprobs, ``"logprobs"``: per token
(its log p, [(id, log p) of the most likely]), ``answers.token_logprobs``),
``{"type": "end", "finish": f, "cached": n, "prefill": n}``,
``{"type": "error", "status": s, "message": m}``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable

from .. import interrupt
from ..errors import K3Error
from .metrics import Metrics
from .protocol import ApiError, GenRequest, token_logprobs


class Job:
    """One request's generation, as both sides see it."""

    def __init__(self, req: GenRequest, loop, queue):
        self.req = req
        self.loop = loop
        self.events = queue  # an asyncio.Queue of the HTTP side's loop
        self.cancelled = False
        self.ended = False  # the engine is done with it (finished, cancelled or failed)
        self.request = None  # its k3.decode.Request once admitted
        self.cached = 0
        self.prefill = 0
        self.t_submit = time.perf_counter()

    def push(self, ev: dict) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the HTTP side's loop is gone (forced shutdown)
            pass


class Scheduler:
    def __init__(self, load: Callable[[], object], *, max_queue: int, metrics: Metrics, prefix_entries: int = 16,
                 prefix_bytes: int = 1 << 30, threads: int | None = None, log: Callable[[str], None] | None = None,
                 prompt_cache: str | None = None, prompt_cache_bytes: int = 0):
        self._load = load
        self.max_queue = int(max_queue)
        self.metrics = metrics
        self.prefix_entries, self.prefix_bytes = int(prefix_entries), int(prefix_bytes)
        self.prompt_cache, self.prompt_cache_bytes = prompt_cache, int(prompt_cache_bytes)  # the disk tier
        self.prefix = None  # the engine's k3.prompt_cache.PromptCache (None: neither tier)
        self.threads = threads
        self.log = log or (lambda msg: None)
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.running: dict[int, Job] = {}
        self.draining = False
        self._stop: str | None = None  # "drain" | "now"
        self.engine = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="k3-engine", daemon=True)
        self.spec, self.spec_corpus = 0, None   # speculative decoding: drafts per sequence (k3 serve --spec)
        self.served = 0

    # ------------------------------------------------------------ the HTTP side
    def start(self):
        """Load the model in the engine thread; returns the Engine, or raises what
        loading raised (a plan that does not fit: K3Error)."""
        self.thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self.engine

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.draining or self._stop is not None:
                raise ApiError(503, "The server is shutting down and takes no new requests.", type="server_error",
                               code="server_shutting_down")
            free = max(0, self.engine.max_batch - len(self.running)) if self.engine is not None else 0
            if len(self.waiting) >= self.max_queue + free:  # a job passes through the queue even to a free slot
                raise ApiError(429, f"The server is busy: {len(self.running)} requests are being decoded and "
                                    f"{len(self.waiting)} are waiting, the most it queues (--max-queue). Retry later.",
                               type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
            self.waiting.append(job)
            self.metrics.set(queue_depth=len(self.waiting))
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away (or a stop string ended the answer): the slot is freed
        before the next step."""
        if job.ended or job.cancelled:
            return
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def drain(self) -> None:
        """Refuse new requests; the ones in flight (and queued) still finish."""
        with self.cond:
            self.draining = True
            self.metrics.set(draining=1)
            self.cond.notify()

    def stop(self, now: bool = False, timeout: float | None = None) -> None:
        """Stop the thread: after the work in hand (``now``: at the next step boundary,
        failing what is left) - then the engine is closed."""
        with self.cond:
            self.draining = True
            self._stop = "now" if now else "drain"
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def active(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------ the engine thread
    def _main(self) -> None:
        try:
            from ..decode import set_threads
            set_threads(self.threads)  # OpenMP and numba thread counts are per thread
            with interrupt.follow():  # a Ctrl-C / SIGTERM while loading stops the load at its next stage
                self.engine = self._load()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
            self._ready.set()
            return
        if self.prefix_entries > 0 or self.prompt_cache is not None:
            self.prefix = self.engine.open_prompt_cache(
                self.prompt_cache, max_bytes=self.prompt_cache_bytes, memory_entries=self.prefix_entries,
                memory_bytes=self.prefix_bytes, warn=lambda msg: self.log(f"k3 serve: {msg}"))
        self.metrics.set(max_batch=self.engine.max_batch, max_queue=self.max_queue,
                         max_context=self.engine.max_context)
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug: say so, fail what is left
            self.log(f"k3 serve: the engine thread failed ({type(e).__name__}: {e}); no more requests are served.")
            traceback.print_exc(file=sys.stderr)
            self.error = e
            with self.cond:
                self.draining = True
        finally:
            with self.cond:
                left = list(self.running.values()) + list(self.waiting)
                self.running.clear()
                self.waiting.clear()
            for j in left:
                j.ended = True
                j.push({"type": "error", "status": 503, "message": "The server stopped before this request finished.",
                        "code": "server_shutting_down"})
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001
                pass

    def _loop(self) -> None:
        eng = self.engine
        batch = eng.batch()
        while True:
            with self.cond:
                while True:
                    for j in [j for j in self.waiting if j.cancelled]:
                        self.waiting.remove(j)
                        j.ended = True
                        self.metrics.add(cancelled=1)
                    if self._stop == "now" or self.running or self.waiting or self._stop == "drain":
                        break
                    self.metrics.set(batch_size=0, queue_depth=0)
                    self.cond.wait()
                if self._stop == "now" or (self._stop == "drain" and not self.running and not self.waiting):
                    return
                gone = [j for j in self.running.values() if j.cancelled]
                for j in gone:
                    del self.running[j.request.id]
                admit = []
                while self.waiting and len(self.running) + len(admit) < eng.max_batch:
                    admit.append(self.waiting.popleft())
                self.metrics.set(queue_depth=len(self.waiting))
            for j in gone:
                batch.remove(j.request)
                j.ended = True
                self.metrics.add(cancelled=1)
            for j in admit:
                self._admit(batch, j)
            self._gauges()
            if self.running:
                self._step(batch)

    def _gauges(self) -> None:
        m = self.prefix.memory if self.prefix is not None else None
        d = self.prefix.disk if self.prefix is not None else None
        self.metrics.set(batch_size=len(self.running), prefix_entries=len(m) if m else 0,
                         prefix_bytes=m.bytes if m else 0, prompt_cache_disk_reads=d.reads if d else 0,
                         prompt_cache_disk_writes=d.writes if d else 0,
                         prompt_cache_disk_damaged=d.damaged if d else 0)

    def _admit(self, batch, job: Job) -> None:
        g = job.req
        state, cached, hit = None, 0, None
        if self.prefix is not None:
            hit = self.prefix.lookup(g.prompt, self.engine.max_context)
            self.metrics.add(prefix_hits=1 if hit else 0, prefix_misses=0 if hit else 1)
            if hit is not None:
                cached, state = hit.cached, hit.state
        try:
            r = batch.add(g.prompt[cached:], state=state, max_tokens=g.max_tokens, sampler=g.sampler,
                          stop_ids=g.stop_ids, keep_logits=g.logprobs is not None, constraint=g.constraint, bias=g.bias,
                          spec=self.spec, spec_corpus=self.spec_corpus)
        except K3Error as e:
            job.ended = True
            job.push({"type": "error", "status": 400, "message": str(e), "code": "invalid_value"})
            return
        if self.prefix is not None:   # its snapshot points (message ends, every SNAPSHOT_EVERY tokens)
            self.prefix.attach(r, hit, getattr(g.prompt, "boundaries", ()))
        job.request, job.cached = r, cached
        with self.cond:
            self.running[r.id] = job
        self.metrics.add(prompt_tokens=len(g.prompt), prompt_tokens_cached=cached)
        job.push({"type": "admitted", "cached": cached})

    def _step(self, batch) -> None:
        eng = self.engine
        n = len(self.running)
        c0 = eng.provider.counters()
        t0 = time.perf_counter()
        try:
            out = batch.step()
        except Exception as e:  # noqa: BLE001 - a read failure or non-finite numbers: fail this batch, go on
            msg = str(e) if isinstance(e, K3Error) else f"internal error ({type(e).__name__}: {e})"
            self.log(f"k3 serve: a forward pass failed, failing the {n} requests in it: {msg}")
            with self.cond:
                failed = list(self.running.values())
                self.running.clear()
            for j in failed:
                batch.remove(j.request)
                j.ended = True
            # counted before a client can see its error, so a read of /metrics after it sees it
            self.metrics.add(failed=len(failed))
            self._gauges()
            for j in failed:
                j.push({"type": "error", "status": 500, "message": f"The forward pass failed: {msg}",
                        "code": "engine_error"})
            return
        dt = time.perf_counter() - t0
        c1 = eng.provider.counters()
        delta = {k: c1[k] - c0[k] for k in c1}
        trunk = eng.provider.trunk
        events = []   # pushed once the pass is counted: a client never sees what /metrics does not yet say
        try:
            emitted = self._collect(batch, out, events)
            self.metrics.on_pass(dt, emitted, n, delta, trunk.stats()["reads"] if trunk is not None else 0)
            self._gauges()
        finally:   # whatever went wrong after a job ended, its client is told how it ended
            for job, ev in events:
                job.push(ev)

    def _collect(self, batch, out, events: list) -> int:
        """Each running job's events of this pass (its tokens, then its end), counted;
        returns the tokens emitted."""
        emitted = 0
        for r, steps in out:
            job = self.running.get(r.id)
            if job is None:
                continue
            emitted += len(steps)
            if steps and steps[0].drafted:
                self.metrics.add(drafted=steps[0].drafted, accepted=steps[0].accepted)
            if steps and steps[0].step == 0:
                job.prefill = steps[0].fed
                self.metrics.add(prefill_tokens=steps[0].fed)
                if self.prefix is not None and job.req.kind == "chat" and r.state is not None \
                        and len(r.state.ids) == len(job.req.prompt):
                    self.prefix.put(r.state)  # the prompt read: the next turn of this chat starts with it
            ev = {"type": "tokens", "tokens": [s.token for s in steps], "finish": r.finish}
            if job.req.logprobs is not None:
                ev["logprobs"] = [token_logprobs(s.logits, s.token, job.req.logprobs) for s in steps]
            events.append((job, ev))
            if r.finished:
                events.append((job, self._finish(batch, job)))
        return emitted

    def _finish(self, batch, job: Job) -> dict:
        """The job's request out of the batch, counted; the end event to push."""
        r = job.request
        batch.remove(r)
        with self.cond:
            self.running.pop(r.id, None)
        if self.prefix is not None and not job.cancelled and r.state is not None:
            self.prefix.put(r.state, owned=True)  # a next turn that extends this answer continues from here
        job.ended = True
        self.served += 1
        self.metrics.add(finished=1)
        return {"type": "end", "finish": r.finish, "cached": job.cached, "prefill": job.prefill}
