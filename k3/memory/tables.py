"""Model tables (embedding, lm_head) streamed from the checkpoint instead of held in
RAM: the ultra-low-memory mode. The embedding is read one row per token; lm_head is
handed to the math in row chunks through one reused buffer. Results are bit-identical
to the resident tables (each logit row is computed on its own either way)."""

from __future__ import annotations

import torch

from ..checkpoint.io import TORCH_DTYPES, ShardFiles
from .planner import TABLE_CHUNK_BYTES as CHUNK_BYTES


class StreamedEmbedding:
    def __init__(self, info, reader: ShardFiles):
        self.info = info
        self.reader = reader
        self.rows, self.cols = info.shape
        self.row_bytes = info.nbytes // self.rows
        self.dtype = TORCH_DTYPES[info.dtype]
        self.bytes_read = 0

    def rows_for(self, ids) -> torch.Tensor:
        out = torch.empty(len(ids), self.row_bytes, dtype=torch.uint8)
        for j, t in enumerate(ids):
            self.reader.read_into((self.info.file, self.info.offset + int(t) * self.row_bytes, self.row_bytes), out[j])
        self.bytes_read += len(ids) * self.row_bytes
        return out.view(self.dtype).reshape(len(ids), self.cols).to(torch.float32)


class StreamedRows:
    """RowChunks over a [rows, cols] checkpoint tensor, read chunk by chunk into one
    buffer that is reused (so at most CHUNK_BYTES of it is ever resident)."""

    def __init__(self, info, reader: ShardFiles, chunk_bytes: int = CHUNK_BYTES):
        self.info = info
        self.reader = reader
        self.shape = tuple(info.shape)
        self.row_bytes = info.nbytes // self.shape[0]
        self.rows_per_chunk = min(self.shape[0], max(1, chunk_bytes // self.row_bytes))
        self.dtype = TORCH_DTYPES[info.dtype]
        self._buf = torch.empty(self.rows_per_chunk * self.row_bytes, dtype=torch.uint8)
        self.bytes_read = 0

    def chunks(self):
        rows, cols = self.shape
        for r0 in range(0, rows, self.rows_per_chunk):
            n = min(self.rows_per_chunk, rows - r0)
            view = self._buf[: n * self.row_bytes]
            self.reader.read_into((self.info.file, self.info.offset + r0 * self.row_bytes, n * self.row_bytes), view)
            self.bytes_read += n * self.row_bytes
            yield view.view(self.dtype).reshape(n, cols)
