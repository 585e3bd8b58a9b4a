"""Conversation state files (`--save-state` / `--load-state`). (In-memory snapshots, to
undo a forward pass cut short, are InferenceState.snapshot / restore.)

File format: one safetensors file (no pickle; the `safetensors` library can read it),
written atomically (temporary name, fsync, rename). The header's `__metadata__`:

  format              "k3-state"
  version             "1"
  config_fingerprint  ModelConfig.fingerprint() of the model that wrote it
  arch, hidden_size, num_hidden_layers, vocab_size   (for the refusal messages)
  n_layers            layers in the state (fewer than the model's with --layers)
  positions           tokens already in the state (fed through the model)
  tokens              all tokens of the sequence, fed + pending
  sha256              hash of the data section (every tensor's bytes, in order)
  kv_form             MLA KV cache form: "latent", "expanded" (the default when
                      absent: files from before k3 0.2's latent cache), or "none"
                      (the state binds no MLA layer)
  extra               JSON object for the front end (e.g. the chat messages)
  written_by          "k3 <version>"

Tensors (all fp32 except `ids`):
  ids                        I64 [tokens]   the sequence; ids[positions:] are pending
                                            (e.g. the last generated token, not yet fed)
  layers.{i}.conv_q/k/v      F32 [K-1, C]   KDA short-conv histories
  layers.{i}.S               F32 [H, dk, dv] KDA recurrent state
  layers.{i}.k / .v          F32 MLA KV cache: latent form (kv_form "latent") k = the
                             normalised latents [positions, kv_lora_rank], v = the rope
                             keys [positions, rope]; expanded form k [positions, H,
                             nope+rope], v [positions, H, v_dim]
Layers hold no tensors when positions == 0.

Loading refuses, with the reason: a file that is not a k3 state file, another format
version, a state written by another model (fingerprint) or for another layer count, a
truncated or damaged file (size, shapes, checksum), a hand-edited header (a metadata
value of the wrong type, a count that is not a decimal string, an `extra` that is not a
JSON object, an entry whose dtype/shape/offsets do not match), and a state with more
positions than the run's KV capacity (`max_positions`), and a KV cache form other than
the run's (`--kv`). Every refusal is a
StateFileError naming the file and the field; nothing is allocated before the header
and the file size agree.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .version import __version__
from .fsutil import JSONProblem, json_kind, loads_json, path_problem, short_repr
from .errors import K3Error, UsageError
from .model.kda_state import KDAState
from .model.mla import MLAState
from .model.stack import InferenceState

FORMAT = "k3-state"
VERSION = 1
MAX_HEADER = 100_000_000
_CHUNK = 64 << 20
_DT = {"F32": (torch.float32, 4), "I64": (torch.int64, 8)}
# Counts in the metadata are decimal strings; 15 digits (10^15 tokens) is beyond any
# file, and bounds the arithmetic done before the file size refuses a damaged count.
_COUNT_RE = re.compile(r"[0-9]{1,15}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")


class StateFileError(K3Error):
    """A state file that cannot be used (exit code 2: a usage problem, the model is fine)."""

    exit_code = 2


@dataclass
class LoadedState:
    state: InferenceState
    pending: list[int]
    extra: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return list(self.state.ids) + list(self.pending)


# ---------------------------------------------------------------- shapes
def _kda_shapes(cfg) -> dict[str, tuple[int, ...]]:
    H, D, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
    return {"conv_q": (K - 1, H * D), "conv_k": (K - 1, H * D), "conv_v": (K - 1, H * D), "S": (H, D, D)}


def _kv_form(state: InferenceState) -> str:
    """The MLA KV cache form of a state's layers; "none" when it binds no MLA layer."""
    forms = {ls.latent for ls in state.layers if isinstance(ls, MLAState)}
    if len(forms) > 1:
        raise ValueError("a state mixes latent and expanded MLA KV caches")
    return "none" if not forms else "latent" if forms.pop() else "expanded"


def _mla_shapes(cfg, positions: int, latent: bool) -> dict[str, tuple[int, ...]]:
    if latent:
        return {"k": (positions, cfg.kv_lora_rank), "v": (positions, cfg.qk_rope_head_dim)}
    H = cfg.mla_num_heads
    return {"k": (positions, H, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), "v": (positions, H, cfg.v_head_dim)}


