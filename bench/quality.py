"""`ppring bench quality`: what each configuration does to the next-token distribution, against
fp32 on the same weights, position by position over a fixed text.

    ppring bench quality [--model DIR] [--text FILE] [--windows 8] [--window-tokens 512]
                         [--reference float32]
                         [--candidates auto,auto+kv8,auto+a8,bfloat16+exact,int8,hf-bfloat16,
                                       hf-float32]

As llama.cpp's `perplexity --kl-divergence` reports quantization error: the text (by default
bench/texts/quality_en.txt, shipped so every run measures the same thing) is cut into windows of
--window-tokens tokens, each run teacher-forced through every configuration (one stage holding
every layer, one prefill from position 0; bench/agreement.py's machinery), and at each position
the candidate's next-token distribution Q is compared with the reference's P: KL(P || Q) in nats,
whether both put the same token on top, and the candidate's own perplexity. Window by window:
only one window's logits of the reference and of one candidate are held at once (the default
model's over 8 windows would take 0.8 GB a configuration). A configuration is one of
bench/agreement.py's (`auto` is the default path: on a CPU with AVX-512 BF16, bf16 with the
GGUF codes times activations quantized to int8 in two passes; `auto+a8` in one pass, as
llama.cpp does; `bfloat16+exact` the codes decoded to bf16; `int8` int8 weights), or
a `+kv8` on any of them stores the KV cache in 8 bits (--kv-cache-dtype int8: `auto+kv8`
against `auto` is what the 8-bit cache costs), or
`hf-DTYPE`: transformers' AutoModelForCausalLM in DTYPE on the same folder (`hf-bfloat16`: what
bf16 alone costs; `hf-float32` against the float32 reference: a sanity row, near 0).
Writes bench_quality.json into --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.agreement import load_runner, split_config, text_windows, window_logits

DEFAULT_TEXT = Path(__file__).parent / "texts" / "quality_en.txt"
DEFAULT_CANDIDATES = "auto,auto+kv8,auto+a8,bfloat16+exact,int8,hf-bfloat16,hf-float32"
HF_DTYPES = ("float32", "bfloat16")
KLD_ROWS = 128  # rows of a window whose log-softmaxes are taken at once (fp64: 2 x 50 MB)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ppring bench quality",
        description=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="default: the shipped one")
    parser.add_argument("--windows", type=int, default=8, help="0: every whole window")
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--reference", default="float32", help="a configuration (see above)")
    parser.add_argument("--candidates", default=DEFAULT_CANDIDATES, help="comma-separated")
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    if args.windows < 0 or args.window_tokens < 2:
        parser.error("--windows must be >= 0 and --window-tokens >= 2")
    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    if args.reference in args.candidates:
        parser.error(f"--reference {args.reference} is one of the candidates too")
    for config in [args.reference, *args.candidates]:
        try:
            check_config(config)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def check_config(config: str) -> None:
    """ValueError unless `config` is bench/agreement.py's configuration or hf-DTYPE."""
    if config.startswith("hf-"):
        if config[3:] not in HF_DTYPES:
            raise ValueError(f"{config}: transformers runs as hf-float32 or hf-bfloat16")
    else:
        split_config(config)


