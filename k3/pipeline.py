"""A pipeline over several processes (and hosts): each rank holds a contiguous range of
the layers, so N machines pin what one would have to stream.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:PORT -m k3 run MODEL ...

Every rank runs the same command on its own copy of the checkpoint (or a shared one).
torch.distributed (gloo over TCP, CPU) carries everything: no transport of our own.

* Handshake: every rank sends its fingerprint (k3 version, config, checkpoint shards and
  sampled bytes, the run's settings); a rank that differs is refused by name, on every
  rank (exit 5).
* Plan: each rank reports the memory it may plan in; rank 0 assigns contiguous layer
  ranges (:func:`assign_layers`: the fewest bytes streamed by the slowest stage, then
  the most even fill), each rank plans its own layers with the usual planner, and rank 0
  prints every rank's plan. Rank 0 holds the embedding, the final norms and lm_head.
* A pass: rank 0 embeds the tokens and runs its layers, sends the carry (the hidden
  state; for K3 the Attention Residuals bank and partial sum) to rank 1, ..., and the
  last rank sends it back to rank 0, which finishes the pass and picks the tokens. A
  long pass over several sequences (a batch's prefill) is cut into micro-batches (one
  per rank at most) so that the stages work at once. Each rank keeps its own layers'
  KDA/MLA state and expert cache; the commands that change a sequence's state (new,
  snapshot, restore, rollback, clone, drop) ride on the next pass, so a state on rank 0
  and its parts on the other ranks stay one.
* Faults: gloo's timeout bounds every receive; rank 0 pings the ring when idle so that
  waiting is not mistaken for a hang. A rank that dies, hangs or cannot be reached
  makes every other rank stop with one message and exit code 5; nothing is written as
  if the run had succeeded.

The messages themselves (`Link`: a pickled header, then tensors) are k3.pipeline_link.
"""

from __future__ import annotations

import copy
import hashlib
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from . import env
from .errors import EXIT_PIPELINE, K3Error, NumericError, PipelineError, ReadError
from .model.stack import InferenceState, Model
from .pipeline_link import Link
from .units import human

#: default seconds a rank waits for its neighbour before it declares it lost
DEFAULT_TIMEOUT = 600.0
#: a pass over at least this many tokens (of several sequences) goes as micro-batches
MICRO_TOKENS = 64
_HASH_SAMPLE = 1 << 16  # bytes of each shard's data hashed (its start and end) for the fingerprint


def checkpoint_digest(index) -> str:
    """A fingerprint of a checkpoint: each shard's name, size, header and the first and
    last 64 KiB of its data (two copies of one checkpoint agree; two checkpoints of one
    shape with other weights do not)."""
    h = hashlib.sha256()
    for path in sorted(index.shards()):
        hd = index.shard_header(path)
        h.update(os.path.basename(path).encode() + b"\0" + str(hd.file_size).encode())
        with open(path, "rb") as f:
            h.update(f.read(hd.data_start))
            data = hd.file_size - hd.data_start
            h.update(f.read(min(_HASH_SAMPLE, data)))
            if data > _HASH_SAMPLE:
                f.seek(max(hd.data_start + _HASH_SAMPLE, hd.file_size - _HASH_SAMPLE))
                h.update(f.read(_HASH_SAMPLE))
    return h.hexdigest()[:32]


