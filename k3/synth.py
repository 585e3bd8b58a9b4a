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

Layout invariants (the release's, and what readers are tested against):
* each layer's non-expert tensors form ONE gap-free run inside one shard;
* each routed expert's tensors form one contiguous run in the release order
  (w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale);
* experts are not in id order inside a shard (seeded permutation), the layer's trunk
  run sits between experts, and the last few experts of a layer spill into the next
  layer's shard (harder than the release, on purpose: readers must use the index);
* embedding/norm/lm_head in a shard of their own; K3 adds a last shard holding two
  small vision tensors (`vision_tower.*`, `mm_projector.*`) that the text reader ignores.

Dtypes: K3 stores `A_log`, `dt_bias`, `e_score_correction_bias`, `{q,k,v}_conv1d.weight`
and `o_norm.weight` as F32, packed experts as U8, everything else BF16; K3's `A_log` is
zero-padded to a multiple of 128. Kimi-Linear is all BF16 (`A_log` [1, 1, H, 1]).

Weights are deterministic for a seed: every tensor has its own PCG64 stream keyed by
(seed, full tensor name), so the values do not depend on the layout, on which other
tensors exist or on `--layers` (a layer present in two runs is the same). Gaussians
are drawn by inverse-CDF table lookup (65,536 quantiles of N(mean, std), rounded to
bf16) from 16 random bits per element, which is ~5x faster than torch.randn and keeps
the realdims preset (several GB) in the tens of seconds. Memory stays bounded: one
shard is generated, written and dropped at a time.

Scales are chosen so a forward pass stays finite and routing is non-degenerate:
matrices ~ N(0, 1/fan_in), norm gains 1 + N(0, 0.02), AttnRes pseudo-queries
N(0, 1/d), A_log = linspace(-0.4, 1.2) per head, small dt_bias, router rows
N(0, 1/d) (so gate logits ~ N(0, 1) for a normalised input) and a small linspace
correction bias, lm_head N(0, 1/d).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import re
import shutil
import time
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .checkpoint.safetensors import INDEX_NAME
from .checkpoint.writer import safetensors_layout
from .config import ModelConfig, parse_config
from .errors import EXIT_RUNTIME, K3Error, UsageError
from .fsutil import atomic_write
from .units import human
from .schema import expert_specs, global_specs, layer_specs

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

ARCHS = ("k3", "kimi_linear")
NUM_SPECIAL = 256
K3_BASE = 163584  # first special id of the release (its 163,584 BPE ranks)

# ------------------------------------------------------------------------ presets
# Per-preset shapes. K3 keeps the release's structure (KDA x3 + MLA, last layer MLA,
# dense layer 0, latent MoE, 2 shared experts, SiTU); realdims uses K3's real
# per-tensor shapes with few layers/experts and a small vocabulary.
def _kimi_linear(k3: dict, **over) -> dict:
    """The Kimi-Linear preset beside a K3 one: the same trunk shapes without K3's latent
    MoE, Attention Residuals and MXFP4 experts, a plain q_proj, one shared expert."""
    d = {k: v for k, v in k3.items() if k not in ("latent", "attn_res", "expert_mode")}
    return {**d, "q_lora": None, "shared": 1, **over}


_TINY = dict(hidden=128, layers=8, vocab=1280, kda_heads=4, kda_head_dim=32, mla_heads=4, q_lora=64, kv_lora=32,
             nope=16, rope=8, v=16, inter=256, experts=16, topk=4, moe_inter=64, shared=2, latent=64, attn_res=3,
             expert_mode="encode")
_SMALL = dict(hidden=768, layers=14, vocab=2304, kda_heads=6, kda_head_dim=128, mla_heads=6, q_lora=256,
              kv_lora=128, nope=64, rope=32, v=64, inter=2048, experts=32, topk=8, moe_inter=256, shared=2,
              latent=384, attn_res=4, expert_mode="packed")
# K3's real per-tensor shapes (docs/MODEL.md §1-2); 4 layers: KDA, KDA, KDA, MLA.
_REALDIMS = dict(hidden=7168, layers=4, vocab=2304, kda_heads=96, kda_head_dim=128, mla_heads=96, q_lora=1536,
                 kv_lora=512, nope=128, rope=64, v=128, inter=33792, experts=32, topk=16, moe_inter=3072, shared=2,
                 latent=3584, attn_res=12, expert_mode="packed")
# K3's expert ratio at tiny dims: 896 routed experts per MoE layer, top-16 (the pool a
# batch or a draft shares so little of), so tests see K3's cache and routing regime in
# seconds (three MoE layers, ~17 MB).
_POOL = dict(_TINY, layers=4, experts=896, topk=16, expert_mode="packed")
PRESETS: dict[str, dict[str, dict]] = {
    "tiny": {"k3": _TINY, "kimi_linear": _kimi_linear(_TINY)},
    "pool": {"k3": _POOL, "kimi_linear": _kimi_linear(_POOL)},
    "small": {"k3": _SMALL, "kimi_linear": _kimi_linear(_SMALL)},
    # Kimi-Linear-48B's real per-tensor shapes (docs/MODEL.md §6).
    "realdims": {"k3": _REALDIMS, "kimi_linear": _kimi_linear(_REALDIMS, hidden=2304, kda_heads=32, mla_heads=32,
                                                               inter=9216, topk=8, moe_inter=1024)},
}

# Special tokens at their offsets from the first special id. K3's are those of docs/MODEL.md §5;
# Kimi-Linear's are K2-style (only BOS/EOS/<|im_end|>/PAD are confirmed).
_K3_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|end_of_msg|>", True),
    3: ("<|open|>", False), 4: ("<|close|>", False), 5: ("<|sep|>", False),
    6: ("[start_header_id]", True), 7: ("[end_header_id]", True), 9: ("[EOT]", True),
    18: ("<|media_begin|>", True), 19: ("<|media_content|>", True), 20: ("<|media_end|>", True),
    21: ("<|media_pad|>", True), 65: ("<osagent_mode>", True),
    254: ("[UNK]", True), 255: ("[PAD]", True),
}
_KL_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("[start_header_id]", True), 7: ("[end_header_id]", True),
    9: ("[EOT]", True), 10: ("<|im_system|>", True), 17: ("<|im_middle|>", True),
    254: ("[UNK]", True), 255: ("[PAD]", True),
}
_BOS, _EOS, _PAD, _MEDIA_PAD = 0, 2, 255, 21


