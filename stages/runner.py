"""The real pipeline stage, `StageRunner`: loads its own layers from a Hugging Face folder and
runs them (the contract it implements, `Stage`, is in stages/contract.py; the ring's simulated
stage implements the same one without a model).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from protocol.sampling import SamplingParams
from stages import native
from stages.batch import BLOCK_SIZE, SampleResult, SeqChunk
from stages.config import ModelConfig
from stages.contract import LogitsShare, Seam, Stage, StageOutput
from stages.dtype import resolve_dtype
from stages.inputs import ForwardInputs, build_inputs
from stages.kv_cache import KVCache, num_blocks_for_budget
from stages.linear import check_quantization
from stages.llama import Kind, LlamaStage
from stages.partition import (
    layer_range,
    lm_head_rows,
    partition_for_model,
    partition_layers,
    vocab_cut,
)
from stages.sampler import GREEDY, sample
from stages.weights import load_stage_weights, to_torch_dtype

logger = logging.getLogger(__name__)


class StageRunner(Stage):
    """The real stage: loads its own weights from a Hugging Face folder and runs them."""

    def __init__(
        self,
        model_dir: str | Path,
        start_layer: int,
        end_layer: int,
        *,
        kv_budget_bytes: int,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        rank: int | None = None,
        num_threads: int | None = None,
        quantization: str = "none",
        split_lm_head: bool = False,
    ) -> None:
        """`split_lm_head`: the first and the last stage each multiply by half of the
        vocabulary and the first samples (a one-stage ring has nothing to split)."""
        if num_threads is not None:
            # One stage per process: stages sharing a host must split its cores, or their
            # OpenMP thread pools fight and every op slows down many times over.
            torch.set_num_threads(num_threads)
        self.config = ModelConfig.from_folder(model_dir)
        if not 0 <= start_layer < end_layer <= self.config.num_layers:
            raise ValueError(
                f"layer range [{start_layer}, {end_layer}) is not inside the model's "
                f"{self.config.num_layers} layers"
            )
        self.start_layer, self.end_layer = start_layer, end_layer
        is_first, is_last = start_layer == 0, end_layer == self.config.num_layers
        self.split_lm_head = split_lm_head and not (is_first and is_last)
        vocab = self.config.vocab_size
        self.vocab_cut = vocab_cut(vocab) if self.split_lm_head else 0
        head_rows = lm_head_rows(vocab, is_first, is_last, self.split_lm_head)
        self.device = torch.device(device)
        if isinstance(dtype, str) and dtype == "auto":
            self.dtype = resolve_dtype("auto", self.device, self.config.torch_dtype).dtype
        else:
            self.dtype = to_torch_dtype(dtype)
        self.log_prefix = f"[pp{rank}]" if rank is not None else f"[L{start_layer}-{end_layer}]"
        kernels, kernels_reason = native.kernels_for(self.device, self.dtype)
        check_quantization(quantization, self.device, kernels, kernels_reason)
        self.quantization = quantization
        weights = load_stage_weights(
            model_dir,
            self.config,
            start_layer,
            end_layer,
            self.dtype,
            self.device,
            lm_head=head_rows is not None,
        )
        self.num_tensors_read = weights.num_tensors_read
        kind = Kind.build(kernels, quantization)
        self.model = LlamaStage(
            self.config, weights.tensors, start_layer, end_layer, kind, head_rows
        )
        self.is_first_stage = self.model.is_first_stage
        self.is_last_stage = self.model.is_last_stage
        # What `run` does with the layers' output is fixed by the role, chosen once here.
        if not self.is_last_stage:
            self._finish = self._hand_on
        elif self.split_lm_head:
            self._finish = self._share
        else:
            self._finish = self._sample
        if self.model.head_rows is not None and self.split_lm_head:
            logger.info(
                "%s lm_head split: this stage multiplies by vocabulary rows [%d, %d) of %d%s",
                self.log_prefix,
                *self.model.head_rows,
                vocab,
                "; it samples" if is_first else "",
            )
        # Where the kernels run, attention reads the paged cache in place; elsewhere torch
        # gathers each context's K and V for SDPA (stages/attention.py).
        self.attention = "paged" if kernels is not None else "gather"
        logger.info(
            "%s CPU kernels: %s; attention: %s; weights: %s",
            self.log_prefix,
            kernels_reason if kernels is None else "on",
            self.attention,
            "int8 (per-channel scales)"
            if quantization == "int8"
            else "fp32, packed in panels for the kernels"
            if kernels is not None and self.dtype == torch.float32
            else "unquantized",
        )
        self._num_kv_blocks = num_blocks_for_budget(
            self.config, self.num_local_layers, kv_budget_bytes, self.dtype
        )
        self.kv: KVCache | None = None
        logger.info(
            "%s layers [%d, %d) loaded: %d tensors, %.1f MiB %s on %s; "
            "KV budget %.1f MiB holds %d blocks (%d tokens)",
            self.log_prefix,
            start_layer,
            end_layer,
            self.num_tensors_read,
            self.parameter_bytes / 2**20,
            str(self.dtype).removeprefix("torch."),
            self.device,
            kv_budget_bytes / 2**20,
            self._num_kv_blocks,
            self._num_kv_blocks * BLOCK_SIZE,
        )

    @classmethod
    def for_rank(
        cls,
        model_dir: str | Path,
        pp_size: int,
        rank: int,
        *,
        kv_budget_bytes: int,
        partition: list[int] | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        num_threads: int | None = None,
        quantization: str = "none",
        partition_rule: str = "cost",
        split_lm_head: bool = False,
    ) -> StageRunner:
        """Stage `rank` of `pp_size`; the partition defaults to PPRING_LAYER_PARTITION if set,
        else `partition_rule` (stages/partition.py)."""
        config = ModelConfig.from_folder(model_dir)
        num_layers = config.num_layers
        if partition is None:
            partition = partition_for_model(config, pp_size, partition_rule, split_lm_head)
        else:
            partition = partition_layers(num_layers, pp_size, ",".join(map(str, partition)))
        start, end = layer_range(partition, rank)
        return cls(
            model_dir,
            start,
            end,
            kv_budget_bytes=kv_budget_bytes,
            dtype=dtype,
            device=device,
            rank=rank,
            num_threads=num_threads,
            quantization=quantization,
            split_lm_head=split_lm_head,
        )

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def parameter_bytes(self) -> int:
        """Bytes of weights this stage holds (a tied matrix once; int8 weights with their
        scales; fp32 panels with their padding to 16 channels): a decode step reads them all,
        but for an untied embedding, of which it reads only its tokens' rows."""
        tensors = list(self.model.parameters()) + [
            b for b in self.model.buffers() if b is not self.model.inv_freq
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    def allocate_kv(self, num_blocks: int) -> None:
        if not 0 < num_blocks <= self._num_kv_blocks:
            raise ValueError(
                f"{self.log_prefix} cannot allocate {num_blocks} KV blocks; its budget holds "
                f"{self._num_kv_blocks}"
            )
        self.kv = None  # free the old cache before allocating the new one
        self.kv = KVCache(
            self.num_local_layers,
            num_blocks,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.dtype,
            self.device,
        )
        logger.info(
            "%s KV cache: %d blocks, %.1f MiB", self.log_prefix, num_blocks, self.kv.nbytes / 2**20
        )

    def run(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[Sequence[int] | None] | None = None,
    ) -> StageOutput:
        inputs, h, residual = self._forward(chunks, hidden_states, residual)
        return self._finish(chunks, inputs, h, residual, sampling, histories)

    def forward_logits(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Last stage: run `chunks` and return fp32 logits, [T, V] for every row if `all_rows`,
        else [num_sampled, V] for the sampled rows. For parity tests and tools."""
        if not self.is_last_stage or self.split_lm_head:
            raise ValueError(f"{self.log_prefix} is not the last stage of an unsplit lm_head")
        inputs, h, residual = self._forward(chunks, hidden_states, residual)
        rows = None if all_rows else inputs.sample_rows
        with torch.inference_mode():
            return self.model.compute_logits(h, residual, rows).float()

    def _forward(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[ForwardInputs, torch.Tensor, torch.Tensor]:
        if self.kv is None:
            raise RuntimeError(f"{self.log_prefix} has no KV cache; call allocate_kv first")
        inputs = build_inputs(chunks, self.device, self.attention)
        with torch.inference_mode():
            h, residual = self.model(inputs, self.kv, hidden_states, residual)
        return inputs, h, residual

    def _hand_on(
        self,
        chunks: list[SeqChunk],
        inputs: ForwardInputs,
        h: torch.Tensor,
        residual: torch.Tensor,
        sampling: Sequence[SamplingParams | None] | None,
        histories: Sequence[Sequence[int] | None] | None,
    ) -> Seam:
        return Seam(hidden_states=h, residual=residual)  # both [T, d]

    def _sample(
        self,
        chunks: list[SeqChunk],
        inputs: ForwardInputs,
        h: torch.Tensor,
        residual: torch.Tensor,
        sampling: Sequence[SamplingParams | None] | None,
        histories: Sequence[Sequence[int] | None] | None,
    ) -> SampleResult:
        picked = [i for i, chunk in enumerate(chunks) if chunk.sample]
        if not picked:
            return SampleResult(token_ids=[])
        with torch.inference_mode():
            logits = self.model.compute_logits(h, residual, inputs.sample_rows)  # [N, V]
            return _sample_picked(logits, chunks, sampling, histories)

    def _share(
        self,
        chunks: list[SeqChunk],
        inputs: ForwardInputs,
        h: torch.Tensor,
        residual: torch.Tensor,
        sampling: Sequence[SamplingParams | None] | None,
        histories: Sequence[Sequence[int] | None] | None,
    ) -> LogitsShare:
        """Last stage, lm_head split: its part of the sampled rows' logits, for the first stage.
        A batch of plain greedy rows needs only each row's best logit: 16 bytes a row travel
        instead of (V - cut) logits."""
        params = _picked_params(chunks, sampling)
        empty = torch.empty(0)
        with torch.inference_mode():
            x = self.model.final_hidden(h, residual, inputs.sample_rows)  # [N, d]
            part = self.model.lm_head(x)  # [N, V - cut]
            if not all(_plain_greedy(p) for p in params):
                return LogitsShare(hidden=x, logits=part, best_logit=empty, best_token=empty)
            best = part.argmax(dim=-1)  # [N]: the first of equal maxima, as argmax over all V
            best_logit = part.gather(1, best[:, None]).squeeze(1)  # [N]
            return LogitsShare(
                hidden=x, logits=empty, best_logit=best_logit, best_token=best + self.vocab_cut
            )

    def sample_share(
        self,
        chunks: list[SeqChunk],
        share: LogitsShare,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[Sequence[int] | None] | None = None,
    ) -> SampleResult:
        """First stage, lm_head split: its rows [0, cut) of the logits, joined with the last
        stage's share, sampled as one [N, V] (so every draw equals the unsplit ring's)."""
        if not (self.split_lm_head and self.is_first_stage):
            raise ValueError(f"{self.log_prefix} does not sample a split lm_head")
        picked = [i for i, chunk in enumerate(chunks) if chunk.sample]
        if not picked:
            return SampleResult(token_ids=[])
        with torch.inference_mode():
            own = self.model.lm_head(share["hidden"].to(self.device, self.dtype))  # [N, cut]
            if share["best_token"].numel():  # plain greedy: the better of two maxima
                best_own = own.argmax(dim=-1)  # [N]
                own_logit = own.gather(1, best_own[:, None]).squeeze(1)
                theirs = share["best_logit"].to(self.device, own.dtype)
                # A tie goes to the lower token id, as argmax over the whole row would.
                tokens = torch.where(
                    theirs > own_logit, share["best_token"].to(self.device), best_own
                )
                return SampleResult(token_ids=tokens.tolist())
            logits = torch.cat((own, share["logits"].to(self.device, own.dtype)), dim=1)  # [N, V]
            return _sample_picked(logits, chunks, sampling, histories)


def _sample_picked(
    logits: torch.Tensor,
    chunks: list[SeqChunk],
    sampling: Sequence[SamplingParams | None] | None,
    histories: Sequence[Sequence[int] | None] | None,
) -> SampleResult:
    """Sample logits [N, V] of the chunks that sample, with their parameters and histories."""
    picked = [i for i, chunk in enumerate(chunks) if chunk.sample]
    return sample(
        logits,
        _picked_params(chunks, sampling),
        # A token's seed position is where it lands in the sequence.
        [chunks[i].seq_len for i in picked],
        None if histories is None else [histories[i] for i in picked],
    )


def _picked_params(
    chunks: list[SeqChunk], sampling: Sequence[SamplingParams | None] | None
) -> list[SamplingParams]:
    """The sampling parameters of the chunks that sample, greedy where none were given."""
    return [
        (sampling[i] if sampling is not None else None) or GREEDY
        for i, chunk in enumerate(chunks)
        if chunk.sample
    ]


def _plain_greedy(params: SamplingParams) -> bool:
    """Argmax of the raw logits and nothing else: no penalty to apply, no logprob to report."""
    return params.is_greedy and params.repetition_penalty == 1.0 and not params.logprobs
