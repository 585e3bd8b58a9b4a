"""Streaming the packed trunk within a byte budget: :class:`TrunkStreamer`.

It receives its plan (which layers stay pinned, how large the ring arena is) from the
memory planner (:func:`k3.memory.planner.plan_trunk`); it does not choose anything.
Pinned layers live in their own buffers; every other budget byte is one ring *arena*
(at least ``ring`` slots of the largest unpinned layer). A scheduler thread places the
unpinned layers into the arena one after another in forward-walk order (wrapping to
layer 0 for the next token; a layer that meets the arena's end is split there at a
tensor boundary) and issues aligned ``O_DIRECT`` chunk reads to a small thread pool
(``pread`` releases the GIL, so ``io_threads`` chunks are in flight at once, across
layer boundaries). ``layer(i)`` hands over a mapping at once; looking a tensor up waits
only for the chunks under it, so compute follows the reads tensor by tensor, and reads
of the next layer start in whatever arena bytes the current one leaves free. Bytes of a
layer being read, not yet used, or held by the caller are never overwritten; a
released layer's bytes are reused as a hit if the walk comes back before they are taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ...checkpoint.io import ALIGN, TORCH_DTYPES, ShardFiles, aligned_empty
from ...errors import K3Error, ReadError
from ...units import align_up, gb
from ..planner import TrunkPlan
from .format import PackedTrunk, TrunkTensor

DEFAULT_CHUNK = 8 << 20  # bytes per read request while streaming

class _Inst:
    """One read of one layer: where its bytes live, which chunks have arrived, who holds it.

    ``parts`` maps the layer's run onto memory: ``(lo, hi, pos)`` says run bytes
    ``[lo, hi)`` live at ``buf[pos : pos + hi - lo]``. A ring layer has one part, or two
    when it wraps round the arena's end (split at a tensor boundary, so every tensor
    stays contiguous; the two parts may share one 4 KiB page, read into both).
    ``chunks`` are the read requests, in run order; run bytes ``[0, ready_to)`` are
    readable once every chunk before them has arrived."""

    __slots__ = ("layer", "pinned", "buf", "parts", "chunks", "done", "prefix", "ready_to", "inflight",
                 "error", "refs", "views", "dropped")

    def __init__(self, layer: int, pinned: bool, buf: np.ndarray, parts, chunk_bytes: int):
        self.layer = layer
        self.pinned = pinned
        self.buf = buf
        self.parts = parts
        self.chunks = [(o, min(o + chunk_bytes, hi), pos + o - lo)
                       for lo, hi, pos in parts for o in range(lo, hi, chunk_bytes)]
        self.done = [False] * len(self.chunks)
        self.prefix = 0  # chunks[:prefix] have all arrived
        self.ready_to = 0
        self.inflight = 0
        self.error: BaseException | None = None
        self.refs = 0
        self.views: dict[str, torch.Tensor] = {}
        self.dropped = False  # cancelled or failed: its memory is free once nothing is in flight

    @property
    def complete(self) -> bool:
        return self.prefix == len(self.chunks)

    @property
    def regions(self) -> list[tuple[int, int]]:
        """Arena byte ranges [a, b) this layer occupies (none for a pinned buffer)."""
        return [] if self.pinned else [(pos, pos + hi - lo) for lo, hi, pos in self.parts]


def _overlaps(r: list[tuple[int, int]], s: list[tuple[int, int]]) -> bool:
    return any(a < d and c < b for a, b in r for c, d in s)


class _LayerView(Mapping):
    """Layer i's tensors by name, handed out before the layer has arrived: looking one up
    waits until the bytes it spans are read (compute on the first tensors overlaps the
    reading of the rest). Valid until ``release_layer(i)``."""

    __slots__ = ("_s", "_inst", "_specs")

    def __init__(self, streamer: "TrunkStreamer", inst: _Inst, specs: dict):
        self._s, self._inst, self._specs = streamer, inst, specs

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._inst.views.get(name)
        if v is None:
            t = self._specs[name]  # KeyError for an unknown name, as a dict would
            v = self._s._view(self._inst, name, t)
        return v

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


class TrunkStreamer:
    """Layer tensors from a packed trunk within the planner's :class:`TrunkPlan` (see the
    module docstring).

    Memory: the pinned layers (one buffer each, read on first use and kept) and one
    ring *arena* of ``plan.arena_bytes`` (at least ``plan.ring_slots`` slots of the
    largest unpinned layer). A scheduler thread walks the layers in forward order from
    the caller's position (wrapping to layer 0 for the next token), places each unpinned
    layer in the arena right after the previous one (wrapping round its end at a tensor
    boundary) and issues its reads as ``chunk_bytes`` O_DIRECT requests, ``io_threads``
    in flight at once across layer boundaries, so the device never waits for a layer's
    last chunk before starting the next. It reads ahead as far as the arena allows:
    bytes of a layer being read, or handed to the caller and not yet released, are never
    overwritten.

    ``layer(i)`` returns at once with a mapping whose lookups wait for the tensor's
    bytes, so compute starts on a layer's first tensors while its last ones are still
    on their way: even a one-slot ring overlaps reads with compute inside a layer, and
    spare arena bytes beyond one layer let the next layer's reads start before the
    current one is released. Tensors are views into the buffers, valid until
    ``release_layer(i)``. The walk covers the plan's ``n_layers`` first layers
    (``--layers`` plans fewer). Not for concurrent callers: one forward at a time."""

    def __init__(self, packed: PackedTrunk, plan: TrunkPlan, io_threads: int = 4,
                 reader: ShardFiles | None = None, *, chunk_bytes: int = DEFAULT_CHUNK):
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
        self.packed = packed
        self.plan = plan
        self.n = plan.n_layers
        if not 1 <= self.n <= packed.n_layers:
            raise ValueError(f"the plan covers {self.n} layers; the packed trunk has {packed.n_layers}")
        self.io_threads = io_threads
        self.chunk_bytes = chunk_bytes
        self._own_reader = reader is None
        self.reader = reader if reader is not None else ShardFiles()
        self._pinned = set(self.plan.pinned)
        self._arena_bytes = self.plan.arena_bytes
        self._arena = aligned_empty(self._arena_bytes, huge=True) if self._arena_bytes else None
        # (off, end) of each layer's tensors in run order: where a wrap may split it
        self._bounds = [sorted((t.off, t.off + t.nbytes) for t in packed.layers[i].tensors.values())
                        for i in range(self.n)]
        self._pin: dict[int, _Inst] = {}  # pinned layer -> its (complete or in-flight) read
        self._live: dict[int, _Inst] = {}  # ring layer -> instance scheduled for the walk
        self._cache: dict[int, _Inst] = {}  # released ring layers whose bytes are still intact
        self._dropped: list[_Inst] = []  # cancelled/failed, waiting for reads in flight
        self._head = 0  # arena offset after the latest placement
        self._next = 0  # next layer the scheduler places
        self._cursor = 0  # layer the caller asked for last
        self._blocked: int | None = None  # a layer that cannot be placed around held layers
        self._fatal: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._sem = threading.Semaphore(io_threads)
        # statistics
        self._binds = self._hits = self._misses = self._reads = self._splits = 0
        self._bytes = self._device_bytes = 0
        self._wait_s = self._busy_s = 0.0
        self._active = 0
        self._busy_t0 = 0.0
        self._layer_reads = [0] * self.n
        self._pool = (ThreadPoolExecutor(io_threads, thread_name_prefix="k3-trunk-io")
                      if io_threads > 1 else None)
        self._thread = threading.Thread(target=self._run, name="k3-trunk-reader", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- placement
    def _candidates(self, j: int) -> list[list[tuple[int, int, int]]]:
        """Ways to lay layer j's run into the arena, best first: whole right after the
        previous layer; split across the arena's end at a tensor boundary (the tail part
        at offset 0 must end before the head part starts); whole right after any layer
        now scheduled (a way round a layer the caller holds out of turn); whole at 0."""
        R, N, h = self._arena_bytes, self.packed.layers[j].nbytes, self._head
        out = []
        if h + N <= R:
            out.append([(0, N, h)])
        elif h < R:
            best = None
            b = self._bounds[j]
            for k in range(1, len(b)):  # tensors b[:k] before the arena's end, b[k:] from 0
                a_end = align_up(b[k - 1][1])
                if a_end > R - h:
                    break
                w = b[k][0] // ALIGN * ALIGN
                if N - w <= h:
                    best = (a_end, w)
            if best is not None:
                out.append([(0, best[0], h), (best[1], N, 0)])
        for inst in self._live.values():
            for _, e in inst.regions:
                if e + N <= R:
                    out.append([(0, N, e)])
        out.append([(0, N, 0)])
        return out

    def _obstacles(self) -> list[tuple[int, int]]:
        """Arena ranges a placement must avoid: those held by the caller for a layer other
        than the one it is on (they may never be released in this walk)."""
        regs = []
        for inst in self._live.values():
            if inst.refs and inst.layer != self._cursor:
                regs += inst.regions
        return regs

    def _in_use(self, me: _Inst, a: int, b: int) -> _Inst | None:
        """Another read's layer occupying arena bytes [a, b): scheduled, held, or still
        being written into. Its bytes must not be overwritten yet."""
        for inst in list(self._live.values()) + self._dropped:
            if inst is not me and _overlaps([(a, b)], inst.regions):
                return inst
        return None

    def _next_job(self) -> _Inst | None:
        """The next read to issue, placed and registered, or None (nothing to do now)."""
        for _ in range(self.n):
            j = self._next
            if j in self._pinned:
                inst = self._pin.get(j)
                if inst is not None:  # read or being read: pinned layers stay
                    self._next = (j + 1) % self.n
                    continue
                L = self.packed.layers[j]
                try:
                    buf = aligned_empty(L.nbytes, huge=True)
                except MemoryError:
                    inst = _Inst(j, True, None, [], self.chunk_bytes)
                    inst.error = K3Error(
                        f"trunk: cannot allocate {gb(L.nbytes)} GB to pin layer {j}; the machine has less "
                        "free memory than the trunk budget assumed. Lower --trunk-gb.")
                    self._pin[j] = inst
                    return None
                inst = _Inst(j, True, buf, [(0, L.nbytes, 0)], self.chunk_bytes)
                self._pin[j] = inst
                self._next = (j + 1) % self.n
                return inst
            if j in self._live:  # its previous read is still in use: wait for the release
                return None
            if j in self._cache:  # released but intact: a read saved
                self._live[j] = self._cache.pop(j)
                self._next = (j + 1) % self.n
                continue
            stale = self._obstacles()
            place = next((c for c in self._candidates(j)
                          if not _overlaps([(p, p + hi - lo) for lo, hi, p in c], stale)), None)
            if place is None:
                self._blocked = j
                return None
            regs = [(p, p + hi - lo) for lo, hi, p in place]
            for k in [k for k, c in self._cache.items() if _overlaps(regs, c.regions)]:
                del self._cache[k]  # overwritten
            inst = _Inst(j, False, self._arena, place, self.chunk_bytes)
            self._splits += len(place) > 1
            self._live[j] = inst
            lo, hi, p = place[-1]
            self._head = p + hi - lo
            self._next = (j + 1) % self.n
            return inst
        return None

    # ---------------------------------------------------------------- the reader
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # pragma: no cover - a bug: make the caller raise, never hang
            with self._cond:
                self._fatal = e
                self._cond.notify_all()

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while True:
                    if self._closed:
                        return
                    inst = self._next_job()
                    if inst is not None:
                        break
                    cond.wait()
            for ci, (lo, hi, pos) in enumerate(inst.chunks):
                self._sem.acquire()
                with cond:
                    # A chunk goes out once the layers before it have left its arena bytes
                    # (the first chunks of a layer usually can: read-ahead into spare bytes).
                    while not (inst.dropped or self._closed) and not inst.pinned:
                        other = self._in_use(inst, pos, pos + hi - lo)
                        if other is None:
                            break
                        n, c = self.n, self._cursor
                        skipped = (other.layer - c) % n > (inst.layer - c) % n
                        if not other.refs and self._live.get(other.layer) is other and skipped:
                            self._drop(other)  # read ahead for a layer the caller skipped: its turn is next pass
                            continue
                        if other.refs and other.layer != self._cursor:  # held out of turn
                            if not inst.refs:  # not handed out yet: place it again, around that layer
                                self._drop(inst)
                                self._next = inst.layer
                                break
                            self._blocked = inst.layer  # the caller waits on it: tell the caller
                        cond.wait()
                    if inst.dropped or self._closed:
                        self._sem.release()
                        break
                    inst.inflight += 1
                    if not self._active:
                        self._busy_t0 = time.perf_counter()
                    self._active += 1
                if self._pool is None:
                    self._chunk(inst, ci)
                else:
                    self._pool.submit(self._chunk, inst, ci)

    def _chunk(self, inst: _Inst, ci: int) -> None:
        lo, hi, pos = inst.chunks[ci]
        L = self.packed.layers[inst.layer]
        err = None
        try:
            self.reader.read_direct(self.packed.path, L.file_off + lo, hi - lo, out=inst.buf[pos : pos + hi - lo])
        except ReadError as e:
            err = ReadError(f"Reading layer {inst.layer} of the packed trunk ({L.nbytes} bytes at offset "
                            f"{L.file_off} of {self.packed.path}) failed: {e}")
        except OSError as e:
            err = ReadError(
                f"Reading layer {inst.layer} of the packed trunk ({L.nbytes} bytes at offset {L.file_off} of "
                f"{self.packed.path}) failed: {e.strerror or e}. The weights of this run are incomplete, so its "
                "output is invalid; check the disk and re-run.")
        except BaseException as e:  # pragma: no cover - handed to the caller, never swallowed
            err = e
        with self._cond:
            self._active -= 1
            if not self._active:
                self._busy_s += time.perf_counter() - self._busy_t0
            inst.inflight -= 1
            if err is not None:
                if inst.error is None:
                    inst.error = err
                inst.dropped = True
            else:
                self._device_bytes += hi - lo
                inst.done[ci] = True
                while inst.prefix < len(inst.chunks) and inst.done[inst.prefix]:
                    inst.ready_to = max(inst.ready_to, inst.chunks[inst.prefix][1])
                    inst.prefix += 1
                if inst.complete and not inst.dropped:
                    self._reads += 1
                    self._layer_reads[inst.layer] += 1
                    self._bytes += L.nbytes
            if inst.dropped and not inst.inflight and inst in self._dropped:
                self._dropped.remove(inst)
            self._cond.notify_all()
        self._sem.release()

    # ---------------------------------------------------------------- helpers
    def _drop(self, inst: _Inst) -> None:
        """Forget a ring instance (cancelled or failed); its memory is reused once no read
        into it is in flight."""
        inst.dropped = True
        if self._live.get(inst.layer) is inst:
            del self._live[inst.layer]
        if inst.pinned:
            if self._pin.get(inst.layer) is inst:
                del self._pin[inst.layer]
        elif inst.inflight and inst not in self._dropped:
            self._dropped.append(inst)

    def _resync(self, i: int) -> None:
        """The caller left the walk the reader was following: drop read-ahead it does not
        hold and restart the walk at layer i."""
        for inst in list(self._live.values()):
            if inst.refs == 0 and inst.layer != i:
                if inst.complete and inst.error is None:
                    del self._live[inst.layer]
                    if not any(self._in_use(inst, a, b) for a, b in inst.regions):
                        self._cache[inst.layer] = inst
                else:
                    self._drop(inst)
        self._next = i

    def _instance(self, i: int) -> _Inst | None:
        return self._pin.get(i) if i in self._pinned else self._live.get(i)

    def _raise_for(self, inst: _Inst) -> None:
        err = inst.error
        if inst.refs:
            inst.refs -= 1
        self._drop(inst)
        self._cond.notify_all()
        raise err

    def _raise_held(self, i: int) -> None:
        held = sorted(x.layer for x in self._live.values() if x.refs and x.layer != i)
        raise K3Error(
            f"trunk ring: layer {i} ({gb(self.packed.layers[i].nbytes)} GB) does not fit in the "
            f"{gb(self._arena_bytes)} GB ring beside layers {held}, which are held; release_layer() each "
            "layer before asking for the next one, or raise --trunk-gb.")

    def _view(self, inst: _Inst, name: str, t: TrunkTensor) -> torch.Tensor:
        end = t.off + t.nbytes
        cond = self._cond
        with cond:
            if inst.ready_to < end or inst.error is not None:
                t0 = time.perf_counter()
                try:
                    while inst.ready_to < end or inst.error is not None:
                        if inst.error is not None:
                            self._raise_for(inst)
                        if self._closed:
                            raise K3Error("the trunk streamer was closed while a layer was awaited")
                        if self._fatal is not None:
                            raise K3Error(f"the trunk reader thread failed: {self._fatal!r}") from self._fatal
                        if inst.dropped:
                            raise K3Error(f"trunk: layer {inst.layer} was used after release_layer()")
                        if self._blocked == inst.layer:
                            self._raise_held(inst.layer)
                        cond.wait(0.5)
                finally:
                    self._wait_s += time.perf_counter() - t0
        lo, hi, pos = next(p for p in inst.parts if p[0] <= t.off and end <= p[1])
        dt = TORCH_DTYPES[t.dtype]
        a = inst.buf[pos + t.off - lo : pos + end - lo]
        if a.ctypes.data % dt.itemsize:  # never for safetensors' 8-aligned offsets
            a = a.copy()
        v = torch.from_numpy(a).view(dt).reshape(t.shape)
        inst.views[name] = v
        return v

    # ------------------------------------------------------------------------ API
    def layer(self, i: int) -> Mapping[str, torch.Tensor]:
        """Layer i's tensors as a mapping whose lookups wait for their bytes."""
        if not 0 <= i < self.n:
            raise IndexError(f"layer {i} out of range 0..{self.n - 1}")
        cond = self._cond
        with cond:
            if self._closed:
                raise K3Error("the trunk streamer is closed")
            self._binds += 1
            self._cursor = i
            self._blocked = None
            inst = self._instance(i)
            if inst is not None and inst.error is not None:
                self._misses += 1
                self._raise_for(inst)
            if inst is not None and inst.complete:
                self._hits += 1
            else:
                self._misses += 1
                if inst is None:
                    self._resync(i)  # in a forward walk this drops nothing: all before i were used
                    cond.notify_all()
                    t0 = time.perf_counter()
                    try:
                        while (inst := self._instance(i)) is None:
                            if self._closed:
                                raise K3Error("the trunk streamer was closed while a layer was awaited")
                            if self._fatal is not None:
                                raise K3Error(f"the trunk reader thread failed: {self._fatal!r}") from self._fatal
                            if self._blocked == i:
                                self._raise_held(i)
                            cond.wait(0.5)
                    finally:
                        self._wait_s += time.perf_counter() - t0
                    if inst.error is not None:
                        self._raise_for(inst)
            inst.refs += 1
            return _LayerView(self, inst, self.packed.layers[i].tensors)

    def release_layer(self, i: int) -> None:
        """The caller is done with layer i for this step (its ring bytes may be reused)."""
        with self._cond:
            inst = self._instance(i)
            if inst is not None and inst.refs > 0:
                inst.refs -= 1
                if not inst.refs and not inst.pinned and not inst.complete:
                    self._drop(inst)  # released before it was all read: nothing of it is kept
                elif not inst.refs and not inst.pinned:
                    del self._live[i]
                    inst.views = {}
                    if not any(self._in_use(inst, a, b) for a, b in inst.regions):
                        self._cache[i] = inst  # intact until a later placement takes its bytes

            if i == self._cursor:
                self._cursor = (i + 1) % self.n
            self._blocked = None
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            busy = self._busy_s + (time.perf_counter() - self._busy_t0 if self._active else 0.0)
            wait = self._wait_s
            allocated = sum(x.buf.size for x in self._pin.values() if x.buf is not None) + self._arena_bytes
            return {
                "binds": self._binds, "hits": self._hits, "misses": self._misses,
                "hit_rate": self._hits / self._binds if self._binds else 0.0,
                "reads": self._reads, "bytes_read": self._bytes, "device_bytes": self._device_bytes,
                "device_seconds": busy, "wait_seconds": wait, "overlap_seconds": max(0.0, busy - wait),
                "device_gbps": self._device_bytes / busy / 1e9 if busy > 0 else 0.0,
                "pinned": len(self.plan.pinned), "n_layers": self.n,
                "pinned_bytes": self.plan.pinned_bytes, "ring_slots": self.plan.ring_slots,
                "slot_bytes": self.plan.slot_bytes, "arena_bytes": self._arena_bytes, "wrapped_layers": self._splits,
                "allocated_bytes": allocated,
                "io_threads": self.io_threads, "chunk_bytes": self.chunk_bytes,
                "layer_reads": list(self._layer_reads),
                "direct": self.reader.direct_active(self.packed.path),
            }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # every read into the buffers has finished
        if self._own_reader:
            self.reader.close()
        for inst in list(self._pin.values()) + list(self._live.values()) + list(self._cache.values()):
            inst.views = {}
        self._pin, self._live, self._cache, self._dropped = {}, {}, {}, []
        self._arena = None  # freed now unless the caller still holds tensors viewing it

    def __enter__(self) -> "TrunkStreamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            if not self._closed:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
        except Exception:
            pass