def special_tokens(arch: str, n_ranks: int) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) of the named special tokens for a vocabulary of
    `n_ranks` BPE ranks (specials occupy ids n_ranks .. n_ranks + 255)."""
    table = _K3_SPECIALS if arch == "k3" else _KL_SPECIALS
    return {n_ranks + off: v for off, v in table.items()}


def _mla_layers(n_layers: int) -> list[int]:
    """0-based MLA layers: every 4th ((i + 1) % 4 == 0) plus the last, as in K3."""
    return sorted({i for i in range(n_layers) if (i + 1) % 4 == 0} | {n_layers - 1})


MAX_VOCAB = 1 << 20


def _resolve(preset: str, arch: str, layers: int | None, experts: int | None, vocab: int | None = None) -> dict:
    if arch not in ARCHS:
        raise UsageError(f"synth: unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}.")
    if preset not in PRESETS:
        raise UsageError(f"synth: unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    p = dict(PRESETS[preset][arch])
    if layers is not None:
        if not isinstance(layers, int) or layers < 2:
            raise UsageError(
                f"synth: --layers must be >= 2 (layer 0 is the dense layer and the last layer is MLA, "
                f"so a model with MoE needs at least 2), got {layers}.")
        p["layers"] = layers
    if experts is not None:
        if not isinstance(experts, int) or experts < p["topk"]:
            raise UsageError(
                f"synth: --experts must be >= the preset's top-k ({p['topk']} experts per token for "
                f"{preset}/{arch}), got {experts}.")
        p["experts"] = experts
    if vocab is not None:
        if not isinstance(vocab, int) or isinstance(vocab, bool) or not 2 * NUM_SPECIAL <= vocab <= MAX_VOCAB:
            raise UsageError(
                f"synth: --vocab must be between {2 * NUM_SPECIAL} (256 byte ranks and {NUM_SPECIAL} specials) and "
                f"{MAX_VOCAB}, got {vocab!r}; K3's release has {K3_BASE + NUM_SPECIAL}.")
        p["vocab"] = vocab
    return p


# ------------------------------------------------------------------------ config
def build_config(preset: str = "tiny", arch: str = "k3", layers: int | None = None,
                 experts: int | None = None, vocab: int | None = None) -> dict:
    """The config.json dict for a preset (K3 nested or Kimi-Linear flat)."""
    p = _resolve(preset, arch, layers, experts, vocab)
    L = p["layers"]
    n_ranks = p["vocab"] - NUM_SPECIAL
    bos, eos, pad = n_ranks + _BOS, n_ranks + _EOS, n_ranks + _PAD
    mla = _mla_layers(L)
    full_attn = [i + 1 for i in mla]
    kda = [i + 1 for i in range(L) if i not in mla]
    lac = {"full_attn_layers": full_attn, "kda_layers": kda, "num_heads": p["kda_heads"],
           "head_dim": p["kda_head_dim"], "short_conv_kernel_size": 4}
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": p["vocab"],
        "hidden_size": p["hidden"],
        "num_hidden_layers": L,
        "num_attention_heads": p["mla_heads"],
        "num_key_value_heads": p["mla_heads"],
        "q_lora_rank": p["q_lora"],
        "kv_lora_rank": p["kv_lora"],
        "qk_nope_head_dim": p["nope"],
        "qk_rope_head_dim": p["rope"],
        "v_head_dim": p["v"],
        "mla_use_nope": True,
        "linear_attn_config": lac,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "intermediate_size": p["inter"],
        "num_experts": p["experts"],
        "num_experts_per_token": p["topk"],
        "num_shared_experts": p["shared"],
        "moe_intermediate_size": p["moe_inter"],
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "bfloat16",
        "use_cache": True,
    }
    if arch == "kimi_linear":
        text.update({
            "auto_map": {
                "AutoConfig": "configuration_kimi.KimiLinearConfig",
                "AutoModel": "modeling_kimi.KimiLinearModel",
                "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
            },
            "head_dim": p["hidden"] // p["mla_heads"],  # present in the release, unused
            "hidden_act": "silu",
            "routed_scaling_factor": 2.446,
            "model_max_length": 1048576,
            "transformers_version": "4.56.2",
        })
        return text
    lac.update({"gate_lower_bound": -5.0, "use_full_rank_gate": True})
    text.update({
        "mla_use_output_gate": True,
        "attn_res_block_size": p["attn_res"],
        "routed_expert_hidden_size": p["latent"],
        "latent_moe_use_norm": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0,
        "transformers_version": "4.56.2",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8",
                        "observer": "minmax",
                    },
                    "input_activations": None,
                },
            },
            "ignore": [
                "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
            ],
            "kv_cache_scheme": None,
        },
    })
    vt_hidden = 32
    vision = {
        "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "vt_num_hidden_layers": 1, "vt_hidden_size": vt_hidden,
        "vt_num_attention_heads": 2, "vt_intermediate_size": 4 * vt_hidden, "qkv_hidden_size": 48,
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": vt_hidden, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "norm_type": "rmsnorm", "activation_func": "gelu_pytorch_tanh", "text_hidden_size": p["hidden"],
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "model_type": "kimi_k3",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "bfloat16",
        "ignore_index": -100,
        "media_placeholder_token_id": n_ranks + _MEDIA_PAD,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "tie_word_embeddings": False,
        "transformers_version": "4.56.2",
        "text_config": text,
        "vision_config": vision,
    }


# ------------------------------------------------------------------------ tokenizer
# A small built-in training text (English prose, Chinese, code, data) for the BPE
# vocabulary. Written for this file; its only job is to give realistic merges.
_CORPUS_EN = """\
The capital of France is Paris, and the capital of Japan is Tokyo. The river that runs
through Paris is the Seine; the one through London is the Thames. People who travel
between the two cities often take the train, which crosses under the sea in about two
hours and twenty minutes. In the morning the station is crowded with commuters,
students, and tourists carrying heavy bags.

