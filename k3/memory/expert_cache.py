"""The routed-expert cache: a fixed arena of expert slots filled by O_DIRECT reads, LRU.

INVARIANTS (read these before using the returned tensors)

* Experts returned by one :meth:`ExpertCache.experts` call are torch VIEWS into the
  arena. They stay valid until the NEXT ``experts()`` call, which may evict them and
  overwrite their bytes. One call serves at most :attr:`ExpertCache.max_experts_per_call`
  (= n_slots - 1) experts; :meth:`ExpertCache.groups` hands any number out in groups of
  that size, each valid until the next group is asked for (the MoE math finishes a
  group before it asks for the next).
* Within one call, an expert of the call is never chosen as the victim for another
  expert of the same call, and a slot being read (in flight) is never a victim.
* A slot is published (findable) only after its read succeeded; a failed read puts the
  slot back to EMPTY, so partial bytes are never served.
* Only one ``experts()`` call at a time (a second concurrent call raises
  RuntimeError). The reads inside one call run in parallel on ``io_threads`` threads
  (``pread`` releases the GIL).

Layout (as the C engine's k3_cache.c): one preallocated arena of
``n_slots`` fixed slots; a slot holds the largest expert's six tensors (three for an
unpacked BF16 expert) as the ONE contiguous run they form in the shard, widened outward
to 4096-byte boundaries so the run is one O_DIRECT read, rounded up to 4096 bytes.
An expert whose tensors are not one gap-free run in one file (not the release layout)
is read tensor by tensor into its slot instead: slower, still exact.

The seam: the cache needs an object (``layout``) with ``cfg`` (``num_experts``,
``num_experts_per_token``, ``is_moe(i)``), ``n_layers`` and
``expert_tensors(layer, e) -> {relative name: TensorInfo}`` (relative names
``w1.weight_packed`` / ``w1.weight_scale`` or ``w1.weight``, same for w2, w3).
:class:`~k3.checkpoint.layout.CheckpointLayout` is one.

Statistics (whole run, and per step until :meth:`ExpertCache.end_step`): requests,
hits, misses, evictions, reads / failed_reads / scattered_reads (experts read, reads
that failed, experts read tensor by tensor because they are not one run), bytes_read
(expert payload bytes), io_bytes (bytes transferred, including the O_DIRECT widening),
read_seconds (wall time of the parallel read phase) and retention = requests - evictions
(the C engine's "true retention": every request that did not push an expert out).
"""

from __future__ import annotations

import json
import os
import threading
import time
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..checkpoint.io import TORCH_DTYPES, ShardFiles, aligned_empty
from ..errors import CheckpointError, ReadError, UsageError
from ..model.weights import ExpertSet, ExpertWeights, Mxfp4Weight
from ..units import GB, human
# where an expert's bytes are and how large a slot is live in expert_location.py; the
# cache uses these, and code that imports them from this module keeps working
from .expert_location import _WEIGHTS, ExpertLocation, ExpertSource, expert_slot_bytes, locate_expert

__all__ = [
    "ExpertCache",
    "ExpertLocation",
    "ExpertSource",
    "expert_slot_bytes",
    "locate_expert",
]


# --------------------------------------------------------------------- statistics
_COUNTERS = ("requests", "hits", "misses", "evictions", "reads", "failed_reads",
             "scattered_reads", "bytes_read", "io_bytes")


@dataclass
class _Reads:
    """One call's reads in flight: (location, slot) jobs, their futures (None: read inline)
    and which jobs have been settled (published, or their slot handed back)."""

    jobs: list
    futures: list | None
    t0: float
    settled: set = None

    def __post_init__(self):
        self.settled = set()


class _Stats:
    __slots__ = _COUNTERS + ("read_seconds",)

    def __init__(self):
        for k in _COUNTERS:
            setattr(self, k, 0)
        self.read_seconds = 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in _COUNTERS}
        d["read_seconds"] = self.read_seconds
        d["retention"] = self.requests - self.evictions
        d["hit_rate"] = self.hits / self.requests if self.requests else 0.0
        d["retention_rate"] = d["retention"] / self.requests if self.requests else 0.0
        d["read_gbps"] = self.io_bytes / self.read_seconds / GB if self.read_seconds > 0 else 0.0
        return d


_INFLIGHT = object()  # key_of state of a reserved slot being read


