"""LFM2-VL's numpy image processor against transformers' (which needs torchvision).

transformers ships ``Lfm2VlImageProcessor`` for torchvision only, and torchvision is not a
test dependency, so the comparison is in two parts:

- the layout (tile grid, single-view size, per-view patch grids) is checked against the
  figures transformers 5.24's ``Lfm2VlImageProcessor`` gives for these image sizes, at
  the tiny fixture's settings and at the real checkpoints' defaults (recorded from it;
  with torchvision 0.28 every output, pixels included, agreed to 6e-8);
- the pixels of every view are torch's own antialiased bilinear resize of the 8-bit image
  (what torchvision's ``resize`` runs), cut and patchified as transformers does, here
  computed with torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiny import make_image
from tiny.lfm2_vl import IMAGE_SETTINGS
from mlxvlm.models.lfm2_vl_images import Lfm2VlImageProcessorPil
from mlxvlm.models.resize_uint8 import resize_uint8

torch = pytest.importorskip("torch")

# (width, height) -> (tile rows, tile columns, single-view (height, width), patch grids)
TINY_LAYOUTS = {
    (112, 84): (2, 2, (48, 64), [(8, 8)] * 4 + [(6, 8)]),
    (300, 120): (1, 3, (32, 96), [(8, 8)] * 3 + [(4, 12)]),
    (30, 30): (1, 1, (32, 32), [(4, 4)]),
    (17, 90): (1, 1, (96, 16), [(12, 2)]),
    (129, 64): (1, 1, (32, 80), [(4, 10)]),
}
DEFAULT_LAYOUTS = {
    (1024, 768): (2, 3, (416, 576), [(32, 32)] * 6 + [(26, 36)]),
    (640, 480): (1, 1, (416, 576), [(26, 36)]),
    (2000, 300): (1, 7, (192, 1312), [(32, 32)] * 7 + [(12, 82)]),
    (100, 60): (1, 1, (224, 352), [(14, 22)]),
    (1536, 1536): (3, 3, (512, 512), [(32, 32)] * 10),
}


def torch_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, H, W) uint8 as torchvision resizes it (bilinear, antialiased)."""
    out = torch.nn.functional.interpolate(torch.from_numpy(np.ascontiguousarray(image).copy())[None], size=(height, width),
                                          mode="bilinear", align_corners=False, antialias=True)
    return out[0].numpy()


@pytest.mark.parametrize("seed", range(4))
def test_resize_is_torchs_to_the_pixel(seed):
    rng = np.random.default_rng(seed)
    for _ in range(8):
        H, W = rng.integers(5, 300, 2)
        h, w = rng.integers(4, 400, 2)
        image = rng.integers(0, 256, (3, H, W), dtype=np.uint8)
        np.testing.assert_array_equal(resize_uint8(image, int(h), int(w)),
                                      torch_resize(image, int(h), int(w)))


def expected_views(image: np.ndarray, rows: int, columns: int, size, tile: int) -> list[np.ndarray]:
    if rows * columns == 1:
        return [torch_resize(image, *size)]
    grid = torch_resize(image, rows * tile, columns * tile)
    tiles = [grid[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
             for r in range(rows) for c in range(columns)]
    return tiles + [torch_resize(image, *size)]


@pytest.mark.parametrize("settings,layouts", [(IMAGE_SETTINGS, TINY_LAYOUTS), ({}, DEFAULT_LAYOUTS)],
                         ids=["tiny", "defaults"])
def test_views_and_pixels_are_transformers(settings, layouts):
    processor = Lfm2VlImageProcessorPil(**settings)
    p, tile = processor.encoder_patch_size, processor.tile_size
    for (width, height), (rows, columns, size, grids) in layouts.items():
        image = make_image(width, height, seed=1)
        out = processor([image], return_tensors="np", return_row_col_info=True)
        assert (out["image_rows"], out["image_cols"]) == ([rows], [columns])
        assert [list(s) for s in out["image_sizes"]] == [list(size)]
        assert out["spatial_shapes"].tolist() == [list(g) for g in grids]
        array = np.asarray(image).transpose(2, 0, 1)
        for i, view in enumerate(expected_views(array, rows, columns, size, tile)):
            r, c = grids[i]
            normalized = (view.astype(np.float32) / 255 - 0.5) / 0.5
            patches = normalized.reshape(3, r, p, c, p).transpose(1, 3, 2, 4, 0).reshape(r * c, -1)
            np.testing.assert_allclose(out["pixel_values"][i, : r * c], patches, rtol=0, atol=1e-6)
            assert not out["pixel_values"][i, r * c:].any()
            assert out["pixel_attention_mask"][i].tolist() == [1] * (r * c) + [0] * (
                out["pixel_values"].shape[1] - r * c)