Once upon a time there was a small village at the edge of a forest. Every evening the
baker would close his shop, sweep the floor, and walk down to the lake to watch the
sun go down. One day he found a letter under a stone. It said: "The bread you make is
the best in the world, but you have forgotten the salt." He laughed, because it was
true. The next morning he added the salt, and the whole village noticed the difference.

Machine learning models are trained by adjusting their parameters to reduce a loss
function. A language model predicts the next token given the previous tokens. The
model reads a sequence of integers, looks up an embedding vector for each one, and
passes the vectors through many layers of attention and feed-forward networks. At the
end, a linear layer produces one score for every token in the vocabulary, and the
highest score is chosen when decoding greedily. Mixture-of-experts models route each
token to a few experts out of many, so that only a small fraction of the parameters is
used for any single token. This makes very large models affordable to run, as long as
the weights can be read from memory or from disk quickly enough.

Linear attention replaces the softmax over all previous tokens with a recurrent state
that is updated once per token. The delta rule writes the difference between the new
value and the value the state already predicts for the key. A decay gate lets the
model forget old information at a learned rate for every channel. Because the state
has a fixed size, the cost of each new token does not grow with the length of the
context, which is why hybrid models interleave a few full attention layers with many
linear ones.

How do you make a good cup of tea? Boil fresh water, warm the pot, add one spoon of
leaves for each person and one for the pot, pour the water, and wait three to five
minutes. Some people add milk first; others insist that the milk must come after the
tea. The argument has lasted for more than a hundred years and will probably never end.

Weather report: cloudy in the north with light rain in the afternoon, sunny and warm in
the south. Temperatures between 12 and 24 degrees. Winds from the west at 15 kilometres
per hour. Tomorrow will be colder, with a chance of snow on the mountains above 1800
metres. Drivers should check the road conditions before they leave.

Dear team, thank you for the quick review. I have updated the pull request: the reader
now refuses a truncated file with a clear message, the tests cover the empty shard, and
the documentation explains why we check every offset. Please take another look when you
have time. If everything is fine, I will merge it tomorrow morning and tag the release.

