"""bench/kv_study.py's schemes (the design study for an 8-bit KV cache): each rounds within
half a step of its own scale, and a page filled a token at a time ends as the page quantized
at once wherever no scale had to grow."""

from __future__ import annotations

import torch

from bench import kv_study


def test_per_token_rounds_within_half_a_step_of_each_token_s_scale() -> None:
    x = torch.randn(1, 2, 40, 64)
    for dims in (None, 16):
        y = kv_study.per_token(x, dims)
        groups = x.reshape(1, 2, 40, -1, dims or 64)
        step = (groups.abs().amax(-1, keepdim=True) / 127).expand_as(groups).reshape(x.shape)
        assert ((y - x).abs() <= step / 2 + 1e-7).all()
        assert not torch.equal(y, x)


def test_a_page_filled_token_by_token_is_the_page_at_once_when_no_scale_grows() -> None:
    x = torch.randn(1, 2, 32, 8)
    x[:, :, ::16] = 10.0 * x[:, :, ::16].sign()  # each page's first token holds every maximum
    at_once = kv_study.per_channel_page(x, steps=8)
    # (torch's exp2 may differ by an ulp between a tensor's shapes: the same codes, nearly)
    assert torch.allclose(kv_study.appended_pages(x, steps=8), at_once, rtol=1e-6, atol=0)
    x[:, :, 20] = 30.0  # a later token that makes its page's scales grow: earlier codes again
    moved = kv_study.appended_pages(x, steps=8) - kv_study.per_channel_page(x, steps=8)
    assert moved.abs().max() > 1e-3


def test_log_scales_only_round_up_within_an_eighth_of_an_octave() -> None:
    scale = torch.rand(1000) + 1e-3
    up = kv_study.log_scale(scale, 8)
    assert (up >= scale).all() and (up < scale * 2 ** (1 / 8) * (1 + 1e-6)).all()
    assert kv_study.log_scale(torch.zeros(3), 8).eq(0).all()
