"""k3.kernels.bitmask: a grammar's token mask applied to a row of logits, against
llguidance's own torch implementation."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llguidance")


@pytest.mark.parametrize("vocab", [1000, 2304, 163840])
def test_the_mask_kernel_equals_llguidances(vocab):
    """k3.kernels.bitmask.masked_copy against llguidance's own torch mask, on words all
    allowed, none, and mixed, for vocabularies that do and do not fill the last word."""
    import llguidance.torch as lt
    import numpy as np

    from k3.kernels.bitmask import masked_copy
    g = torch.Generator().manual_seed(vocab)
    bm = lt.allocate_token_bitmask(1, vocab)
    bm.random_(-2**31, 2**31 - 1, generator=g)
    bm[0, ::3], bm[0, 1::5] = -1, 0
    out = np.empty(vocab, dtype=np.float32)
    for x in (torch.randn(vocab, generator=g), torch.randn(1, vocab, generator=g).to(torch.bfloat16)):
        ref = x.reshape(1, -1).to(torch.float32, copy=True)
        lt.apply_token_bitmask_inplace(ref, bm)
        got = masked_copy(x, bm, out)
        assert got.shape == x.shape and got.dtype == torch.float32
        assert torch.equal(got.reshape(-1), ref.reshape(-1))
    wide = torch.randn(vocab + 40, generator=g)   # logits past the mask's words: not allowed
    ref = wide.reshape(1, -1).clone()
    lt.apply_token_bitmask_inplace(ref, bm)
    assert torch.equal(masked_copy(wide, bm, np.empty(vocab + 40, dtype=np.float32)), ref.reshape(-1))
    with pytest.raises(ValueError):
        masked_copy(torch.zeros(vocab), bm, np.empty(vocab + 1, dtype=np.float32))


def test_constraint_mask_is_the_same_with_the_kernel_off(tmp_path, monkeypatch):
    """Constraint.mask under K3_FUSED=0 (llguidance's torch mask) and with the kernel:
    the same bits, step by step along one answer; one compiled grammar serves both
    (the cache hands out fresh copies, whose steps do not touch one another)."""
    from k3 import constrain
    from k3.synth import synthesize
    from k3.tokenizer import Tokenizer
    d = synthesize(tmp_path / "tiny", preset="tiny", arch="k3", seed=11)
    tok, vocab = Tokenizer(d), 1280
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "maxLength": 6}}}
    monkeypatch.setenv("K3_FUSED", "0")
    plain = constrain.json_constraint(tok, schema, [tok.eos_id], vocab)
    monkeypatch.setenv("K3_FUSED", "1")
    fast = constrain.json_constraint(tok, schema, [tok.eos_id], vocab)
    assert plain.m is not fast.m and len(constrain._COMPILED[tok]) == 1
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        x = torch.randn(vocab, generator=g)
        a, b = plain.mask(x), fast.mask(x)
        assert torch.equal(a, b) and int(torch.isinf(b).sum()) > 0
        t = int(torch.argmax(b))
        if t == tok.eos_id:
            break
        plain.accept(t)
        fast.accept(t)
    with pytest.raises(constrain.UsageError):   # a refusal is kept too, and said again
        constrain.json_constraint(tok, {"type": "array", "uniqueItems": True}, [tok.eos_id], vocab)
    with pytest.raises(constrain.UsageError):
        constrain.json_constraint(tok, {"type": "array", "uniqueItems": True}, [tok.eos_id], vocab)