Questions and answers. What is the largest planet in our solar system? Jupiter. How many
continents are there? Seven. Who wrote the play about a prince of Denmark? Shakespeare.
What is the boiling point of water at sea level? One hundred degrees Celsius. Why is the
sky blue? Because air scatters short wavelengths of sunlight more than long ones.
"""

_CORPUS_ZH = """\
今天天气很好，我们一起去公园散步吧。公园里有很多人在跑步、打太极拳，还有孩子们在草地上放风筝。
北京是中国的首都，上海是最大的城市之一。长江是中国最长的河流，黄河被称为中华民族的母亲河。
机器学习模型通过调整参数来降低损失函数。语言模型根据前面的词预测下一个词。
混合专家模型把每个词分配给少数几个专家，所以每次只需要计算一小部分参数。
线性注意力用一个固定大小的状态代替对所有历史词的注意力，每来一个新词就更新一次状态。
请问，去火车站怎么走？一直往前走，到第二个路口向左转，再走五分钟就到了。谢谢您！不客气。
我喜欢读书，也喜欢听音乐。周末的时候，我常常和朋友一起做饭、聊天、看电影。
这个问题很难，但是只要我们认真思考，一步一步地分析，就一定能找到答案。
学而时习之，不亦说乎？有朋自远方来，不亦乐乎？三人行，必有我师焉。
春天来了，花开了，小鸟在树上唱歌。夏天很热，我们去海边游泳。秋天的树叶变成了金黄色。冬天下雪了。
程序员写代码的时候，要注意变量的命名、函数的长度和错误的处理。测试可以帮助我们发现问题。
"""

_CORPUS_CODE = '''\
import json
import os
from pathlib import Path


def load_config(path: str) -> dict:
    """Read a JSON config file and return it as a dictionary."""
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab
        self.inverse = {v: k for k, v in vocab.items()}

    def encode(self, text: str) -> list[int]:
        return [self.vocab[ch] for ch in text if ch in self.vocab]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.inverse[i] for i in ids)


def softmax(xs):
    m = max(xs)
    exps = [math.exp(x - m) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int compare(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int values[] = {42, 7, 19, 3, 88, 61};
    size_t n = sizeof(values) / sizeof(values[0]);
    qsort(values, n, sizeof(int), compare);
    for (size_t i = 0; i < n; i++) {
        printf("%d\\n", values[i]);
    }
    return 0;
}

fn main() {
    let words = vec!["alpha", "beta", "gamma"];
    for (index, word) in words.iter().enumerate() {
        println!("{}: {}", index, word);
    }
}

SELECT name, COUNT(*) AS total FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY total DESC;

{"model": "kimi", "layers": 93, "hidden_size": 7168, "experts": [0, 1, 2, 3], "enabled": true, "note": null}
<div class="header"><a href="/index.html">Home</a> | <a href="/docs/">Docs</a></div>
$ git commit -m "Fix the shard index" && git push origin main
'''


def _corpus() -> str:
    # A deterministic block of numbers (dates, times, prices, sums) so that 1-3 digit
    # groups get their own tokens, as in real vocabularies.
    nums = []
    for i in range(1, 160):
        a, b = (i * 37) % 1000, (i * 91 + 7) % 1000
        nums.append([f"{2000 + i % 30}-{1 + i % 12:02d}-{1 + i % 28:02d} {i % 24:02d}:{(i * 7) % 60:02d}",
                     f"{a} + {b} = {a + b}", f"row {i}: {a}, {b}, {(a * b) % 997}",
                     f"${a}.{b % 100:02d}"][i % 4])
    return _CORPUS_EN + "\n" + _CORPUS_ZH + "\n" + _CORPUS_CODE + "\n" + "\n".join(nums) + "\n"


def train_bpe(text: str, n_ranks: int, fill: bool = False) -> list[bytes]:
    """Byte-level BPE: returns `n_ranks` distinct tokens (bytes), rank = list index.

    Ranks 0..255 are the single bytes 0x00..0xFF; then one token per merge, learned
    greedily (most frequent adjacent pair, ties to the lowest pair of ranks) over the
    pieces of `text` split with Kimi's pre-tokenizer pattern, so merges never cross a
    piece boundary. A merge whose bytes already exist as a token reuses that token.

    With `fill`, ranks past what the text supports are filler tokens that no text can
    reach (0xF8, a byte UTF-8 never uses, then the rank), so a release-sized vocabulary
    (K3's 163,584 ranks) keeps its learned merges."""
    import regex

    from .tokenizer import PAT_STR

    if n_ranks < 256:
        raise ValueError(f"a byte-level vocabulary needs >= 256 ranks, got {n_ranks}")
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    rank_of: dict[bytes, int] = {t: i for i, t in enumerate(vocab)}
    counts = Counter(m.encode("utf-8") for m in regex.findall(PAT_STR, text, flags=regex.V1))
    words: list[list[int]] = [list(w) for w in counts]
    freq: list[int] = list(counts.values())
    pairs: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}

    def add(wi: int, sign: int) -> None:
        w, f = words[wi], freq[wi] * sign
        for pr in zip(w, w[1:]):
            pairs[pr] = pairs.get(pr, 0) + f
            if sign > 0:
                where.setdefault(pr, set()).add(wi)

    for wi in range(len(words)):
        add(wi, 1)
    heap = [(-c, pr) for pr, c in pairs.items()]
    heapq.heapify(heap)
    while len(vocab) < n_ranks:
        if not heap and fill:
            while len(vocab) < n_ranks:
                vocab.append(b"\xf8" + len(vocab).to_bytes(3, "big"))
            break
        if not heap:
            raise ValueError(
                f"the training text supports only {len(vocab)} BPE ranks, {n_ranks} were asked for")
        negc, pr = heapq.heappop(heap)
        c = pairs.get(pr, 0)
        if c <= 0 or -negc != c:
            continue  # stale heap entry
        tok = vocab[pr[0]] + vocab[pr[1]]
        new = rank_of.get(tok)
        if new is None:
            new = len(vocab)
            vocab.append(tok)
            rank_of[tok] = new
        for wi in sorted(where.pop(pr, ())):
            w = words[wi]
            if len(w) < 2:
                continue
            add(wi, -1)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == pr[0] and w[j + 1] == pr[1]:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[wi] = out
            add(wi, 1)
            for p2 in zip(out, out[1:]):
                heapq.heappush(heap, (-pairs[p2], p2))
        pairs.pop(pr, None)
    return vocab


_VOCAB_CACHE: dict[int, list[bytes]] = {}


def _vocab(n_ranks: int) -> list[bytes]:
    if n_ranks not in _VOCAB_CACHE:
        _VOCAB_CACHE[n_ranks] = train_bpe(_corpus(), n_ranks, fill=True)
    return _VOCAB_CACHE[n_ranks]


def _tokenizer_files(raw: dict, arch: str) -> dict[str, bytes]:
    """tiktoken.model, tokenizer_config.json and generation_config.json contents."""
    import base64

    text = raw.get("text_config", raw)
    n_ranks = text["vocab_size"] - NUM_SPECIAL
    vocab = _vocab(n_ranks)
    ranks = b"".join(base64.b64encode(t) + b" " + str(i).encode() + b"\n" for i, t in enumerate(vocab))
    specials = special_tokens(arch, n_ranks)
    bos, eos, pad = raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]
    decoder = {
        str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": sp}
        for i, (c, sp) in sorted(specials.items())
    }
    tok_cfg = {
        "added_tokens_decoder": decoder,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": specials[bos][0],
        "clean_up_tokenization_spaces": False,
        "eos_token": specials[eos][0],
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": specials[pad][0],
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": specials[n_ranks + 254][0],
    }
    if arch == "k3":
        gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": True,
               "temperature": 1.0, "top_p": 0.95, "transformers_version": "4.56.2"}
    else:
        gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "max_length": 1048576,
               "transformers_version": "4.56.2"}
    return {
        "tiktoken.model": ranks,
        "tokenizer_config.json": _json_bytes(tok_cfg),
        "generation_config.json": _json_bytes(gen),
    }


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


