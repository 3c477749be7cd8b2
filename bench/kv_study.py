"""`python -m bench.kv_study`: what storing K and V in 8 bits would cost in accuracy, scheme by
scheme, before any kernel is written (the design study for an 8-bit KV cache).

transformers' fp32 model of the default model's folder runs the shipped text's windows
(bench/texts/quality_en.txt, as `ppring bench quality`) with K and V quantized and dequantized
in plain torch where a cache would hold them (after the rotary, inside the attention call),
and each scheme's next-token distributions are compared with plain fp32's: mean KL
divergence (nats a position), its 99th percentile, and top-1 agreement. Only the KV's error is
measured: a serving configuration adds it to its own (bf16 weights and activations cost the
default model ~0.001).

Schemes: bf16; int8 with one scale per token and KV head (or per 16/32 of its dims); K with
one scale per channel of a 16-token page (KIVI's observation: K's error lives in a few
channels), stored as an fp16 or a 1-byte log2 scale (8 steps an octave), V per token; the
same K appended a token at a time into pages whose scales only grow (earlier codes rounded
again when one does); fp8 e4m3 and e5m2 with scale 1 or per token and head.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_TEXT = Path(__file__).parent / "texts" / "quality_en.txt"


def _scaled(x, scale, clamp=127.0):  # noqa: ANN001, ANN202
    """round(x / scale) within +-clamp, times scale; 0 where the scale is 0."""
    import torch

    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, torch.clamp(torch.round(x / safe), -clamp, clamp), 0) * scale


def per_token(x, dims: int | None = None, fp16: bool = False):  # noqa: ANN001, ANN201
    """int8, a scale per (token, head) or per `dims` of each head: x [B, H, T, D]."""
    b, h, t, d = x.shape
    groups = x.reshape(b, h, t, d // (dims or d), dims or d)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    if fp16:
        scale = scale.half().float()
    return _scaled(groups, scale).reshape(x.shape)


def log_scale(scale, steps: int):  # noqa: ANN001, ANN201
    """`scale` rounded up to 2^(k / steps): what one byte of log2 scale holds."""
    import torch

    up = torch.exp2(torch.ceil(steps * torch.log2(torch.where(scale > 0, scale, 1))) / steps)
    return torch.where(scale > 0, up, scale)


def per_channel_page(x, steps: int | None = None, page: int = 16):  # noqa: ANN001, ANN201
    """int8, a scale per (page of `page` tokens, head, channel): fp16, or a 1-byte log2."""
    import torch.nn.functional as F

    b, h, t, d = x.shape
    pages = F.pad(x, (0, 0, 0, (-t) % page)).view(b, h, -1, page, d)
    scale = pages.abs().amax(-2, keepdim=True) / 127
    scale = log_scale(scale, steps) if steps else scale.half().float()
    return _scaled(pages, scale).view(b, h, -1, d)[:, :, :t]


def appended_pages(x, steps: int = 8, page: int = 16):  # noqa: ANN001, ANN201
    """per_channel_page's 1-byte scales as decoding fills a page a token at a time: a channel's
    scale only grows, and when it does the page's earlier codes are rounded again to it."""
    import torch

    out = torch.empty_like(x)
    for p0 in range(0, x.shape[2], page):
        tokens = x[:, :, p0 : p0 + page]
        scale = torch.zeros_like(tokens[:, :, :1])
        codes = torch.zeros_like(tokens)
        for t in range(tokens.shape[2]):
            need = log_scale(tokens[:, :, t : t + 1].abs() / 127, steps)
            grown = need > scale
            new = torch.where(grown, need, scale)
            again = torch.round(codes[:, :, :t] * scale / torch.where(new > 0, new, 1))
            codes[:, :, :t] = torch.where(grown, again, codes[:, :, :t])
            scale = new
            safe = torch.where(scale > 0, scale, 1)
            codes[:, :, t : t + 1] = torch.clamp(
                torch.round(tokens[:, :, t : t + 1] / safe), -127, 127
            )
        out[:, :, p0 : p0 + page] = codes * scale
    return out


def fp8(x, dtype, per_token_scale: bool):  # noqa: ANN001, ANN201
    import torch

    if not per_token_scale:  # scale 1, as vLLM without calibration
        return x.to(dtype).float()
    scale = x.abs().amax(-1, keepdim=True) / torch.finfo(dtype).max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale).to(dtype).float() * scale


def schemes() -> dict[str, tuple[Callable, Callable]]:
    """name -> (what K goes through, what V goes through)."""
    import torch

    both = lambda f: (f, f)  # noqa: E731
    return {
        "bf16": both(lambda x: x.to(torch.bfloat16).float()),
        "int8 per token-head": both(per_token),
        "int8 per token-head, 32 dims": both(lambda x: per_token(x, 32)),
        "int8 per token-head, 16 dims": both(lambda x: per_token(x, 16)),
        "K per channel-page fp16, V token": (per_channel_page, lambda x: per_token(x, fp16=True)),
        "K per channel-page log8, V token": (
            lambda x: per_channel_page(x, steps=8),
            lambda x: per_token(x, fp16=True),
        ),
        "K appended pages log8, V token": (appended_pages, lambda x: per_token(x, fp16=True)),
        "fp8 e4m3, scale 1": both(lambda x: fp8(x, torch.float8_e4m3fn, False)),
        "fp8 e4m3 per token-head": both(lambda x: fp8(x, torch.float8_e4m3fn, True)),
        "fp8 e5m2 per token-head": both(lambda x: fp8(x, torch.float8_e5m2, True)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_study", description=__doc__)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-tokens", type=int, default=512)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from launch.prepare_model import prepare_default_model

    folder = prepare_default_model(quiet=True)
    ids = AutoTokenizer.from_pretrained(folder)(args.text.read_text())["input_ids"]
    size = args.window_tokens
    windows = [ids[i * size : (i + 1) * size] for i in range(args.windows)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    plain = ALL_ATTENTION_FUNCTIONS["sdpa"]
    chosen: list[tuple[Callable, Callable] | None] = [None]

    def attention(module, query, key, value, *rest, **kwargs):  # noqa: ANN001, ANN202
        if chosen[0] is not None:  # key, value [B, H_kv, T, D]: as the cache would hold them
            key, value = chosen[0][0](key), chosen[0][1](value)
        return plain(module, query, key, value, *rest, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:

        @torch.inference_mode()
        def log_probs(window: list[int]) -> torch.Tensor:
            return torch.log_softmax(model(torch.tensor([window])).logits[0, :-1].double(), -1)

        reference = [log_probs(w) for w in windows]
        print(f"KV schemes against fp32, {len(windows)} windows of {size} tokens of {args.text}:")
        for name, scheme in schemes().items():
            chosen[0] = scheme
            kld, same = [], []
            for window, p in zip(windows, reference, strict=True):
                q = log_probs(window)
                kld.append((p.exp() * (p - q)).sum(-1))
                same.append((p.argmax(-1) == q.argmax(-1)).double())
            kl, top = torch.cat(kld), torch.cat(same)
            print(
                f"  {name:34s} mean KLD {kl.mean().item():.6f}  p99 "
                f"{kl.quantile(0.99).item():.5f}  same top {100 * top.mean().item():.2f}%",
                flush=True,
            )
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = plain
    return 0


if __name__ == "__main__":
    sys.exit(main())
