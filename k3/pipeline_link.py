"""The messages between the ranks of a pipeline (k3.pipeline): point-to-point over
torch.distributed (gloo over TCP, CPU), a pickled header and then its tensors. A lost
peer (timeout or closed connection) becomes one PipelineError that names both ranks.

k3.pipeline's Stage holds one Link; k3.pipeline imports it from here (and re-exports it)."""

from __future__ import annotations

import pickle

import torch

from .errors import PipelineError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


class Link:
    """Point-to-point messages between ranks over torch.distributed: a header (pickled)
    and tensors. Sends are asynchronous (a stage goes on computing while its output
    travels); receives block, bounded by the process group's timeout."""

    def __init__(self, rank: int, world: int, who):
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.world = rank, world
        self.who = who  # rank -> "rank R (host)"
        self.sent = 0  # bytes this rank sent
        self._pending: list = []

    def send(self, dst: int, header: dict, tensors=()) -> None:
        tensors = [t.contiguous() for t in tensors]
        header = dict(header, shapes=[(tuple(t.shape), str(t.dtype).split(".")[-1]) for t in tensors])
        data = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        n = torch.tensor([len(data)], dtype=torch.int64)
        b = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._done()
        try:
            works = [self.dist.isend(n, dst), self.dist.isend(b, dst)] + [self.dist.isend(t, dst) for t in tensors]
        except RuntimeError as e:
            raise self.lost(dst, e) from None
        self._pending.append((works, [n, b] + tensors))
        self.sent += 8 + len(data) + sum(t.numel() * t.element_size() for t in tensors)

    def _done(self) -> None:
        """Wait for the sends whose buffers may now be freed (all but the latest)."""
        while len(self._pending) > 1:
            works, _ = self._pending.pop(0)
            for w in works:
                w.wait()

    def flush(self) -> None:
        for works, _ in self._pending:
            for w in works:
                w.wait()
        self._pending = []

    def recv(self, src: int) -> tuple[dict, list]:
        try:
            n = torch.empty(1, dtype=torch.int64)
            self.dist.recv(n, src)
            b = torch.empty(int(n[0]), dtype=torch.uint8)
            self.dist.recv(b, src)
            header = pickle.loads(b.numpy().tobytes())
            tensors = []
            for shape, dt in header.get("shapes", ()):
                t = torch.empty(shape, dtype=_DTYPES[dt])
                self.dist.recv(t, src)
                tensors.append(t)
        except RuntimeError as e:
            raise self.lost(src, e) from None
        return header, tensors

    def lost(self, peer: int, e: BaseException) -> PipelineError:
        msg = str(e)
        why = ("did not answer within the timeout (hung, or too slow: raise --pipeline-timeout)"
               if "imed out" in msg or "timeout" in msg.lower() else
               "closed the connection (it exited or crashed: see its own output)")
        return PipelineError(
            f"{self.who(self.rank)}: lost contact with {self.who(peer)}, which {why}. The pipeline cannot go "
            f"on without every rank, so this rank stops; no result of the unfinished step was produced or "
            f"written. ({msg.splitlines()[0][:200] if msg else type(e).__name__})")