# ------------------------------------------------------------------------ random tensors
_CHUNK = 1 << 24  # elements per random-draw chunk (bounds temporaries to ~100 MB)
_QUANTILES: torch.Tensor | None = None
_TABLES: dict = {}


def _quantiles() -> torch.Tensor:
    """The 65,536 midpoint quantiles of N(0, 1), float64."""
    global _QUANTILES
    if _QUANTILES is None:
        u = (torch.arange(65536, dtype=torch.float64) + 0.5) / 65536
        _QUANTILES = torch.special.ndtri(u)
    return _QUANTILES


def _table(kind: str, mean: float, std: float) -> np.ndarray:
    key = (kind, mean, std)
    t = _TABLES.get(key)
    if t is None:
        v = mean + std * _quantiles()
        if kind == "bf16":
            t = v.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
        else:
            t = v.to(torch.float32).numpy().copy()
        _TABLES[key] = t
    return t


def _stream(seed: int, name: str) -> np.random.PCG64:
    """The random stream of one tensor (or one expert): PCG64 keyed by (seed, name)."""
    h = hashlib.sha256(name.encode("utf-8")).digest()
    words = [int.from_bytes(h[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.PCG64(np.random.SeedSequence([int(seed), *words]))


def _u16(bg: np.random.PCG64, n: int) -> np.ndarray:
    return bg.random_raw((n + 3) // 4).view(np.uint16)[:n]


def _lookup(bg: np.random.PCG64, n: int, table: np.ndarray) -> np.ndarray:
    """n draws from `table` indexed by 16 random bits each, in fixed-size chunks."""
    out = np.empty(n, dtype=table.dtype)
    for a in range(0, n, _CHUNK):
        m = min(_CHUNK, n - a)
        out[a:a + m] = table[_u16(bg, m)]
    return out


def _gauss(bg, shape, mean: float, std: float, dtype: str) -> torch.Tensor:
    n = math.prod(shape)
    if dtype == "BF16":
        bits = _lookup(bg, n, _table("bf16", mean, std))
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(_lookup(bg, n, _table("f32", mean, std))).reshape(shape)


# Direct MXFP4 sampling (no float weights), used for the bigger presets: each group's
# scale byte is base-1, base or base+1 with probabilities 1/2, 3/8, 1/8 (E[4^j] = 1, so
# the spread leaves the variance alone; K3's real experts show bytes 112..122), and the
# nibbles are N(0, sigma) in units of the base scale rounded to E2M1, with sigma in
# [1.7, 3.4) chosen so the matrix has std 1/sqrt(fan_in).
_PACKED_TABLES: dict[float, np.ndarray] = {}
_JITTER = np.array([-1, -1, -1, -1, 0, 0, 0, 1], dtype=np.int16)


def _packed_table(sigma: float) -> np.ndarray:
    """uint16 random index -> one packed byte (two independent nibbles, 8 bits each)."""
    t = _PACKED_TABLES.get(sigma)
    if t is None:
        from .kernels.mxfp4 import _e2m1_codes  # numba-backed module: imported only when writing

        u = (torch.arange(256, dtype=torch.float64) + 0.5) / 256
        t8 = _e2m1_codes(sigma * torch.special.ndtri(u))
        v = np.arange(65536)
        t = _PACKED_TABLES[sigma] = (t8[v & 255] | (t8[v >> 8] << 4)).astype(np.uint8)
    return t


def _sample_mxfp4(bg, rows: int, cols: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    std = 1.0 / math.sqrt(cols)
    e = round(math.log2(std / 2.4))
    sigma = round(std / 2.0 ** e, 3)
    packed = _lookup(bg, rows * cols // 2, _packed_table(sigma)).reshape(rows, cols // 2)
    n = rows * cols // group
    raw = bg.random_raw((n + 7) // 8).view(np.uint8)[:n]
    scale = (127 + e + _JITTER[raw & 7]).astype(np.uint8).reshape(rows, cols // group)
    return torch.from_numpy(packed), torch.from_numpy(scale)


# ------------------------------------------------------------------------ plan
_F32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias", "_conv1d.weight", "o_norm.weight")


@dataclass(frozen=True)
class _T:
    """One tensor to write: full name, name relative to the model prefix (None for
    vision), shape, safetensors dtype."""

    name: str
    rel: str | None
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (4 if self.dtype == "F32" else 1 if self.dtype == "U8" else 2)


@dataclass(frozen=True)
class _Expert:
    layer: int
    expert: int
    tensors: tuple[_T, ...]  # in on-disk order

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class SynthPlan:
    """What `synthesize` writes, decided before any data is drawn."""

    preset: str
    arch: str
    seed: int
    raw_config: dict
    cfg: ModelConfig
    prefix: str
    head_name: str
    expert_mode: str  # "encode" | "packed" | "bf16"
    shard_names: list[str]
    shards: list[list]  # per shard: ordered _T / _Expert items

    @property
    def total_bytes(self) -> int:
        return sum(it.nbytes for sh in self.shards for it in sh)

    def shard_bytes(self, k: int) -> int:
        return sum(it.nbytes for it in self.shards[k])

    def tensors(self):
        for sh in self.shards:
            for it in sh:
                yield from (it.tensors if isinstance(it, _Expert) else (it,))


def _pad128(n: int) -> int:
    return (n + 127) // 128 * 128


def make_plan(preset: str = "tiny", arch: str = "k3", seed: int = 0, layers: int | None = None,
              experts: int | None = None, vocab: int | None = None) -> SynthPlan:
    """The config and the exact shard layout for a preset (no tensor data)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"synth: --seed must be a non-negative integer, got {seed!r}.")
    p = _resolve(preset, arch, layers, experts, vocab)
    raw = build_config(preset, arch, layers, experts, vocab)
    cfg = parse_config(raw, source=f"<synth {preset}/{arch}>")
    k3 = arch == "k3"
    prefix, head = ("language_model.model.", "language_model.lm_head.weight") if k3 else ("model.", "lm_head.weight")

    def full(rel: str) -> str:
        return head if rel == "lm_head.weight" else prefix + rel

    def dtype(rel: str) -> str:
        return "F32" if k3 and rel.endswith(_F32_SUFFIXES) else "BF16"

    def tensor(rel: str, shape) -> _T:
        if rel.endswith("A_log"):
            H = cfg.kda_num_heads
            shape = (_pad128(H),) if k3 else (1, 1, H, 1)
        return _T(full(rel), rel, tuple(shape), dtype(rel))

    quantized = cfg.expert_quant == "mxfp4"
    expert_mode = p.get("expert_mode", "bf16") if quantized else "bf16"
    especs = expert_specs(cfg, quantized)

    def expert(i: int, e: int) -> _Expert:
        ts = []
        for rel, (shape, kind) in especs.items():
            r = f"layers.{i}.block_sparse_moe.experts.{e}.{rel}"
            ts.append(_T(full(r), r, tuple(shape), "U8" if kind == "U8" else "BF16"))
        return _Expert(i, e, tuple(ts))

    shards: list[list] = []
    carry: list[_Expert] = []
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    E = cfg.num_experts
    for i in range(cfg.num_hidden_layers):
        trunk = [tensor(f"layers.{i}.{rel}", sp.shape) for rel, sp in layer_specs(cfg, i).items()]
        if not cfg.is_moe(i):
            shards.append(carry + trunk)
            carry = []
            continue
        perm = np.random.Generator(_stream(seed, f"expert-order/{i}")).permutation(E).tolist()
        if perm == sorted(perm) and E > 1:
            perm[0], perm[1] = perm[1], perm[0]
        ex = [expert(i, e) for e in perm]
        spill = max(1, E // 8) if (i != moe_layers[-1] and E >= 4) else 0
        head_n = E // 3
        shards.append(carry + ex[:head_n] + trunk + ex[head_n:E - spill])
        carry = ex[E - spill:]
    if carry:  # pragma: no cover - the last MoE layer never spills
        shards[-1].extend(carry)
    shards.append([tensor(rel, sp.shape) for rel, sp in global_specs(cfg).items()])
    if k3:
        vt = raw["vision_config"]["vt_hidden_size"]
        shards.append([
            _T("vision_tower.patch_embed.proj.weight", None, (vt, 3, 14, 14), "BF16"),
            _T("mm_projector.post_norm.weight", None, (cfg.hidden_size,), "BF16"),
        ])
    n = len(shards)
    fmt = "model-{i:05d}-of-{n:06d}.safetensors" if k3 else "model-{i:05d}-of-{n:05d}.safetensors"
    names = [fmt.format(i=k + 1, n=n) for k in range(n)]
    return SynthPlan(preset, arch, seed, raw, cfg, prefix, head, expert_mode, names, shards)


# ------------------------------------------------------------------------ values
def _value(plan: SynthPlan, t: _T) -> torch.Tensor:
    """The tensor's data (deterministic in (seed, name))."""
    cfg, rel = plan.cfg, t.rel
    bg = _stream(plan.seed, t.name)
    if rel is None:  # vision stubs
        if t.name.endswith("norm.weight"):
            return _gauss(bg, t.shape, 1.0, 0.02, t.dtype)
        return _gauss(bg, t.shape, 0.0, 0.02, t.dtype)
    if rel.endswith("A_log"):
        H = cfg.kda_num_heads
        v = torch.zeros(math.prod(t.shape), dtype=torch.float64)
        v[:H] = torch.linspace(-0.4, 1.2, H, dtype=torch.float64)
        return v.reshape(t.shape).to(_TORCH[t.dtype])
    if rel.endswith("e_score_correction_bias"):
        return torch.linspace(-0.05, 0.05, t.shape[0], dtype=torch.float64).to(_TORCH[t.dtype])
    if rel.endswith("dt_bias"):
        return _gauss(bg, t.shape, 0.0, 0.1, t.dtype)
    if rel.endswith("_conv1d.weight"):
        return _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[-1]), t.dtype)
    if rel.endswith("norm.weight"):  # every RMSNorm gain (layernorms, o_norm, AttnRes, latent)
        return _gauss(bg, t.shape, 1.0, 0.02, t.dtype)
    if rel == "embed_tokens.weight":
        return _gauss(bg, t.shape, 0.0, 1.0, t.dtype)
    if rel == "lm_head.weight":
        # Rows of the 256 special ids get 1/10 of the scale, so (as in a trained model)
        # greedy decoding emits ordinary text tokens rather than reserved specials.
        w = _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[-1]), t.dtype)
        n = t.shape[0] - NUM_SPECIAL
        w[n:] = (w[n:].to(torch.float32) * 0.1).to(w.dtype)
        return w
    # matrices, AttnRes pseudo-queries [1, d], router, lm_head: N(0, 1/fan_in)
    return _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[-1]), t.dtype)


_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}


def _expert_values(plan: SynthPlan, ex: _Expert) -> list[tuple[str, torch.Tensor]]:
    cfg = plan.cfg
    bg = _stream(plan.seed, f"{plan.prefix}layers.{ex.layer}.block_sparse_moe.experts.{ex.expert}")
    out = []
    if plan.expert_mode == "bf16":
        for t in ex.tensors:
            out.append((t.name, _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[1]), "BF16")))
        return out
    g = cfg.expert_group_size
    for tp, ts in zip(ex.tensors[0::2], ex.tensors[1::2]):  # (packed, scale) pairs
        rows, cols = tp.shape[0], tp.shape[1] * 2
        if plan.expert_mode == "packed":
            packed, scale = _sample_mxfp4(bg, rows, cols, g)
        else:
            from .kernels.mxfp4 import encode_mxfp4

            packed, scale = encode_mxfp4(_gauss(bg, (rows, cols), 0.0, 1.0 / math.sqrt(cols), "F32"), g)
        out += [(tp.name, packed), (ts.name, scale)]
    return out