class ExpertCache:
    """LRU cache of routed experts in a fixed arena of slots (see the module docstring).

    ``n_slots`` comes from the memory plan (:func:`k3.memory.planner.expert_cache_slots`);
    at least top-k + 1 (ValueError otherwise). ``reader`` (default: a private
    ShardFiles) does the reads; ``io_threads`` reads run in parallel within one call;
    ``trace`` records every request for :meth:`dump_trace`.
    """

    def __init__(self, layout: ExpertSource, n_slots: int, reader: ShardFiles | None = None,
                 io_threads: int = 4, trace: bool = False):
        if int(io_threads) < 1:
            raise UsageError(f"expert cache io_threads must be >= 1, got {io_threads}.")
        self.layout = layout
        cfg = layout.cfg
        self.n_layers = int(layout.n_layers)
        self.n_experts = int(cfg.num_experts)
        self.top_k = int(cfg.num_experts_per_token)
        first = getattr(layout, "first", 0)  # a pipeline stage's layout: the layers before it are not its own
        self._moe = [i >= first and bool(cfg.is_moe(i)) for i in range(self.n_layers)]
        if any(self._moe) and int(n_slots) < self.top_k + 1:
            raise ValueError(f"an expert cache needs at least top-k + 1 = {self.top_k + 1} slots, got {n_slots}")
        self._slot_bytes = expert_slot_bytes(layout) if any(self._moe) else 0
        self._n_slots = int(n_slots)
        self.io_threads = int(io_threads)
        self._own_reader = reader is None
        self.reader = reader if reader is not None else ShardFiles()
        # (huge pages: fewer TLB misses while a kernel streams an expert; slots are filled
        # on first use, so the arena becomes resident as the cache fills, 2 MiB at a time)
        self._arena = aligned_empty(self._n_slots * self._slot_bytes, huge=True)
        n = self._n_slots
        self._key_of: list = [None] * n          # None = EMPTY, _INFLIGHT, or (layer, e)
        self._weights: list = [None] * n         # ExpertWeights of a published slot
        self._empty = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot_of: dict[tuple[int, int], int] = {}
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # oldest first
        self._loc: dict[tuple[int, int], ExpertLocation] = {}
        self._count = [0] * self.n_layers                # each layer's published experts
        self._every: list = [None] * self.n_layers       # resident_layer's set, while it holds
        self._pools: dict[int, ThreadPoolExecutor] = {}  # one per drive (st_dev): shards spread over drives
        self._dev: dict[str, int] = {}
        self._busy = threading.Lock()
        self._run = _Stats()
        self._step = _Stats()
        self.steps = 0
        self.trace_enabled = bool(trace)
        self._trace = array("i")

    # ------------------------------------------------------------------ properties
    @property
    def n_slots(self) -> int:
        return self._n_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def arena_bytes(self) -> int:
        return self._n_slots * self._slot_bytes

    @property
    def max_experts_per_call(self) -> int:
        return self._n_slots - 1

    @property
    def resident_count(self) -> int:
        return len(self._slot_of)

    def resident(self, layer: int, e: int) -> bool:
        """Whether expert ``e`` of ``layer`` is in the cache now (no accounting)."""
        return (int(layer), int(e)) in self._slot_of

    def resident_layer(self, layer: int) -> ExpertSet | None:
        """Every routed expert of ``layer`` (an ExpertSet, by id) when all of them are in
        the cache, else None; no accounting (``note_hits`` does it for the experts then
        used). The same object while none of them moves; valid until the next fetch."""
        if not (0 <= layer < self.n_layers and self._count[layer] == self.n_experts):
            return None
        every = self._every[layer]
        if every is None:
            every = self._every[layer] = ExpertSet(self._weights[self._slot_of[(layer, e)]]
                                                   for e in range(self.n_experts))
        return every

    def note_hits(self, layer: int, ids: Sequence[int]) -> None:
        """Account for experts ``ids`` of ``layer`` used from ``resident_layer``: what
        ``experts`` counts for a call that hits them all (requests, hits, LRU order, trace)."""
        if self.trace_enabled:
            for e in ids:
                self._trace.append(layer)
                self._trace.append(e)
        touch = self._lru.move_to_end
        for e in dict.fromkeys(ids):
            touch((layer, e))
        for s in (self._run, self._step):
            s.requests += len(ids)
            s.hits += len(ids)

    # ------------------------------------------------------------------ the fetch
    def experts(self, layer: int, ids: Sequence[int]) -> dict[int, ExpertWeights]:
        """Experts ``ids`` of ``layer`` as ExpertWeights viewing the arena.

        Valid until the next call. At most ``max_experts_per_call`` distinct ids
        (ValueError otherwise: the caller groups). A repeated id counts as a request
        that hits. A failed read raises ReadError (exit code 4); the experts read
        successfully in the same call are kept, the failed ones are not published."""
        layer, ids, uniq = self._begin(layer, ids)
        try:
            return self._fetch(layer, ids, uniq)
        finally:
            self._busy.release()

    def _begin(self, layer, ids) -> tuple[int, list, list]:
        """A call's arguments checked (layer, ids as ints, the distinct ids) and the cache
        taken for it: the caller releases ``_busy``."""
        layer = int(layer)
        ids = [int(e) for e in ids]
        uniq = list(dict.fromkeys(ids))
        if len(uniq) > self.max_experts_per_call:
            raise ValueError(
                f"{len(uniq)} experts requested in one call; this cache hands out at most "
                f"{self.max_experts_per_call} at once (n_slots - 1): fetch them in groups")
        if not (0 <= layer < self.n_layers and self._moe[layer]):
            raise ValueError(f"layer {layer} is not an MoE layer of this model")
        if uniq and not (min(uniq) >= 0 and max(uniq) < self.n_experts):  # (two C calls, not a loop)
            bad = next(e for e in uniq if not 0 <= e < self.n_experts)
            raise ValueError(f"expert id {bad} out of range 0..{self.n_experts - 1}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("ExpertCache.experts() called concurrently; it serves one call at a time")
        return layer, ids, uniq

    def groups(self, layer: int, ids: Sequence[int], stream: bool = False):
        """Experts ``ids`` (distinct) of ``layer`` in groups of at most
        ``max_experts_per_call``; each group's experts are valid until the next group.

        With ``stream``, a group whose experts are not all cached is handed out in
        pieces: the cached ones at once, once the missing ones' reads have started, then
        each missing one as its read completes, so its math can start while the others
        are still being read. The pieces of one group stay valid until the next group."""
        ids = list(ids)
        step = self.max_experts_per_call
        for g in range(0, len(ids), step):
            if stream:
                yield from self._stream(layer, ids[g:g + step])
            else:
                yield self.experts(layer, ids[g:g + step])

    def _stream(self, layer: int, ids: list):
        layer, ids, uniq = self._begin(layer, ids)
        sub = None
        try:
            hits, missing = self._lookup(layer, ids, uniq)
            if not missing:
                yield hits
                return
            sub = self._submit(layer, missing, set(uniq))
            if hits:
                yield hits
            for e, ew in self._collect(layer, sub):
                yield {e: ew}
            sub = None
        finally:
            if sub is not None:
                self._abandon(sub)
            self._busy.release()

    def _fetch(self, layer: int, ids: list, uniq: list) -> dict[int, ExpertWeights]:
        out, missing = self._lookup(layer, ids, uniq)
        if not missing:
            return out                    # built in the order of uniq already
        self._load(layer, missing, set(uniq), out)
        return {e: out[e] for e in uniq}

    def _lookup(self, layer: int, ids: list, uniq: list) -> tuple[dict, list]:
        """The cached experts of a call (LRU touched) and the missing ones, counted."""
        run, step = self._run, self._step
        n_req = len(ids)
        if self.trace_enabled:
            for e in ids:
                self._trace.append(layer)
                self._trace.append(e)
        out: dict[int, ExpertWeights] = {}
        missing: list[int] = []
        slot_of, weights, touch = self._slot_of, self._weights, self._lru.move_to_end
        for e in uniq:
            key = (layer, e)
            slot = slot_of.get(key)
            if slot is None:
                missing.append(e)
            else:
                touch(key)
                out[e] = weights[slot]
        n_miss = len(missing)
        for s in (run, step):
            s.requests += n_req
            s.hits += n_req - n_miss
            s.misses += n_miss
        return out, missing

    def _location(self, layer: int, e: int) -> ExpertLocation:
        key = (layer, e)
        loc = self._loc.get(key)
        if loc is None:
            loc = locate_expert(self.layout, layer, e)
            if loc.span > self._slot_bytes:  # only if expert_tensors changed under us
                raise CheckpointError(
                    f"routed expert {e} of layer {layer} needs {loc.span} bytes, more than the "
                    f"{self._slot_bytes}-byte cache slot computed for this checkpoint")
            self._loc[key] = loc
        return loc

    def _reserve(self, layer: int, call_ids: set) -> int:
        """Phase 1: an EMPTY slot, else evict the least recently used published expert
        that is not part of this call. Reserved slots are in flight (not in the LRU)."""
        if self._empty:
            slot = self._empty.pop()
        else:
            victim = None
            for key in self._lru:  # oldest first; this call's hits were just touched (at the end)
                if not (key[0] == layer and key[1] in call_ids):
                    victim = key
                    break
            if victim is None:  # pragma: no cover - excluded by max_experts_per_call
                raise RuntimeError("expert cache: no evictable slot (more experts in flight than slots)")
            slot = self._lru.pop(victim)
            del self._slot_of[victim]
            self._count[victim[0]] -= 1
            self._every[victim[0]] = None
            self._weights[slot] = None
            self._run.evictions += 1
            self._step.evictions += 1
        self._key_of[slot] = _INFLIGHT
        return slot

    def _load(self, layer: int, missing: list, call_ids: set, out: dict) -> None:
        sub = self._submit(layer, missing, call_ids)
        try:
            for e, ew in self._collect(layer, sub):
                out[e] = ew
        except BaseException:
            self._abandon(sub)
            raise

    def _submit(self, layer: int, missing: list, call_ids: set) -> "_Reads":
        """Reserve a slot for each missing expert and start its read (on the drive's
        reader pool; inline, one by one, when one reader would do)."""
        locs = [self._location(layer, e) for e in missing]  # may raise before anything is reserved
        jobs = [(loc, self._reserve(layer, call_ids)) for loc in locs]
        jobs.sort(key=lambda j: (j[0].file, j[0].offset))
        sub = _Reads(jobs, None, time.perf_counter())
        devs = [self._device(loc.file) for loc, _ in jobs]
        if not (len(jobs) == 1 or (self.io_threads == 1 and len(set(devs)) == 1)):
            sub.futures = [self._pool(d).submit(self._read_job, j) for d, j in zip(devs, jobs)]
        return sub

    def _collect(self, layer: int, sub: "_Reads"):
        """Publish each read as it completes and yield (expert, weights), in the order the
        reads complete; a failed read's slot goes back EMPTY, and once every read is done
        the first failure is raised (ReadError), the successful ones kept."""
        run, step = self._run, self._step
        failed = []
        if sub.futures is None:
            order = ((i, self._read_job(j)) for i, j in enumerate(sub.jobs))
        else:
            where = {f: i for i, f in enumerate(sub.futures)}
            order = ((where[f], f.result()) for f in as_completed(sub.futures))
        for i, (err, io) in order:
            loc, slot = sub.jobs[i]
            sub.settled.add(i)
            if err is not None:
                self._key_of[slot] = None
                self._empty.append(slot)
                failed.append((loc, err))
                continue
            key = (layer, loc.expert)
            self._key_of[slot] = key
            self._slot_of[key] = slot
            self._count[layer] += 1
            self._lru[key] = slot
            ew = self._weights[slot] = self._build(slot, loc)
            for st in (run, step):
                st.reads += 1
                st.scattered_reads += not loc.contiguous
                st.bytes_read += loc.nbytes
                st.io_bytes += io
            yield loc.expert, ew
        for loc, _ in sub.jobs:   # newest in the call's order, not the reads' completion order: the same LRU every run
            if (layer, loc.expert) in self._lru:
                self._lru.move_to_end((layer, loc.expert))
        dt = time.perf_counter() - sub.t0
        for st in (run, step):
            st.read_seconds += dt
            st.failed_reads += len(failed)
        if failed:
            loc, err = failed[0]
            if not isinstance(err, (ReadError, OSError)):
                raise err
            more = f" ({len(failed) - 1} more expert reads of this batch failed too.)" if len(failed) > 1 else ""
            raise ReadError(
                f"EXPERT READ FAILED: layer {layer} expert {loc.expert} (file {loc.file}, offset "
                f"{loc.offset}, {loc.nbytes} bytes): {err}{more} The step is aborted; no output "
                f"from it is valid.") from err

    def _abandon(self, sub: "_Reads") -> None:
        """Interrupted (Ctrl-C, or the consumer of a stream went away) before every read was
        published: let reads still running finish into their slots, then hand every slot
        not yet published back as EMPTY, so no capacity is lost and no slot is written
        while someone else owns it."""
        for f in sub.futures or ():
            f.cancel()
        for f in sub.futures or ():
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:
                    pass
        for i, (_, slot) in enumerate(sub.jobs):
            if i not in sub.settled:
                sub.settled.add(i)
                self._key_of[slot] = None
                self._empty.append(slot)

    def _device(self, path: str) -> int:
        d = self._dev.get(path)
        if d is None:
            try:
                d = os.stat(path).st_dev
            except OSError:
                d = -1  # the read reports what is wrong
            self._dev[path] = d
        return d

    def _pool(self, dev: int) -> ThreadPoolExecutor:
        """The readers of one drive: io_threads each, so N drives read N times as many
        experts at once."""
        pool = self._pools.get(dev)
        if pool is None:
            pool = self._pools[dev] = ThreadPoolExecutor(max_workers=self.io_threads,
                                                         thread_name_prefix=f"k3-expert-io-{len(self._pools)}")
        return pool

    def _slot_array(self, slot: int) -> np.ndarray:
        s = self._slot_bytes
        return self._arena[slot * s:(slot + 1) * s]

    def _read_job(self, job) -> tuple[BaseException | None, int]:
        """Phase 2 (runs on an I/O thread): read one expert into its reserved slot."""
        loc, slot = job
        buf = self._slot_array(slot)
        try:
            if loc.contiguous:
                self.reader.read_direct(loc.file, loc.offset, loc.nbytes, out=buf[:loc.span])
                return None, loc.span
            for p in loc.parts:
                self.reader.read_into((p.file, p.file_offset, p.nbytes), buf[p.slot_offset:p.slot_offset + p.nbytes])
            return None, loc.nbytes
        except BaseException as e:  # reported by the caller after every read has finished
            return e, 0

    def _build(self, slot: int, loc: ExpertLocation) -> ExpertWeights:
        buf = self._slot_array(slot)
        views = {}
        for p in loc.parts:
            t = torch.from_numpy(buf[p.slot_offset:p.slot_offset + p.nbytes])
            views[p.rel] = t.view(TORCH_DTYPES[p.dtype]).reshape(p.shape)
        ws = []
        for w in _WEIGHTS:
            if f"{w}.weight_packed" in views:
                ws.append(Mxfp4Weight(views[f"{w}.weight_packed"], views[f"{w}.weight_scale"]))
            else:
                ws.append(views[f"{w}.weight"])
        return ExpertWeights(*ws)

    # ------------------------------------------------------------------ statistics
    def _header(self) -> dict:
        return {"n_slots": self._n_slots, "slot_bytes": self._slot_bytes, "arena_bytes": self.arena_bytes,
                "resident": len(self._slot_of)}

    def stats(self) -> dict:
        """Whole-run statistics (JSON-ready)."""
        return {**self._header(), "steps": self.steps, **self._run.as_dict()}

    def step_stats(self) -> dict:
        """Statistics of the current step (since the last end_step)."""
        return {**self._header(), "step": self.steps, **self._step.as_dict()}

    def end_step(self) -> dict:
        """Close the current step: returns its statistics and resets the step counters."""
        d = self.step_stats()
        self._step = _Stats()
        self.steps += 1
        return d

    # ------------------------------------------------------------------ trace
    def trace_array(self) -> np.ndarray:
        """The recorded requests as int32 [N, 2] (layer, expert), request order."""
        return np.frombuffer(self._trace, dtype=np.int32).reshape(-1, 2).copy() if self._trace else \
            np.zeros((0, 2), dtype=np.int32)

    def dump_trace(self, out_dir) -> dict:
        """Write ``expert_trace.bin`` (little-endian int32 pairs layer, expert in request
        order) and ``expert_hist.json`` (``{"n_layers", "n_experts", "counts": {"L,e": n}}``)
        into ``out_dir``; returns {"trace": path, "hist": path, "requests": N}."""
        if not self.trace_enabled:
            raise UsageError("the expert cache was created without tracing, so there is no trace to dump; "
                             "enable it (trace=True / --dump-trace) before the run.")
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        tr = self.trace_array()
        tpath, hpath = d / "expert_trace.bin", d / "expert_hist.json"
        tr.astype("<i4").tofile(tpath)
        counts: dict[str, int] = {}
        if len(tr):
            keys, n = np.unique(tr[:, 0].astype(np.int64) * self.n_experts + tr[:, 1], return_counts=True)
            counts = {f"{int(k) // self.n_experts},{int(k) % self.n_experts}": int(c) for k, c in zip(keys, n)}
        hpath.write_text(json.dumps({"n_layers": self.n_layers, "n_experts": self.n_experts, "counts": counts}))
        return {"trace": str(tpath), "hist": str(hpath), "requests": int(len(tr))}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the I/O threads (and close the reader if the cache opened it)."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools = {}
        if self._own_reader:
            self.reader.close()

    def __enter__(self) -> "ExpertCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ExpertCache({self._n_slots} slots x {human(self._slot_bytes)} = "
                f"{human(self.arena_bytes)}, {len(self._slot_of)} resident)")