# ====================================================================== layer assignment
def assign_layers(layer_bytes, capacities) -> list[range]:
    """Contiguous layer ranges, one per rank in rank order (each at least one layer), for
    ranks that can hold ``capacities[r]`` bytes of trunk each. Chosen to minimise, in
    order: the bytes the most-streaming rank re-reads per token (its layers beyond its
    capacity), then the fullest rank's fill (bytes / capacity), so a pipeline that fits
    pins everything with the load spread by each rank's room."""
    a = [int(x) for x in layer_bytes]
    n, w = len(a), len(capacities)
    if w > n:
        raise PipelineError(f"{w} ranks but only {n} layers to share: every rank needs at least one layer. Launch at "
                            f"most {n} processes.")
    pre = [0]
    for x in a:
        pre.append(pre[-1] + x)
    inf = (float("inf"), float("inf"))

    def cost(r, i, j):
        b = pre[j] - pre[i]
        cap = max(1, int(capacities[r]))
        return (max(0, b - cap), b / cap)

    best = [[inf] * (n + 1) for _ in range(w + 1)]
    cut = [[0] * (n + 1) for _ in range(w + 1)]
    best[0][0] = (0, 0.0)
    for r in range(1, w + 1):
        for j in range(r, n - (w - r) + 1):
            for i in range(r - 1, j):
                if best[r - 1][i] == inf:
                    continue
                c = cost(r - 1, i, j)
                v = (max(best[r - 1][i][0], c[0]), max(best[r - 1][i][1], c[1]))
                if v < best[r][j]:
                    best[r][j], cut[r][j] = v, i
    out, j = [], n
    for r in range(w, 0, -1):
        i = cut[r][j]
        out.append(range(i, j))
        j = i
    return out[::-1]


