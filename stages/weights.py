"""Read one stage's weights, and only those, from a local Hugging Face safetensors folder.

A stage owning layers [start, end) reads `model.layers.{i}.*` for those i, plus the embedding on
the first stage and the final norm and lm_head on the last. `safe_open` maps each file and reads
a tensor only when asked, so a 70B checkpoint costs a stage only its own share of memory and I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from stages.config import STAGE_DTYPES, ModelConfig
from stages.errors import ConfigError
from stages.gguf_file import is_gguf, stage_tensors
from stages.gguf_matrix import GgufMatrix

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

TORCH_DTYPES = {name: getattr(torch, name) for name in STAGE_DTYPES}


@dataclass
class StageWeights:
    # Keyed by checkpoint name; with tied embeddings the last stage's "lm_head.weight" is the
    # embedding matrix (the same tensor object as "model.embed_tokens.weight" when both are here).
    tensors: dict[str, torch.Tensor]
    num_tensors_read: int  # tensors actually read from disk (a test checks only own ones are)


def to_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a --dtype name; only float32, bfloat16 and float16 are allowed."""
    if isinstance(dtype, torch.dtype):
        if dtype in TORCH_DTYPES.values():
            return dtype
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"--dtype {dtype} is not supported; use float32 or bfloat16")
    return TORCH_DTYPES[dtype]


def stage_tensor_names(
    config: ModelConfig, start: int, end: int, lm_head: bool | None = None
) -> list[str]:
    """Checkpoint names stage [start, end) needs. `lm_head`: it multiplies by (some of) the
    lm_head; None means "if it is the last stage" (the first one also does, with the lm_head
    split). With tied embeddings the embedding is listed in place of lm_head, since that is what
    it reads."""
    names = []
    layer_tensors = config.layer_spec.layer_tensors()  # the family's names in one layer
    is_last = end == config.num_layers
    if start == 0:
        names.append(EMBED)
    for layer in range(start, end):
        names.extend(f"model.layers.{layer}.{suffix}" for suffix in layer_tensors)
    if is_last:
        names.append(FINAL_NORM)
    if is_last if lm_head is None else lm_head:
        head = EMBED if config.tie_word_embeddings else LM_HEAD
        if head not in names:
            names.append(head)
    return names


def load_stage_weights(
    folder: str | Path,
    config: ModelConfig,
    start: int,
    end: int,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    lm_head: bool | None = None,
    matrix_dtype: str | torch.dtype | None = None,
) -> StageWeights:
    """`lm_head` as in stage_tensor_names: the whole matrix is loaded under LM_HEAD (the stage
    keeps its rows). `matrix_dtype` (None: `dtype`): the dtype of the 2-D tensors the
    checkpoint holds in fp32, the weight matrices and the embedding (stages/backend/cpu/linear.py
    source_dtype); everything else takes `dtype`."""
    folder = Path(folder)
    torch_dtype = to_torch_dtype(dtype)
    matrix_torch_dtype = to_torch_dtype(matrix_dtype or dtype)
    names = stage_tensor_names(config, start, end, lm_head)
    if is_gguf(folder):  # one file: its quantized matrices as blocks (stages/gguf_file.py)
        tensors, num_read = _gguf_tensors(
            folder, names, config, torch_dtype, matrix_torch_dtype, device
        )
    else:
        tensors, num_read = _safetensors(
            folder, names, config, torch_dtype, matrix_torch_dtype, device
        )
    if end == config.num_layers if lm_head is None else lm_head:
        tensors[LM_HEAD] = tensors[EMBED if config.tie_word_embeddings else LM_HEAD]
    return StageWeights(tensors=tensors, num_tensors_read=num_read)


def _gguf_tensors(
    path: Path,
    names: list[str],
    config: ModelConfig,
    dtype: torch.dtype,
    matrix_dtype: torch.dtype,
    device: str | torch.device,
) -> tuple[dict[str, torch.Tensor], int]:
    """`names` from a GGUF file, and how many were read: a quantized matrix as its blocks (a
    GgufMatrix the backend decides how to hold), the rest as tensors."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in stage_tensors(path, names, config).items():
        if isinstance(value, GgufMatrix):
            tensors[name] = value.on(torch.device(device))  # type: ignore[assignment]
            continue
        # (copied: an F32 tensor's array is a view of the memory-mapped file)
        wanted = matrix_dtype if value.ndim == 2 else dtype
        tensors[name] = torch.tensor(value).to(device=device, dtype=wanted)
    return tensors, len(tensors)


def _safetensors(
    folder: Path,
    names: list[str],
    config: ModelConfig,
    torch_dtype: torch.dtype,
    matrix_torch_dtype: torch.dtype,
    device: str | torch.device,
) -> tuple[dict[str, torch.Tensor], int]:
    """`names` from a folder's safetensors files; and how many were read."""
    locations = _tensor_locations(folder)
    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name not in locations:
            raise ConfigError(_missing_message(name, folder, config))
        by_file.setdefault(locations[name], []).append(name)

    tensors: dict[str, torch.Tensor] = {}
    num_read = 0
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in file_names:
                # copy=True: get_tensor may hand back pages of the memory-mapped file, which
                # the kernel can drop and fault back in from disk mid-forward; own the memory.
                tensor = handle.get_tensor(name)
                # fp32 matrices only from an fp32 checkpoint: another one has no fp32 values to
                # find a grid in, and would only double its memory while it loads
                fp32_source = tensor.dtype == torch.float32 and tensor.dim() == 2
                wanted = matrix_torch_dtype if fp32_source else torch_dtype
                tensors[name] = tensor.to(device=device, dtype=wanted, copy=True)
                num_read += 1
    return tensors, num_read


def _tensor_locations(folder: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{folder} has no *.safetensors files; export the model with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
        )
    locations: dict[str, Path] = {}
    for file in files:
        # Opening a file reads only its JSON header, not the tensors.
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                locations[name] = file
    return locations


def _missing_message(name: str, folder: Path, config: ModelConfig) -> str:
    if name == LM_HEAD:
        return (
            f"{folder} has no {LM_HEAD} and its config.json says tie_word_embeddings=false; "
            "add the tensor or set tie_word_embeddings=true if the model shares its embedding"
        )
    return (
        f"tensor {name} is missing from {folder}; the checkpoint is incomplete or not a "
        f"{config.architecture}, so re-export it"
    )
