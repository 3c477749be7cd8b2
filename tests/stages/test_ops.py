"""The rotary table NativeOps keeps across steps (backend/cpu/ops.py RopeTable) holds, row for row,
what computing each step's positions alone gives, bit for bit, as it grows."""

from __future__ import annotations

import torch

from stages.backend.cpu.ops import RopeTable
from stages.backend.torch.ops import _rope_fp32
from stages.models.blocks import rope_inv_freq


def test_the_table_rows_equal_each_positions_own_computation_as_it_grows() -> None:
    inv_freq = rope_inv_freq(64, 10000.0, None)
    table = RopeTable(inv_freq)
    assert table.cos.shape == (RopeTable.MIN_POSITIONS, 64)
    generator = torch.Generator().manual_seed(0)
    for top in (5, 1000, 1024, 3000, 70000):  # 1024 and on: it doubles to hold them
        positions = torch.randint(0, top, (37,), generator=generator)
        positions[0] = top - 1  # the step's largest
        cos, sin = table.rows(positions, top - 1)
        expected_cos, expected_sin = _rope_fp32(positions, inv_freq)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
        assert table.cos.shape[0] >= top
    assert table.cos.shape[0] == 131072  # doubled from 1024 until 70000 fits
