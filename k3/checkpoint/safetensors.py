"""Strict safetensors header parser and the checkpoint index, under their old import
path: the parser (one shard's header, :class:`TensorInfo`) is :mod:`k3.checkpoint.header`,
the index over all shards of a checkpoint directory (:class:`CheckpointIndex`) is
:mod:`k3.checkpoint.index`. Split by subject to keep each file short; code that imports
from here keeps working unchanged.
"""

from __future__ import annotations

from .header import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    ShardHeader,
    TensorInfo,
    pread_exact,
    read_header,
    read_shard_header,
)
from .index import IGNORED_PREFIXES, INDEX_NAME, CheckpointIndex, read_index, shard_paths

__all__ = [
    "DTYPE_SIZES",
    "IGNORED_PREFIXES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "CheckpointIndex",
    "ShardHeader",
    "TensorInfo",
    "pread_exact",
    "read_header",
    "read_index",
    "read_shard_header",
    "shard_paths",
]