def tensor_value(plan: SynthPlan, name: str) -> torch.Tensor:
    """Regenerate one written tensor by its full name (tests, debugging)."""
    for sh in plan.shards:
        for it in sh:
            if isinstance(it, _Expert):
                if any(t.name == name for t in it.tensors):
                    return dict(_expert_values(plan, it))[name]
            elif it.name == name:
                return _value(plan, it)
    raise KeyError(name)


# ------------------------------------------------------------------------ writing
_OURS = re.compile(
    r"^(model-\d+-of-\d+\.safetensors|\.model-\d+-of-\d+\.safetensors\.tmp-\d+|"
    r"model\.safetensors\.index\.json|\.model\.safetensors\.index\.json\.tmp-\d+|config\.json|"
    r"tiktoken\.model|tokenizer_config\.json|generation_config\.json|k3_synth\.json)$")


def _prepare_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"synth: {out} exists and is not a directory.")
    out.mkdir(parents=True, exist_ok=True)
    names = os.listdir(out)
    foreign = sorted(n for n in names if not _OURS.match(n))
    if foreign and not force:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UsageError(
            f"synth: {out} already holds files that a synthetic checkpoint does not write ({shown}). "
            "Choose an empty or new directory, or pass --force to write beside them.")
    # The index goes first, so an interrupted regeneration never looks complete; then
    # every earlier shard set (the new one may have a different shard count).
    for n in sorted(names, key=lambda n: n != INDEX_NAME):
        if _OURS.match(n) and (n == INDEX_NAME or n.endswith(".safetensors") or ".tmp-" in n):
            (out / n).unlink()


