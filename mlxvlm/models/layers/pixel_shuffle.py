"""The pixel shuffle of vision-language connectors (Idefics3/SmolVLM, LFM2-VL, InternVL):
every ``factor x factor`` square of a tower's patch grid folded into one token of
``factor² x`` the width, which transformers writes three ways (``pixel_shuffle``,
``pixel_unshuffle``, InternVL's view/permute) that all give this order."""

from __future__ import annotations

import mlx.core as mx


def fold_blocks(patches: mx.array, rows: int, columns: int, factor: int) -> mx.array:
    """(..., rows * columns, D) patch features, row by row -> (..., rows * columns /
    factor², factor² D): one token per square, squares row by row, each token's channels
    its square's patches row by row."""
    *lead, length, D = patches.shape
    if length != rows * columns or rows % factor or columns % factor:
        raise ValueError(f"cannot fold a {rows} x {columns} grid ({length} patches) into "
                         f"{factor} x {factor} squares")
    blocks = patches.reshape(*lead, rows // factor, factor, columns // factor, factor, D)
    n = len(lead)
    order = (*range(n), n, n + 2, n + 1, n + 3, n + 4)
    return blocks.transpose(order).reshape(*lead, -1, factor * factor * D)
