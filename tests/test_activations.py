"""The shared activation table (mlxvlm/models/layers/activations.py) computes what
transformers' ACT2FN computes under the same name, and refuses names it does not know."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm.models.layers.activations import ACTIVATIONS, activation

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_is_transformers_own(name):
    from transformers.activations import ACT2FN

    x = np.linspace(-8.0, 8.0, 4001, dtype=np.float32)
    expected = ACT2FN[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.array(activation(name)(mx.array(x))), expected, rtol=0, atol=2e-6)


def test_near_misses_are_told_apart():
    """gelu, its tanh approximation and quick_gelu differ by more than the tolerance above,
    so a table that swapped them would fail."""
    x = mx.array(np.linspace(-4.0, 4.0, 801, dtype=np.float32))
    values = {name: np.array(activation(name)(x)) for name in ("gelu", "gelu_pytorch_tanh", "quick_gelu")}
    for a in values:
        for b in values:
            if a < b:
                assert np.abs(values[a] - values[b]).max() > 1e-4, (a, b)


def test_an_unknown_activation_is_refused():
    with pytest.raises(NotImplementedError, match="'gelu_10' is not supported"):
        activation("gelu_10")