# A shard is drawn in pieces of about this many bytes; with workers, each piece is drawn
# and written (pwrite at its offset) by one worker process.
_PIECE = 128 << 20
# Below this many bytes in all, one process draws everything (spawning workers costs
# more than it saves).
PARALLEL_FROM = 1 << 30
WORKER_BYTES = 1 << 30

_WORKER_PLAN: SynthPlan | None = None


def _worker_init(args: tuple) -> None:
    global _WORKER_PLAN
    torch.set_num_threads(1)
    _WORKER_PLAN = make_plan(*args)


def _items_values(plan: SynthPlan, k: int, lo: int, hi: int) -> list[tuple[str, torch.Tensor]]:
    out = []
    for it in plan.shards[k][lo:hi]:
        out += _expert_values(plan, it) if isinstance(it, _Expert) else [(it.name, _value(plan, it))]
    return out


def _write_piece(path: str, k: int, lo: int, hi: int, offsets: dict[str, int], plan: SynthPlan | None = None) -> int:
    """Draw items [lo, hi) of shard k and write each tensor at its file offset."""
    plan = plan or _WORKER_PLAN
    fd = os.open(path, os.O_WRONLY)
    n = 0
    try:
        for name, t in _items_values(plan, k, lo, hi):
            mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            off = offsets[name]
            while len(mv):
                w = os.pwrite(fd, mv, off)
                mv, off, n = mv[w:], off + w, n + w
    finally:
        os.close(fd)
    return n


def _pieces(items: list) -> list[tuple[int, int]]:
    out, lo, acc = [], 0, 0
    for i, it in enumerate(items):
        acc += it.nbytes
        if acc >= _PIECE:
            out.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < len(items):
        out.append((lo, len(items)))
    return out


def _write_shard(path: Path, plan: SynthPlan, k: int, pool, fsync: bool) -> None:
    """One shard: the header from the plan, then every piece drawn and written at its
    offset (by the pool's workers when there is a pool), into a temporary file renamed
    into place once complete."""
    tensors = list(plan.shards[k])
    flat = [t for it in tensors for t in (it.tensors if isinstance(it, _Expert) else (it,))]
    header, offsets = safetensors_layout([(t.name, t.dtype, t.shape) for t in flat])
    start = len(header)
    where = {name: start + off for name, off in offsets.items()}

    def body(f) -> None:
        f.write(header)
        f.flush()
        os.ftruncate(f.fileno(), start + plan.shard_bytes(k))
        parts = _pieces(tensors)
        if pool is None or len(parts) < 2:
            n = sum(_write_piece(f.name, k, lo, hi, where, plan) for lo, hi in parts)
        else:
            n = sum(fut.result() for fut in [pool.submit(_write_piece, f.name, k, lo, hi, where) for lo, hi in parts])
        if n != plan.shard_bytes(k):  # the drawn tensors are not the planned layout: a bug, never a silent gap
            raise AssertionError(f"{path.name}: wrote {n} bytes of tensors, the plan has {plan.shard_bytes(k)}")

    atomic_write(path, body, what="the shard", fsync=fsync)


