"""Synthetic checkpoints in the exact release format (`k3 synth`).

`synthesize(out_dir, preset, arch, seed, layers, experts)` writes a model folder that
looks like the real K3 (or Kimi-Linear-48B) release down to the byte layout, with
random weights of the right shapes and dtypes:

* `config.json` — K3's nested form (`KimiK3ForConditionalGeneration`, the text model in
  `text_config`, `quantization_config` inside it, a `vision_config` stub) or
  Kimi-Linear's flat form. The ModelConfig used for the tensor graph is obtained by
  parsing the very dict that is written (k3.config.parse_config), so the files and the
  reader can never disagree.
* shards `model-000NN-of-0000MM.safetensors` (K3: 5-digit index, 6-digit total, like
  the release) + `model.safetensors.index.json`, written last. Tensor names, shapes
  and the tensor set come from k3.schema (the one home of the tensor graph).
* `tiktoken.model` (a real byte-level BPE vocabulary learned from a built-in text
  sample), `tokenizer_config.json` (K3's special ids at the release's offsets),
  `generation_config.json`, and `k3_synth.json` (what was generated, for humans).

The package, by subject:
* `presets.py` — the presets, the special tokens, the overrides and `build_config`;
* `bpe.py` — the BPE vocabulary (`train_bpe`) and the tokenizer files;
* `draw.py` — the seeded random streams, gaussian tables and direct MXFP4 sampling;
* `plan.py` — `SynthPlan` and `make_plan` (the shard layout: its invariants and dtypes
  are described there) and `describe_plan` (`k3 synth --dry-run`);
* `values.py` — each tensor's data (`tensor_value`; the scales are described there);
* `write.py` — `synthesize`: the folder, the shards (worker processes), the index.
"""

from __future__ import annotations

from .bpe import train_bpe
from .draw import _sample_mxfp4, _stream  # noqa: F401 - the tests sample these streams directly
from .plan import SynthPlan, _Expert, describe_plan, make_plan  # noqa: F401 - _Expert: k3.projection, benchmarks
from .presets import ARCHS, K3_BASE, NUM_SPECIAL, PRESETS, build_config, special_tokens  # noqa: F401 - the ids
from .values import tensor_value
from .write import PARALLEL_FROM, WORKER_BYTES, synthesize  # noqa: F401 - the workers' thresholds

__all__ = [
    "PRESETS",
    "ARCHS",
    "SynthPlan",
    "build_config",
    "make_plan",
    "synthesize",
    "tensor_value",
    "train_bpe",
    "special_tokens",
    "describe_plan",
]