class HfModel:
    """transformers' AutoModelForCausalLM on the folder, in `dtype`, with window_logits's
    contract."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        import torch

        from launch.prepare_model import load_hf_model

        self.model = load_hf_model(model_dir, dtype=getattr(torch, dtype)).eval()

    def window_logits(self, window: list[int]) -> Any:
        import torch

        with torch.inference_mode():
            return self.model(torch.tensor([window])).logits[0, :-1].float()  # [W - 1, V]


@dataclass
class Tally:
    """Per-position scores of one configuration against the reference, over every window."""

    kld: list[Any] = field(default_factory=list)  # [R] float64 tensors, a window's each
    same_top: int = 0
    nll: float = 0.0
    seconds: float = 0.0

    def add(self, ref_logits: Any, logits: Any, targets: Any) -> None:
        """ref_logits, logits [R, V] fp32 of the same R positions; targets [R] the next tokens."""
        kld, same, nll = compare_rows(ref_logits, logits, targets)
        self.kld.append(kld)
        self.same_top += same
        self.nll += nll

    def summary(self, ref_perplexity: float | None) -> dict:
        import torch

        kld = torch.cat(self.kld)  # [positions] float64
        count = kld.numel()
        spread = float(kld.std()) if count > 1 else 0.0
        share = self.same_top / count
        ppl = math.exp(self.nll / count)
        return {
            "mean_kld": float(kld.mean()),
            "mean_kld_stderr": spread / math.sqrt(count),
            "median_kld": float(kld.quantile(0.5)),  # linear interpolation, as numpy's
            "p99_kld": float(kld.quantile(0.99)),
            "max_kld": float(kld.max()),
            "top1_agreement": share,
            "top1_agreement_stderr": math.sqrt(share * (1 - share) / count),
            "perplexity": ppl,
            "perplexity_ratio": ppl / ref_perplexity if ref_perplexity else None,
            "positions": count,
            "seconds": round(self.seconds, 2),
        }


def compare_rows(ref_logits: Any, logits: Any, targets: Any) -> tuple[Any, int, float]:
    """(KL(P || Q) per row [R] in nats, rows whose top token is the same, the candidate's summed
    negative log-likelihood of `targets`), P = softmax(ref_logits), Q = softmax(logits); a few
    rows at a time, so only [KLD_ROWS, V] temporaries exist beside the two inputs."""
    import torch

    klds, same, nll = [], 0, 0.0
    for at in range(0, ref_logits.shape[0], KLD_ROWS):
        ref = torch.log_softmax(ref_logits[at : at + KLD_ROWS].double(), dim=-1)
        got = torch.log_softmax(logits[at : at + KLD_ROWS].double(), dim=-1)
        klds.append((ref.exp() * (ref - got)).sum(dim=-1).clamp(min=0.0))
        same += int((ref.argmax(dim=-1) == got.argmax(dim=-1)).sum())
        rows = torch.arange(got.shape[0])
        nll -= float(got[rows, targets[at : at + KLD_ROWS]].sum())
    return torch.cat(klds), same, nll


def load(model_dir: Path, name: str, blocks: int, threads: int | None) -> tuple[Any, str]:
    """(a callable window -> [W - 1, V] fp32 logits, what it runs) for configuration `name`."""
    if name.startswith("hf-"):
        hf = HfModel(model_dir, name[3:])
        return hf.window_logits, f"transformers {name[3:]}"
    runner, what = load_runner(model_dir, name, blocks, threads)
    return (lambda window: window_logits(runner, window)), f"ppring {what}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from launch.prepare_model import load_tokenizer, resolve_model
    from stages.batch import blocks_needed

    started = time.monotonic()
    model_dir = Path(resolve_model(args.model))
    text = args.text.read_text(errors="replace")
    ids = list(load_tokenizer(model_dir)(text)["input_ids"])
    windows = text_windows(ids, args.windows or len(ids), args.window_tokens)
    blocks = blocks_needed(max(len(w) for w in windows))
    names = [args.reference, *args.candidates]
    # Every configuration is held at once (the default model's take 1.5 GB together), so each
    # window's reference logits are computed once and dropped before the next window.
    models, what = {}, {}
    for name in names:
        models[name], what[name] = load(model_dir, name, blocks, args.threads)
        print(f"  {name}: {what[name]}", flush=True)
    tallies = {name: Tally() for name in names}
    for i, window in enumerate(windows):
        targets = torch.tensor(window[1:])
        begin = time.perf_counter()
        ref_logits = models[args.reference](window)
        tallies[args.reference].seconds += time.perf_counter() - begin
        tallies[args.reference].add(ref_logits, ref_logits, targets)
        for name in args.candidates:
            begin = time.perf_counter()
            logits = models[name](window)
            tallies[name].seconds += time.perf_counter() - begin
            tallies[name].add(ref_logits, logits, targets)
            del logits
        print(f"  window {i + 1}/{len(windows)} done", flush=True)
        del ref_logits
    ref = tallies[args.reference].summary(None)
    scores = {name: tallies[name].summary(ref["perplexity"]) for name in args.candidates}
    result: dict[str, Any] = {
        "bench": "quality",
        "command": "ppring bench quality " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": str(model_dir),
        "text": str(args.text),
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "text_tokens": len(ids),
        "windows": len(windows),
        "window_tokens": args.window_tokens,
        "reference": {
            "name": args.reference,
            "what": what[args.reference],
            "perplexity": ref["perplexity"],
            "seconds": ref["seconds"],
        },
        "candidates": {name: {"what": what[name], **scores[name]} for name in args.candidates},
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_quality.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 0


def table(result: dict) -> str:
    ref, candidates = result["reference"], result["candidates"]
    # what bf16 alone costs, where transformers in bf16 ran: each mean KLD as a multiple of it
    yardstick = candidates.get("hf-bfloat16", {}).get("mean_kld")
    windows = f"{result['windows']} window{'s' if result['windows'] != 1 else ''}"
    lines = [
        f"\nagainst {ref['name']} ({ref['what']}; perplexity {ref['perplexity']:.3f}; "
        f"{ref['seconds']:.1f} s), "
        f"{windows} of {result['window_tokens']} tokens of {result['text']}:",
        f"  {'configuration':<16} {'mean KLD':>19} {'x hf-bf16':>9} {'median':>8} {'p99':>8} "
        f"{'max':>7} {'same top':>14} {'perplexity':>10} {'ratio':>7} {'s':>6}",
    ]
    for name, c in candidates.items():
        times = f"{c['mean_kld'] / yardstick:.2f}" if yardstick else "-"
        lines.append(
            f"  {name:<16} {small(c['mean_kld'], 6):>10} ±{small(c['mean_kld_stderr'], 6):<8} "
            f"{times:>9} {small(c['median_kld'], 6):>8} {small(c['p99_kld'], 5):>8} "
            f"{small(c['max_kld'], 4):>7} "
            f"{100 * c['top1_agreement']:>6.2f} ±{100 * c['top1_agreement_stderr']:.2f}% "
            f"{c['perplexity']:>10.3f} {c['perplexity_ratio']:>7.4f} {c['seconds']:>6.1f}"
        )
    lines.append(
        "  (KLD: KL(reference || candidate) a position, nats; same top: the share of positions"
        " whose top token is the reference's;\n   ratio: perplexity over the reference's; s: the"
        " configuration's forwards)"
    )
    return "\n".join(lines)


def small(value: float, digits: int) -> str:
    """`value` with `digits` decimals, or in e-notation where those would show it as 0."""
    return f"{value:.{digits}f}" if value == 0 or abs(value) >= 10**-digits else f"{value:.1e}"


if __name__ == "__main__":
    sys.exit(main())