def _layer_tensors(cfg, state: InferenceState) -> list[tuple[str, torch.Tensor]]:
    P = state.position
    out: list[tuple[str, torch.Tensor]] = []
    for i, ls in enumerate(state.layers):
        if isinstance(ls, KDAState):
            fields = {"conv_q": ls.conv_q, "conv_k": ls.conv_k, "conv_v": ls.conv_v, "S": ls.S}
        elif isinstance(ls, MLAState):
            fields = {"k": ls.k, "v": ls.v}
            if ls.length != P:
                raise K3Error(f"cannot save the state: MLA layer {i} holds {ls.length} positions but the sequence "
                              f"has {P} (the state is inconsistent).")
        else:
            raise K3Error(f"cannot save the state: layer {i} holds a {type(ls).__name__}, not KDA or MLA state.")
        for name, t in fields.items():
            if t is None:
                if P:
                    raise K3Error(f"cannot save the state: layer {i} has no {name} although {P} positions were fed.")
                continue
            out.append((f"layers.{i}.{name}", t.detach().to(torch.float32).contiguous()))
    return out


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def checksum(tensors) -> str:
    """sha256 of the data section: every tensor's bytes, in order (the `sha256` field)."""
    h = hashlib.sha256()
    for _, t in tensors:
        mv = _tensor_bytes(t)
        for i in range(0, len(mv), _CHUNK):
            h.update(mv[i:i + _CHUNK])
    return h.hexdigest()


# ---------------------------------------------------------------- save
def save_state(path, state: InferenceState, cfg, pending: Sequence[int] = (), extra: dict | None = None,
               fsync: bool = True) -> int:
    """Write `state` (+ `pending` tokens not yet fed) to `path` atomically; returns
    the file size in bytes."""
    from .checkpoint.writer import write_safetensors

    if not getattr(state, "whole", True):
        raise UsageError(f"{path}: cannot save this state: it is one rank's part of a pipeline over several "
                         "processes (the other ranks hold the rest of its layers). Save and resume states in a "
                         "single-process run (without torchrun).")
    ids = [int(t) for t in state.ids] + [int(t) for t in pending]
    tensors = [("ids", torch.tensor(ids, dtype=torch.int64))] + _layer_tensors(cfg, state)
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "config_fingerprint": cfg.fingerprint(),
        "arch": str(cfg.arch),
        "hidden_size": str(cfg.hidden_size),
        "num_hidden_layers": str(cfg.num_hidden_layers),
        "vocab_size": str(cfg.vocab_size),
        "n_layers": str(len(state.layers)),
        "positions": str(state.position),
        "tokens": str(len(ids)),
        "sha256": checksum(tensors),
        "kv_form": _kv_form(state),
        "extra": json.dumps(extra or {}, ensure_ascii=False),
        "written_by": f"k3 {__version__}",
    }
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise UsageError(f"{path}: the folder {p.parent} does not exist.")
    write_safetensors(p, tensors, metadata=meta, fsync=fsync, what="the state file")
    return p.stat().st_size


# ---------------------------------------------------------------- load
def _refuse(path, why: str) -> StateFileError:
    return StateFileError(f"REFUSING to load {path}: {why}")


def read_state_header(path, fmt: str = FORMAT) -> tuple[dict, dict, int, int]:
    """(metadata, tensor entries, data start, file size); refuses files that are not
    k3 state files or are cut short. Every refusal is a StateFileError naming the file."""
    p = Path(path)
    why = path_problem(p)
    if why == "does not exist":
        raise StateFileError(f"{path}: no such state file.")
    if why is not None:
        raise StateFileError(f"{path}: the state file {why}.")
    try:
        size = p.stat().st_size
        f = open(p, "rb")
    except FileNotFoundError:
        raise StateFileError(f"{path}: no such state file.") from None
    except OSError as e:
        raise StateFileError(f"{path}: cannot read the state file ({e.strerror}).") from None
    with f:
        head = f.read(8)
        if len(head) < 8:
            raise _refuse(path, f"it is {size} bytes long, too short to be a k3 state file (truncated or empty).")
        n = int.from_bytes(head, "little")
        if n < 2 or n > MAX_HEADER:
            raise _refuse(path, "it is not a k3 conversation state file (no safetensors header).")
        if 8 + n > size:
            raise _refuse(path, f"the file is truncated: its header alone needs {8 + n} bytes and the file has {size}.")
        raw = f.read(n)
    if len(raw) < n:
        raise _refuse(path, f"the file is truncated: its header alone needs {8 + n} bytes.")
    try:
        hdr = loads_json(raw)
    except JSONProblem as e:
        raise _refuse(path, f"it is not a k3 conversation state file (its header {e.problem}).") from None
    if not isinstance(hdr, dict):
        raise _refuse(path, "it is not a k3 conversation state file.")
    meta = hdr.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise _refuse(path, "it is not a k3 conversation state file (a safetensors file without k3 state "
                            "metadata; a model shard, perhaps?). Give a file written by --save-state.")
    return meta, hdr, 8 + n, size