def synthesize(out_dir, preset: str = "tiny", arch: str = "k3", seed: int = 0, layers: int | None = None,
               experts: int | None = None, *, vocab: int | None = None, workers: int | None = None,
               force: bool = False, progress: Callable[[str], None] | None = None, fsync: bool = False) -> Path:
    """Write a synthetic checkpoint folder; returns its path. See the module docstring.

    `layers` / `experts` / `vocab` override the preset (layers >= 2: layer 0 dense, the
    last layer MLA; experts >= the preset's top-k). `workers` processes draw the shards'
    pieces in parallel (default: one per core for checkpoints of PARALLEL_FROM bytes or
    more, else one); the bytes do not depend on it. Refuses a directory holding other
    files unless `force`. `progress` receives one line per written shard. The index is
    written last."""
    t_start = time.perf_counter()
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise UsageError(f"synth: --workers must be a positive integer, got {workers!r}.")
    plan = make_plan(preset, arch, seed, layers, experts, vocab)
    out = Path(out_dir)
    _prepare_dir(out, force)
    need = plan.total_bytes
    free = shutil.disk_usage(out).free
    if need > free:
        raise UsageError(
            f"synth: the {preset}/{arch} checkpoint needs {human(need)} but {out} has only "
            f"{human(free)} free. Free space, choose another directory, or use fewer --layers/--experts.")
    say = progress or (lambda msg: None)
    say(f"synth {preset}/{arch} seed {seed}: {plan.cfg.num_hidden_layers} layers, "
        f"{plan.cfg.num_experts} experts (top-{plan.cfg.num_experts_per_token}), "
        f"{len(plan.shards)} shards, {need / 1e6:.1f} MB -> {out}")

    (out / "config.json").write_bytes(_json_bytes(plan.raw_config))
    for fname, data in _tokenizer_files(plan.raw_config, arch).items():
        atomic_write(out / fname, data, fsync=fsync)

    # A shard's pieces are drawn and written at their offsets (the header comes from the
    # plan), so memory holds a few pieces, never a shard, and workers draw in parallel.
    if workers is None:
        workers = (os.cpu_count() or 1) if need >= PARALLEL_FROM else 1
        from .memory.sysmem import meminfo
        try:
            avail = meminfo()["MemAvailable"]
        except K3Error:  # no /proc/meminfo: as many workers as cores
            avail = None
        if avail:  # a worker holds torch and a few pieces: about WORKER_BYTES
            workers = max(1, min(workers, avail // WORKER_BYTES))
    pool = None
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: the parent has torch's thread pools up
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init, initargs=((preset, arch, seed, layers, experts, vocab),))
    weight_map: dict[str, str] = {}
    written = 0
    try:
        for k, fname in enumerate(plan.shard_names):
            t0 = time.perf_counter()
            try:
                _write_shard(out / fname, plan, k, pool, fsync)
            except BrokenProcessPool:
                raise K3Error(f"synth: a worker process drawing {fname} died (out of memory?); nothing of that shard "
                              f"was kept. Run again with --workers 1, or with fewer workers.", EXIT_RUNTIME) from None
            nb = plan.shard_bytes(k)
            written += nb
            for it in plan.shards[k]:
                for t in (it.tensors if isinstance(it, _Expert) else (it,)):
                    weight_map[t.name] = fname
            dt = time.perf_counter() - t0
            say(f"  [{k + 1}/{len(plan.shard_names)}] {fname}: {nb / 1e6:9.1f} MB in {dt:6.2f} s "
                f"({nb / 1e6 / max(dt, 1e-9):.0f} MB/s; {written / 1e6:.1f} of {need / 1e6:.1f} MB)")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)

    elapsed = time.perf_counter() - t_start
    meta = {
        "generator": "k3.synth", "format_version": 1, "preset": preset, "arch": arch, "seed": seed,
        "num_hidden_layers": plan.cfg.num_hidden_layers, "num_experts": plan.cfg.num_experts,
        "expert_encoding": plan.expert_mode, "total_size": written, "shards": len(plan.shard_names),
        "vocab_size": plan.cfg.vocab_size,
    }  # no timings: the folder is byte-for-byte a function of (preset, arch, seed, layers, experts, vocab)
    (out / "k3_synth.json").write_bytes(_json_bytes(meta))
    index = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(out / INDEX_NAME, _json_bytes(index), fsync=fsync)
    say(f"synth: wrote {written / 1e6:.1f} MB in {elapsed:.1f} s ({written / 1e6 / max(elapsed, 1e-9):.0f} MB/s)")
    return out


def describe_plan(preset: str = "tiny", arch: str = "k3", seed: int = 0, layers: int | None = None,
                  experts: int | None = None, vocab: int | None = None) -> list[str]:
    """What `synthesize` would write (`k3 synth --dry-run`): one line per shard."""
    plan = make_plan(preset, arch, seed, layers, experts, vocab)
    out = [plan.cfg.summary().replace("<synth", "synth").replace(">", "")]
    for name, sh in zip(plan.shard_names, plan.shards):
        n = sum(len(it.tensors) if isinstance(it, _Expert) else 1 for it in sh)
        out.append(f"  {name}: {n} tensors, {sum(it.nbytes for it in sh) / 1e6:.1f} MB")
    out.append(f"total {plan.total_bytes / 1e6:.1f} MB in {len(plan.shards)} shards")
    return out
