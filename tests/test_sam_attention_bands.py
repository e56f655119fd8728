"""SAM's attention with decomposed relative positions (``layers/sam_vision.py``) built a
band of query rows at a time: the same output as the whole [heads, N, N] bias, against
a NumPy reference of SAM's formula (softmax(q k^T * scale + rel_h + rel_w) v, the
relative terms from the unscaled queries), for a global block whose relative tables are
resized to the map and for a batch of windows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm.models.layers import sam_vision
from mlxvlm.models.layers.interpolation import linear_matrix


def reference(attn: sam_vision.SamAttention, x: np.ndarray) -> np.ndarray:
    B, H, W, C = x.shape
    heads = attn.num_heads
    params = {k: np.array(v, dtype=np.float64) for k, v in
              [("qkv_w", attn.qkv.weight), ("qkv_b", attn.qkv.bias),
               ("proj_w", attn.proj.weight), ("proj_b", attn.proj.bias),
               ("rel_h", attn.rel_pos_h), ("rel_w", attn.rel_pos_w)]}
    qkv = (x.reshape(B, H * W, C) @ params["qkv_w"].T + params["qkv_b"])
    qkv = qkv.reshape(B, H * W, 3, heads, -1).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    dim = q.shape[-1]

    def table(rel, size):
        if rel.shape[0] != 2 * size - 1:
            rel = linear_matrix(rel.shape[0], 2 * size - 1).astype(np.float64) @ rel
        offsets = np.arange(size)[:, None] - np.arange(size)[None, :] + size - 1
        return rel[offsets]

    rq = q.reshape(B, heads, H, W, dim)
    rel_h = np.einsum("bnhwc,hkc->bnhwk", rq, table(params["rel_h"], H))
    rel_w = np.einsum("bnhwc,wkc->bnhwk", rq, table(params["rel_w"], W))
    bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(B, heads, H * W, H * W)
    scores = q @ k.swapaxes(-1, -2) * dim**-0.5 + bias
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    out = (scores / scores.sum(-1, keepdims=True)) @ v
    out = out.reshape(B, heads, H, W, dim).transpose(0, 2, 3, 1, 4).reshape(B, H, W, C)
    return out @ params["proj_w"].T + params["proj_b"]


def random_attention(table_size: int) -> sam_vision.SamAttention:
    config = sam_vision.SamVisionConfig(hidden_size=32, num_attention_heads=4)
    attn = sam_vision.SamAttention(config, table_size)
    rng = np.random.default_rng(0)
    attn.rel_pos_h = mx.array(rng.normal(0, 0.5, attn.rel_pos_h.shape), dtype=mx.float32)
    attn.rel_pos_w = mx.array(rng.normal(0, 0.5, attn.rel_pos_w.shape), dtype=mx.float32)
    return attn


@pytest.mark.parametrize("bias_elements", [1, 4 * 10 * 12 * 10 * 12 // 3, 1 << 24],
                         ids=["one-row-bands", "several-rows-bands", "one-band"])
@pytest.mark.parametrize("table_size, shape", [(16, (1, 10, 12, 32)), (7, (3, 7, 7, 32))],
                         ids=["global-resized-tables", "windows"])
def test_banded_bias_matches_the_whole_bias(monkeypatch, bias_elements, table_size, shape):
    monkeypatch.setattr(sam_vision, "BIAS_ELEMENTS", bias_elements)
    attn = random_attention(table_size)
    x = np.random.default_rng(1).normal(0, 1, shape).astype(np.float32)
    out = attn(mx.array(x))
    np.testing.assert_allclose(np.array(out), reference(attn, x.astype(np.float64)),
                               atol=1e-4, rtol=1e-4)