def _count(path, meta: dict, key: str, what: str) -> int:
    """A count from the metadata: a decimal string (safetensors metadata is string ->
    string), else a StateFileError naming the field."""
    v = meta.get(key)
    if v is None:
        raise _refuse(path, f"its metadata is incomplete: it lacks `{key}` ({what}); the file is damaged.")
    if not isinstance(v, str) or not _COUNT_RE.fullmatch(v):
        raise _refuse(path, f"its metadata field `{key}` ({what}) is {json_kind(v)}, "
                            "not a non-negative integer written as a string (at most 15 digits); the file is "
                            "damaged.")
    return int(v)


def _extra(path, meta: dict) -> dict:
    v = meta.get("extra")
    if v is None or v == "":
        return {}
    if not isinstance(v, str):
        raise _refuse(path, f"its metadata field `extra` is {json_kind(v)}, not a JSON object written as a string; "
                            "the file is damaged.")
    try:
        extra = loads_json(v)
    except JSONProblem as e:
        raise _refuse(path, f"its metadata field `extra` {e.problem}; the file is damaged.") from None
    if not isinstance(extra, dict):
        raise _refuse(path, f"its metadata field `extra` holds {json_kind(extra)}, not a JSON object; the file is "
                            "damaged.")
    return extra


def _layout(path, entries: dict, start: int, size: int, expect: list) -> list:
    """Where each expected tensor (name, dtype, shape) lies in the data section: the
    header's entries checked against ``expect``, in order, and the file's size against
    their end; anything else is a refusal naming the tensor."""
    names = {e[0] for e in expect}
    extra_names = sorted(set(entries) - names)
    if extra_names:
        raise _refuse(path, f"it holds tensors this model's state has no place for "
                            f"({', '.join(short_repr(n, 40) for n in extra_names[:3])}); "
                            "the file is damaged or from another model.")
    end = 0
    layout = []
    for name, dt, shape in expect:
        e = entries.get(name)
        if e is None:
            raise _refuse(path, f"tensor {name} is missing; the file is damaged.")
        if not isinstance(e, dict):
            raise _refuse(path, f"the header entry of tensor {name} is {json_kind(e)}, not an object; the file is "
                                "damaged.")
        e_dt, e_shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if (e_dt != dt or not isinstance(e_shape, list) or not all(type(x) is int for x in e_shape)
                or tuple(e_shape) != shape):
            raise _refuse(path, f"tensor {name} is {short_repr(e_dt, 20)} {short_repr(e_shape, 40)}, expected {dt} "
                                f"{list(shape)}; the file is damaged or from another model.")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)):
            raise _refuse(path, f"tensor {name}'s data_offsets {short_repr(offs, 40)} is not a pair of integers; the "
                                "file is damaged.")
        b, t = offs
        nbytes = math.prod(shape) * _DT[dt][1]
        if b != end or t != b + nbytes:
            raise _refuse(path, f"tensor {name} is not where the format puts it; the file is damaged.")
        end = t
        layout.append((name, dt, shape, b))
    if start + end != size:
        if start + end > size:
            raise _refuse(path, f"the file is truncated: it should be {start + end} bytes and it is {size}.")
        raise _refuse(path, f"the file has {size - start - end} bytes after its last tensor; it is damaged.")

    return layout


def read_tensors(path, entries: dict, start: int, size: int, expect: list, sha: str) -> dict:
    """The tensors ``expect`` lists ([(name, "F32"|"I64", shape)], in the order they were
    written) of a file whose header read_state_header gave (``entries``, ``start``,
    ``size``), checked: layout, size, and the data's sha256 against ``sha``."""
    layout = _layout(path, entries, start, size, expect)
    h = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise StateFileError(f"{path}: cannot read the state file ({e.strerror}).") from None
    with f:
        for name, dt, shape, b in layout:
            t = torch.empty(shape, dtype=_DT[dt][0])
            mv = _tensor_bytes(t)
            got = 0
            try:
                f.seek(start + b)
                while got < len(mv):
                    n = f.readinto(mv[got:got + _CHUNK])
                    if not n:
                        raise _refuse(path, f"the file is truncated inside tensor {name}.")
                    got += n
            except OSError as e:
                raise StateFileError(
                    f"{path}: reading tensor {name} of the state file failed ({e.strerror or e}).") from None
            for i in range(0, len(mv), _CHUNK):
                h.update(mv[i:i + _CHUNK])
            tensors[name] = t
    if sha != h.hexdigest():
        raise _refuse(path, "its checksum does not match its contents; the file is damaged.")
    return tensors


