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
