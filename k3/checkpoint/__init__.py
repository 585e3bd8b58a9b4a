"""Checkpoint access: strict safetensors headers, the tensor index, byte-range reads, writer."""

from .io import (
    ALIGN,
    TORCH_DTYPES,
    FaultHook,
    ReadHook,
    ShardFiles,
    aligned_empty,
    direct_span,
    load_tensor,
)
from .safetensors import (
    DTYPE_SIZES,
    IGNORED_PREFIXES,
    INDEX_NAME,
    CheckpointIndex,
    ShardHeader,
    TensorInfo,
    read_header,
    read_shard_header,
)
from .writer import write_checkpoint, write_safetensors

__all__ = [
    "ALIGN",
    "DTYPE_SIZES",
    "IGNORED_PREFIXES",
    "INDEX_NAME",
    "TORCH_DTYPES",
    "CheckpointIndex",
    "FaultHook",
    "ReadHook",
    "ShardFiles",
    "ShardHeader",
    "TensorInfo",
    "aligned_empty",
    "direct_span",
    "load_tensor",
    "read_header",
    "read_shard_header",
    "write_checkpoint",
    "write_safetensors",
]