def load_state(path, cfg, max_positions: int | None = None, n_layers: int | None = None,
               latent: bool = True) -> LoadedState:
    """Read a state file for this model. `max_positions` is the run's KV capacity
    (refused when the state holds more tokens; the loaded KV caches get room for that
    many); `n_layers` the layers bound in this run (default all); `latent` the run's KV
    cache form (a file of the other form is refused). Everything read from the header is checked for its type and
    range before it is used: a damaged or hand-edited file is a StateFileError naming
    the field, never another exception."""
    meta, entries, start, size = read_state_header(path)
    version = meta.get("version")
    if isinstance(version, str) and _COUNT_RE.fullmatch(version):
        version_n = int(version)
    elif version is None:
        version_n = None
    else:
        raise _refuse(path, f"its metadata field `version` is {json_kind(version)}, "
                            "not a format version number written as a string; the file is damaged.")
    if version_n != VERSION:
        raise _refuse(path, f"it is state format version {version!r}; this k3 reads version {VERSION}. "
                            "Re-create it with this version (a state file is not portable across formats).")
    fp = cfg.fingerprint()
    if meta.get("config_fingerprint") != fp:
        def shown(key):  # a foreign file's values, printable and short
            v = meta.get(key)
            return v[:40] if isinstance(v, str) and v.isprintable() else short_repr(v, 40)
        raise _refuse(path, f"it was written by a different model architecture (config fingerprint "
                            f"{shown('config_fingerprint')} vs {fp} here: {shown('arch')} hidden="
                            f"{shown('hidden_size')} layers={shown('num_hidden_layers')} vocab="
                            f"{shown('vocab_size')}, this model is {cfg.arch} hidden={cfg.hidden_size} layers="
                            f"{cfg.num_hidden_layers} vocab={cfg.vocab_size}). A state only continues the model "
                            "that wrote it.")
    want_layers = cfg.num_hidden_layers if n_layers is None else n_layers
    nl = _count(path, meta, "n_layers", "layers in the state")
    positions = _count(path, meta, "positions", "tokens already fed")
    ntok = _count(path, meta, "tokens", "tokens in the sequence")
    extra = _extra(path, meta)
    sha = meta.get("sha256")
    if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
        raise _refuse(path, f"its metadata field `sha256` is {json_kind(sha)}, "
                            "not a SHA-256 hex digest; the file is damaged.")
    if nl != want_layers:
        raise _refuse(path, f"it holds state for {nl} layers and this run binds {want_layers} (--layers must match "
                            "the run that saved it).")
    if not 0 <= positions <= ntok:
        raise _refuse(path, f"its metadata says {positions} positions of {ntok} tokens; the file is damaged.")
    if max_positions is not None and ntok > max_positions:
        raise _refuse(path, f"it holds {ntok} positions, more than this run's KV capacity of {max_positions} "
                            "positions. Raise the capacity (--gen / --max-context) or shorten the new prompt.")
    form = meta.get("kv_form", "expanded")  # files from before the latent form hold the expanded one
    if form not in ("latent", "expanded", "none"):
        raise _refuse(path, f"its metadata field `kv_form` is {json_kind(form)}, not latent, expanded or none; the "
                            "file is damaged.")
    if form != "none" and (form == "latent") != latent:
        raise _refuse(path, f"its MLA KV cache is in the {form} form and this run uses the "
                            f"{'latent' if latent else 'expanded'} one; run with --kv {form}.")

    # expected tensors, in the order save_state writes them
    expect: list[tuple[str, str, tuple[int, ...]]] = [("ids", "I64", (ntok,))]
    for i in range(nl):
        if positions == 0:
            break
        shapes = _mla_shapes(cfg, positions, latent) if cfg.is_mla(i) else _kda_shapes(cfg)
        expect += [(f"layers.{i}.{k}", "F32", s) for k, s in shapes.items()]
    tensors = read_tensors(path, entries, start, size, expect, sha)
    ids = tensors["ids"].tolist()
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise _refuse(path, f"it holds token id {bad[0]}, outside this model's vocabulary; the file is damaged.")
    state = InferenceState.fresh(cfg, nl, max_positions or 0, latent)
    state.ids = ids[:positions]
    if positions:
        for i, ls in enumerate(state.layers):
            if isinstance(ls, KDAState):
                ls.conv_q, ls.conv_k, ls.conv_v, ls.S = (tensors[f"layers.{i}.{k}"] for k in ("conv_q", "conv_k", "conv_v", "S"))
            else:
                ls.k, ls.v = tensors[f"layers.{i}.k"], tensors[f"layers.{i}.v"]
    return LoadedState(state, ids[positions:], extra, meta)
