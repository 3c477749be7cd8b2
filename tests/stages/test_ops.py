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


def test_a_longrope_table_turns_long_from_its_switch_and_scales_its_rotary_dims() -> None:
    """The kept decode step's table for LongRoPE (stages/models/blocks.py Rotary): rows below
    the switch at the short frequencies, from it on at the long ones, both scaled."""
    short, long = torch.rand(32) * 0.1, torch.rand(32) * 0.01
    scale = torch.ones(32)
    scale[:24] = 1.2
    table = RopeTable(short, scale, long, long_from=700)
    positions = torch.tensor([0, 5, 699, 700, 701, 2047])
    cos, sin = table.rows(positions, 2047)
    for row, position in enumerate(positions.tolist()):
        freqs = long if position >= 700 else short
        expected_cos, expected_sin = _rope_fp32(torch.tensor([position]), freqs, scale)
        assert torch.equal(cos[row], expected_cos[0]) and torch.equal(sin[row], expected_sin[0])
