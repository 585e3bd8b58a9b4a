"""N-gram drafts for exact speculative decoding (`--spec N`).

A draft is a guess of the next tokens, checked by the model in one forward pass over
[pending token + drafts]; the longest prefix the model agrees with is kept, so the
output is the model's own (greedy: identical to plain decoding). Drafts cost nothing to
make: the most recent earlier occurrence of the sequence's last 4 ids (else 3) and what
followed it, up to N tokens, stopping where the two most recent earlier continuations
disagree; then the same lookup in a static corpus (a document the answer is likely to
repeat: code being edited, a text being summarised), like llama.cpp's lookup cache.

Drafts are not free where each drafted token brings its own routed experts, so the
decode loop reads only as many as are expected to pay (k3.memory.passcost): the
drafter keeps a running acceptance per draft position, scored on every draft it made,
read or withheld, against the tokens that actually followed. Drafting thus stops where
drafts go wrong and resumes when they would be right again.
"""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError

KEYS = (4, 3)  # n-gram lengths tried, longest first
MAX_DRAFT = 8
# The acceptance a draft position starts at, worth PRIOR_WEIGHT drafts; later drafts
# weigh more, at DECAY per scored draft, so the estimate follows the text.
PRIOR = 0.5
PRIOR_WEIGHT = 1.0
DECAY = 0.8


class Acceptance:
    """Running chance, per draft position i, that draft i is right given that the drafts
    before it were (what a verifying pass would have kept)."""

    def __init__(self, n: int):
        self.right = [PRIOR * PRIOR_WEIGHT] * n
        self.tried = [PRIOR_WEIGHT] * n
        self.scored = 0

    def score(self, n_right: int, n_tried: int) -> None:
        """A draft of n_tried tokens whose first n_right were right."""
        self.scored += 1
        for i in range(min(n_tried, n_right + 1, len(self.tried))):
            self.right[i] = self.right[i] * DECAY + (1.0 if i < n_right else 0.0)
            self.tried[i] = self.tried[i] * DECAY + 1.0

    @property
    def rates(self) -> list[float]:
        return [r / t for r, t in zip(self.right, self.tried)]


class NgramIndex:
    """Where each n-gram (n in KEYS) last occurred in a growing token sequence: for each,
    the three most recent start positions (the latest may be the sequence's own end)."""

    def __init__(self, ids=()):
        self.ids: list[int] = []
        self.last: dict[tuple, tuple[int, ...]] = {}  # n-gram -> start positions, latest first
        self.extend(ids)

    def extend(self, ids) -> None:
        for t in ids:
            self.ids.append(int(t))
            end = len(self.ids)
            for n in KEYS:
                if end >= n:
                    key = tuple(self.ids[end - n:end])
                    self.last[key] = ((end - n,) + self.last.get(key, ()))[:3]

    def continuations(self, key: tuple, before: int) -> list[list[int]]:
        """What followed the two most recent occurrences of `key` that start before
        position `before` (the occurrence at the sequence's own end is not a match)."""
        starts = [s for s in self.last.get(key, ()) if s < before][:2]
        return [self.ids[s + len(key):] for s in starts]


class Drafter:
    """Drafts for one sequence: its own n-grams, then the corpus's; and how often its
    drafts were right (``acceptance``)."""

    def __init__(self, ids, n: int, corpus: "NgramIndex | None" = None):
        if not 1 <= n <= MAX_DRAFT:
            raise UsageError(f"--spec takes 1..{MAX_DRAFT} drafted tokens, got {n}.")
        self.n = n
        self.seq = NgramIndex(ids)
        self.corpus = corpus
        self.acceptance = Acceptance(n)
        self._open: list[tuple[int, list[int]]] = []  # (position of its first token, draft) not yet scored

    def extend(self, ids) -> None:
        self.seq.extend(ids)
        seq, still = self.seq.ids, []
        for at, d in self._open:
            known = len(seq) - at
            right = 0
            while right < min(known, len(d)) and seq[at + right] == d[right]:
                right += 1
            if right < min(known, len(d)) or right == len(d):  # a token went wrong, or all were right
                self.acceptance.score(right, len(d))
            else:
                still.append((at, d))
        self._open = still

    def propose(self, limit: int | None = None) -> list[int]:
        """The draft for the sequence's next tokens (at most ``limit``), to be scored
        against the tokens that follow whether or not it is read."""
        d = self.draft()[:self.n if limit is None else max(0, limit)]
        at = len(self.seq.ids)
        self._open = [o for o in self._open if o[0] < at]  # a pass undone and stepped again drafts here anew
        if d:
            self._open.append((at, d))
        return d

    def draft(self) -> list[int]:
        ids = self.seq.ids
        for index, before in ((self.seq, len(ids) - 1), (self.corpus, None)):
            if index is None:
                continue
            for n in KEYS:
                if len(ids) < n:
                    continue
                key = tuple(ids[-n:])
                conts = index.continuations(key, len(index.ids) if before is None else len(ids) - n)
                conts = [c for c in conts if c]
                if not conts:
                    continue
                d = conts[0][:self.n]
                if len(conts) > 1:  # stop where the two most recent continuations disagree
                    k = 0
                    while k < len(d) and k < len(conts[1]) and conts[1][k] == d[k]:
                        k += 1
                    d = d[:k] if k < len(conts[1]) else d
                if d:
                    return d
        return []


def read_corpus(path, tokenizer) -> NgramIndex:
    """A --spec-corpus file: UTF-8 text tokenized with the model's tokenizer, or token ids
    separated by spaces or commas when the name ends in `.ids`."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UsageError(f"--spec-corpus {path}: cannot read it ({e.strerror or e}).") from None
    if p.name.endswith(".ids"):
        try:
            ids = [int(x) for x in raw.decode("ascii").replace(",", " ").split()]
        except (UnicodeDecodeError, ValueError):
            raise UsageError(f"--spec-corpus {path}: a .ids file holds token ids separated by spaces or commas."
                             ) from None
    else:
        if tokenizer is None:
            raise UsageError(f"--spec-corpus {path}: the model folder has no tokenizer to read text with; give token "
                             "ids in a file named *.ids.")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"--spec-corpus {path}: not UTF-8 text (or name it *.ids for token ids).") from None
        ids = tokenizer.encode(text)
    return NgramIndex(ids)
