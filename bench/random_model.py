"""A Llama folder with random weights in a real model's shape, for benches on hardware where no
checkpoint can be fetched (the device machines reach no model hub).

    python -m bench.random_model --preset llama-3-8b --dtype bfloat16 --device cuda --out DIR

The folder is what `ppring local`, `ppring bench serve` and Hugging Face `generate` load from any
checkpoint: config.json, safetensors shards, generation_config.json, and a tokenizer. The
tokenizer is a word-level one with exactly `vocab_size` entries ("t1234" is token 1234), so
token ids round-trip through text and the frontend's vocabulary checks see the model's real
vocabulary size. Random weights make the text meaningless, not the timing: every step reads the
same bytes and does the same arithmetic as the real model of that shape.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    bos_token_id: int
    eos_token_id: int | list[int]
    tie_word_embeddings: bool = False


# Llama-3.1-8B's config.json, as Meta publishes it (meta-llama/Llama-3.1-8B).
PRESETS: dict[str, Shape] = {
    "llama-3-8b": Shape(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_positions=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # Llama-3.2-1B's config.json (meta-llama/Llama-3.2-1B): 1.24 B parameters, the embedding
    # tied; what a user's bf16 checkpoint of real size looks like on a CPU (issue 49).
    "llama-3.2-1b": Shape(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        max_positions=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=True,
    ),
    # Seconds to build on a CPU: for tests of this script and of the benches that use it.
    "tiny": Shape(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_positions=1024,
        rope_theta=10000.0,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
UNK_TOKEN_ID = 0


def make_random_model(
    out: str | Path,
    shape: Shape,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    max_shard_size: str = "5GB",
) -> Path:
    """Write a random-init Llama of `shape` to `out` and return the folder."""
    import torch
    from transformers import LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = llama_config(shape)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # initialise in the target dtype: 8B params, 16 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    del model
    write_tokenizer(out, shape)
    return out


def llama_config(shape: Shape) -> Any:
    """transformers' LlamaConfig for `shape` (the tests' tiny models are built from it too)."""
    from transformers import LlamaConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        rope = {**shape.rope_scaling, "rope_theta": shape.rope_theta}
    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_parameters=rope,
        bos_token_id=shape.bos_token_id,
        eos_token_id=shape.eos_token_id,
    )


def write_tokenizer(out: Path, shape: Shape) -> None:
    """A word-level tokenizer with exactly `shape.vocab_size` tokens: id i is the word "t{i}",
    except the unknown, BOS and EOS tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = shape.eos_token_id if isinstance(shape.eos_token_id, int) else shape.eos_token_id[0]
    special = {UNK_TOKEN_ID: "<unk>", shape.bos_token_id: "<s>", eos: "</s>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(shape.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.random_model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3-8b")
    parser.add_argument("--num-layers", type=int, default=None, help="override the preset's")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--device", default="cpu", help="where to initialise (cuda is faster)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    shape = PRESETS[args.preset]
    if args.num_layers is not None:
        if args.num_layers < 1:
            parser.error("--num-layers must be >= 1")
        shape = Shape(**{**shape.__dict__, "num_layers": args.num_layers})
    started = time.monotonic()
    make_random_model(args.out, shape, args.dtype, args.device, args.seed)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(
        f"wrote {args.out}: {args.preset} ({shape.num_layers} layers), {args.dtype}, "
        f"{size / 1e9:.2f} GB of weights in {time.monotonic() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
