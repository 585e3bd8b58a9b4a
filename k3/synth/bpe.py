"""The synthetic checkpoint's tokenizer: a byte-level BPE vocabulary learned from a
built-in text sample (`train_bpe`), and the tokenizer files written beside the weights
(`tiktoken.model`, `tokenizer_config.json`, `generation_config.json`)."""

from __future__ import annotations

import heapq
from collections import Counter

from .presets import NUM_SPECIAL, _json_bytes, special_tokens

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

    from ..tokenizer import PAT_STR

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