def carry_bytes(cfg, first: int, tokens: int = 1) -> int:
    """Bytes of the carry entering layer ``first`` (fp32): the hidden state, or for K3
    the Attention Residuals bank (one entry per block begun before it) and the partial
    sum."""
    d = cfg.hidden_size
    if cfg.attn_res_block_size is None:
        return tokens * d * 4
    return tokens * d * 4 * (-(-first // cfg.attn_res_block_size) + 1)


def _carry_tensors(carry) -> list:
    """The tensors of a carry (bank, x), in the order they travel."""
    bank, x = carry
    return ([] if bank is None else list(bank)) + [x]


# ====================================================================== the stage
@dataclass
class Stage:
    """This process's part of a pipeline: its rank, its layers, the link to the others."""

    rank: int
    world: int
    layers: range
    n_layers: int  # layers of the whole stack
    timeout: float
    hosts: list
    ranges: list
    link: Link | None = None
    plans: list = field(default_factory=list)  # every rank's plan summary (rank 0)
    remote: dict = field(default_factory=dict)  # rank -> its cumulative counters (rank 0)
    broken: str | None = None
    micro_passes: int = 0  # passes cut into micro-batches
    _cmds: list = field(default_factory=list)
    _keys: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _active: float = 0.0
    _closed: bool = False

    def who(self, r: int) -> str:
        return f"rank {r} ({self.hosts[r]})" if r < len(self.hosts) else f"rank {r}"

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    # ---------------------------------------------------------------- joining
    @classmethod
    def join(cls, *, n_layers: int, layer_bytes, fingerprint: dict, capacity: int, timeout: float) -> "Stage":
        """Connect to the other ranks, compare fingerprints, agree on the layer ranges."""
        import datetime

        import torch.distributed as dist
        rank, world = env.launch()
        host = socket.gethostname()
        if not dist.is_initialized():
            import atexit
            atexit.register(_leave)  # a group left to the interpreter's teardown aborts the process
            try:
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
            except Exception as e:  # rendezvous failures come as several exception types
                raise PipelineError(
                    f"rank {rank} ({host}): could not join the pipeline of {world} processes: {e}. Check that every "
                    "rank was started with the same --rdzv-endpoint (or MASTER_ADDR/MASTER_PORT) and that the "
                    "port is reachable.") from None
        if dist.get_rank() != rank or dist.get_world_size() != world:
            raise PipelineError(f"rank {rank}: the process group says rank {dist.get_rank()} of "
                                f"{dist.get_world_size()}, the launcher rank {rank} of {world}.")
        mine = {"host": host, "fingerprint": fingerprint, "capacity": int(capacity)}
        every = [None] * world
        try:
            dist.all_gather_object(every, mine)
        except RuntimeError as e:
            raise PipelineError(f"rank {rank} ({host}): the handshake with the other ranks failed ({e}).") from None
        hosts = [e["host"] for e in every]
        ref = every[0]["fingerprint"]
        bad = []
        for r, e in enumerate(every):
            diff = [k for k in sorted(set(ref) | set(e["fingerprint"])) if ref.get(k) != e["fingerprint"].get(k)]
            if diff:
                bad.append(f"rank {r} ({hosts[r]}) differs from rank 0 ({hosts[0]}) in "
                           + ", ".join(f"{k} ({e['fingerprint'].get(k)!r} vs {ref.get(k)!r})" for k in diff))
        if bad:
            raise PipelineError(
                "REFUSING TO START the pipeline: every rank must run the same k3 version on the same checkpoint and "
                "config with the same settings. " + "; ".join(bad) + ". Give every rank an identical copy of the "
                "model folder (and the same k3 and command line).")
        ranges = assign_layers(list(layer_bytes)[:n_layers], [e["capacity"] for e in every])
        st = cls(rank, world, ranges[rank], n_layers, float(timeout), hosts, ranges)
        st.link = Link(rank, world, st.who)
        return st

    def share_plans(self, info: dict) -> None:
        """Every rank's plan to rank 0 (it prints them); a plan refused on any rank stops
        every rank, naming it."""
        import torch.distributed as dist
        every = [None] * self.world
        try:
            dist.all_gather_object(every, info)
        except RuntimeError as e:  # a rank that failed before its plan was made: it says why
            raise PipelineError(f"{self.who(self.rank)}: another rank stopped before sharing its memory plan "
                                f"(its own output says why), so the pipeline cannot start ({e}).") from None
        self.plans = every
        for r, p in enumerate(every):
            if p.get("refusal"):
                if r == self.rank:
                    raise K3Error(f"{self.who(r)}: {p['refusal']}", p.get("exit_code", 1))
                raise K3Error(f"{self.who(r)} refused its memory plan (its own output says why); the pipeline "
                              f"cannot start without it: {p['refusal'].splitlines()[0]}", p.get("exit_code", 1))

    def render(self, cfg) -> str:
        lines = [f"pipeline: {self.world} ranks over {self.n_layers} layers (torch.distributed, gloo; timeout "
                 f"{self.timeout:g} s); per token {human(self.net_bytes_per_token(cfg))} goes between ranks",
                 f"  {'rank':<5}{'host':<16}{'layers':<10}{'trunk':>10}{'pinned':>10}{'read/token':>12}"
                 f"{'expert cache':>14}{'plan':>10}{'available':>11}"]
        for r, p in enumerate(self.plans):
            lo, hi = p["layers"]
            lines.append(f"  {r:<5}{p['host'][:15]:<16}{f'{lo}-{hi - 1}':<10}{human(p['trunk_bytes']):>10}"
                         f"{human(p['pinned_bytes']):>10}{human(p['read_per_token']):>12}"
                         f"{p['cache_slots']:>8} slots{human(p['total']):>10}{human(p['available']):>11}")
        return "\n".join(lines)

    def net_bytes_per_token(self, cfg) -> int:
        """Activation bytes one token sends around the ring (every hop, and back to rank 0)."""
        return sum(carry_bytes(cfg, r.stop) for r in self.ranges)

    def describe(self, cfg) -> dict:
        """The pipeline for the --out JSON."""
        return {"world_size": self.world, "carry_bytes_per_token": self.net_bytes_per_token(cfg),
                "micro_batched_passes": self.micro_passes,
                "ranks": [{"rank": r, "host": p["host"], "layers": list(p["layers"]),
                           "trunk_bytes": p["trunk_bytes"], "pinned_bytes": p["pinned_bytes"],
                           "estimated_read_per_token": p["read_per_token"], "cache_slots": p["cache_slots"],
                           "plan_total": p["total"], "available": p["available"],
                           "counters": self.remote.get(r)} for r, p in enumerate(self.plans)]}

    # ---------------------------------------------------------------- state commands (rank 0)
    def new_key(self) -> int:
        self._keys += 1
        return self._keys

    def command(self, *cmd) -> None:
        self._cmds.append(cmd)

    def _take(self) -> list:
        cmds, self._cmds = self._cmds, []
        return cmds

    def _check(self) -> None:
        if self.broken:
            raise PipelineError(self.broken)

    def _fail(self, e: PipelineError) -> PipelineError:
        self.broken = str(e)
        return e

    # ---------------------------------------------------------------- a pass (rank 0)
    def run_pass(self, model: "PipelineModel", batch, observer=None) -> torch.Tensor:
        self._check()
        groups = _split(batch, self.world) if self._micro(batch) else [batch]
        self.micro_passes += len(groups) > 1
        outs, err, sent = [], None, 0
        with self._lock:
            try:
                for g, grp in enumerate(groups):
                    ids = [t for ids, _ in grp for t in ids]
                    carry = model.run_layers(self.layers, model.embed_carry(ids), grp, observer)
                    self._send_carry(self.next, {"op": "pass", "cmds": self._take() if g == 0 else [],
                                                 "segs": [(st.key, [int(t) for t in ids]) for ids, st in grp]},
                                     carry)
                    sent += 1
            except BaseException as e:
                err = e
            try:
                for _ in range(sent):
                    hdr, carry = self._recv_carry(self.prev)
                    self._counters(hdr)
                    if hdr["op"] == "error" and err is None:
                        err = _remote_error(hdr)
                    elif hdr["op"] == "pass":
                        outs.append(carry)
            except PipelineError as e:
                raise self._fail(e) from None
            except BaseException as e:  # an interrupt while receiving: the ranks are out of step
                self.broken = f"the pipeline was interrupted mid-pass ({type(e).__name__}); it cannot be used again"
                raise
            finally:
                self._active = time.monotonic()
        if err is not None:
            raise err
        if observer is not None:
            for i in range(self.layers.stop, self.n_layers):
                observer.on_layer(i)
        for ids, st in batch:
            st.ids.extend(int(t) for t in ids)
        h = [model.finish(c) for c in outs]
        return h[0] if len(h) == 1 else torch.cat(h)

    def _micro(self, batch) -> bool:
        """Cut this pass into micro-batches? Only when compute, not reading the weights,
        sets a stage's time: a pass of at least MICRO_TOKENS tokens with every rank's trunk
        pinned. A decode pass costs a stage about one read of its weights whatever its
        rows, so k micro-batches would read them k times (k times the disk for a streamed
        stage) to overlap stages: no gain (docs/SCALING.md)."""
        if len(batch) < 2 or sum(len(ids) for ids, _ in batch) < MICRO_TOKENS:
            return False
        return all(p["pinned_bytes"] >= p["trunk_bytes"] for p in self.plans)

    def _counters(self, hdr) -> None:
        for r, c in hdr.get("counters", {}).items():
            self.remote[r] = c

    def _send_carry(self, dst, header, carry) -> None:
        bank = carry[0]
        self.link.send(dst, dict(header, bank=None if bank is None else len(bank)), _carry_tensors(carry))

    def _recv_carry(self, src):
        hdr, tensors = self.link.recv(src)
        if not tensors:
            return hdr, None
        n = hdr.get("bank")
        return hdr, ((None if n is None else tensors[:n]), tensors[-1])

    def ping(self) -> None:
        """One round of the ring, when idle: tells every rank rank 0 is alive, and rank 0
        that every rank is."""
        if self.broken or self._closed:
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            self.link.send(self.next, {"op": "ping"})
            hdr, _ = self.link.recv(self.prev)
            self._active = time.monotonic()
        except PipelineError as e:
            self._fail(e)
            raise
        finally:
            self._lock.release()

    def start_heartbeat(self) -> None:
        def beat():
            every = max(0.05, self.timeout / 4)
            while not self._closed:
                time.sleep(every / 2)
                if self._closed or self.broken or time.monotonic() - self._active < every:
                    continue
                try:
                    self.ping()
                except PipelineError as e:
                    # the main thread may be waiting on the user: stop the process from here
                    print(f"k3: {e}", file=sys.__stderr__, flush=True)
                    os._exit(EXIT_PIPELINE)
        self._active = time.monotonic()
        threading.Thread(target=beat, name="k3-pipeline-heartbeat", daemon=True).start()

    def close(self) -> None:
        """Rank 0: tell every rank to stop, and wait until the last one has heard."""
        if self._closed:
            return
        self._closed = True
        if self.broken or self.rank != 0:
            return
        with self._lock:
            try:
                self.link.send(self.next, {"op": "exit", "cmds": self._take()})
                self.link.recv(self.prev)
                self.link.flush()
            except PipelineError:
                pass  # a rank already gone: the others stop on their own timeout or closed connection

    # ---------------------------------------------------------------- the other ranks
    def serve(self, model: Model, provider) -> int:
        """Ranks > 0: run this stage's layers for every pass until rank 0 says stop."""
        states: dict = {}
        snaps: dict = {}
        last = self.next == 0
        while True:
            hdr, carry = self._recv_carry(self.prev)
            op = hdr["op"]
            if op == "ping":
                self.link.send(self.next, {"op": "ping"})
                continue
            for cmd in hdr.get("cmds", ()):
                _apply(cmd, states, snaps, model)
            cmds = [] if last else hdr.get("cmds", [])  # the ranks after this one apply them too
            if op == "exit":
                self.link.send(self.next, {"op": "exit", "cmds": cmds})
                self.link.flush()
                return 0
            counters = dict(hdr.get("counters", {}))
            if op == "pass":
                batch = [(ids, states[key]) for key, ids in hdr["segs"]]
                try:
                    carry = model.run_layers(self.layers, carry, batch)
                except Exception as e:
                    hdr = {"op": "error", "rank": self.rank, "host": self.hosts[self.rank], "message": str(e),
                           "kind": type(e).__name__, "exit_code": getattr(e, "exit_code", 1),
                           "k3": isinstance(e, K3Error)}
                    carry = None
                # this pass's send included, so that rank 0's per-step deltas do not lag a pass behind
                counters[self.rank] = dict(provider.counters(), net_bytes=self.link.sent + sum(
                    t.numel() * t.element_size() for t in (_carry_tensors(carry) if carry is not None else ())))
            if hdr["op"] == "error":
                self.link.send(self.next, dict(hdr, counters=counters, cmds=cmds))
            else:
                self._send_carry(self.next, {"op": "pass", "segs": hdr["segs"], "counters": counters, "cmds": cmds},
                                 carry)
            if last:
                self.link._done()


def _leave() -> None:
    import torch.distributed as dist
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # peers already gone: nothing left to close cleanly
        pass


def _split(batch, parts: int) -> list:
    """Micro-batches: whole sequences, in order, in at most ``parts`` groups of near-equal
    size."""
    k = min(len(batch), parts)
    if k <= 1:
        return [batch]
    q, r = divmod(len(batch), k)
    out, at = [], 0
    for g in range(k):
        n = q + (g < r)
        out.append(batch[at:at + n])
        at += n
    return out


def _apply(cmd, states, snaps, model) -> None:
    """A state command from rank 0, on this rank's part of the states."""
    op, key = cmd[0], cmd[1]
    if op == "new":
        states[key] = model.new_state(cmd[2])
    elif op == "drop":
        states.pop(key, None)
        snaps.pop(key, None)
    elif op == "snap":  # one snapshot per state: the one it replaces can never be restored
        old, snaps[key] = snaps.get(key), states[key].snapshot()
        if old is not None:
            states[key].release(old)
    elif op == "restore":
        states[key].restore(snaps[key])
    elif op == "record":
        states[key].record(cmd[2])
    elif op == "rollback":
        states[key].rollback(snaps[key], cmd[2])
    elif op == "clone":
        c = copy.deepcopy(states[key])
        c.record(False)
        states[cmd[2]] = c
    else:
        raise PipelineError(f"unknown pipeline state command {op!r}: the ranks run different k3 versions?")


def _remote_error(hdr) -> K3Error:
    msg = f"rank {hdr['rank']} ({hdr['host']}): {hdr['message']}"
    if not hdr.get("k3"):
        msg = (f"rank {hdr['rank']} ({hdr['host']}): internal error ({hdr['kind']}: {hdr['message']}). This is a bug "
               "in k3; run again with K3_DEBUG=1 and report it.")
    cls = {"NumericError": NumericError, "ReadError": ReadError}.get(hdr["kind"], K3Error)
    return cls(msg, hdr.get("exit_code", 1))


# ====================================================================== rank 0's view
class PipelineState(InferenceState):
    """A sequence's state on rank 0: rank 0's layers here, the rest on the other ranks
    under the same key; every change is sent along with the next pass."""

    whole = False  # not savable alone (k3.state refuses it)

    def __init__(self, layers, ids, stage: Stage, key: int):
        super().__init__(layers, ids)
        self._stage, self.key = stage, key
        weakref.finalize(self, stage.command, "drop", key)

    def snapshot(self):
        self._stage.command("snap", self.key)
        return super().snapshot()

    def restore(self, snap) -> None:
        self._stage.command("restore", self.key)
        super().restore(snap)

    def record(self, on: bool) -> None:
        self._stage.command("record", self.key, on)
        super().record(on)

    def rollback(self, snap, keep: int) -> None:
        self._stage.command("rollback", self.key, keep)
        super().rollback(snap, keep)

    def __deepcopy__(self, memo):
        key = self._stage.new_key()
        self._stage.command("clone", self.key, key)
        c = PipelineState(copy.deepcopy(self.layers, memo), list(self.ids), self._stage, key)
        return c


class PipelineModel(Model):
    """Rank 0's model: the same math, its own layers local and the rest down the ring."""

    def __init__(self, stage: Stage, provider, **kw):
        super().__init__(provider, n_layers=stage.n_layers, **kw)
        self.stage = stage

    def new_state(self, capacity: int = 0) -> InferenceState:
        base = InferenceState.fresh(self.cfg, self.stage.layers.stop, capacity, self.kv_latent)
        key = self.stage.new_key()
        self.stage.command("new", key, capacity)
        return PipelineState(base.layers, [], self.stage, key)

    def hidden_batch(self, batch, observer=None) -> torch.Tensor:
        return self.stage.run_pass(self, batch, observer)


def join(cfg, layout, packed, budgets, *, timeout: float, available: int, baseline: int, run: dict,
         shape: dict) -> Stage:
    """Join the pipeline this process was launched into: the handshake and the layer
    ranges (``layout`` covers the whole stack; ``shape`` holds the plan's sizing
    arguments: tokens, incremental, prefill_tokens, spec, kv_latent, sequences)."""
    from .version import __version__
    from .memory.planner import trunk_room
    from .memory.streaming import model_sizes
    rank, world = env.launch()
    sizes = model_sizes(layout, packed, tables=rank == 0)
    fp = {"k3": __version__, "config": cfg.fingerprint(), "checkpoint": checkpoint_digest(layout.index),
          "trunk": "streamed" if packed is not None else "resident", **run}
    cap = trunk_room(cfg, sizes, budgets, available=available, baseline=baseline, n_layers=layout.layer_ids,
                     share=world, tables=rank == 0, **shape)
    return Stage.join(n_layers=layout.n_layers, layer_bytes=sizes.layer_bytes, fingerprint=fp, capacity=cap,
                      timeout=timeout)


def plan_info(stage: Stage, plan, sizes, refusal: K3Error | None) -> dict:
    tp = plan.trunk
    trunk = sum(sizes.layer_bytes)
    return {"host": stage.hosts[stage.rank], "layers": [stage.layers.start, stage.layers.stop],
            "trunk_bytes": trunk, "pinned_bytes": tp.pinned_bytes if tp is not None else trunk,
            "read_per_token": plan.read_per_token, "cache_slots": plan.cache_slots, "total": plan.total,
            "available": plan.available,
            "refusal": str(refusal) if refusal is not None else None,
            "exit_code": refusal.exit_code if refusal is not None else 0}


__all__ = ["Stage", "PipelineModel", "PipelineState", "assign_layers", "carry_bytes", "checkpoint_digest",
           "DEFAULT_TIMEOUT", "MICRO_TOKENS"]
