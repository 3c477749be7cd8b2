"""The real pipeline stage, `StageRunner`: loads its own layers from a Hugging Face folder and
runs them (the contract it implements, `Stage`, is in stages/contract.py; the ring's simulated
stage implements the same one without a model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.sampling import SamplingParams
from stages.backend import Backend
from stages.backend.cpu.kept_decode import CpuDecodeStep
from stages.backend.cpu.linear import bytes_unread, describe_matrices, held_bytes
from stages.backend.cuda import triton_attention
from stages.backend.cuda.graphs import (
    CudaRecorder,
    DecodeGraphs,
    GraphRecorder,
    StaticDecodeInputs,
    StepOutputs,
    capture_sizes,
)
from stages.batch import BLOCK_SIZE, History, SampleResult, SeqChunk
from stages.config import ModelConfig
from stages.contract import LogitsShare, Seam, Stage, StageOutput, StepHandle
from stages.device_step import DeviceSample, DeviceStep, StepClock, new_event
from stages.dtype import resolve_dtype
from stages.inputs import ForwardInputs, build_inputs, on_device
from stages.kv_cache import (
    KVCache,
    kv_bytes_per_token,
    num_blocks_for_budget,
    resolve_kv_cache_dtype,
)
from stages.models.blocks import CausalLMStage
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
        cuda_graph_max_bs: int | None = None,
        graph_recorder: GraphRecorder | None = None,
        overlap: bool | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`split_lm_head`: the first and the last stage each multiply by half of the
        vocabulary and the first samples (a one-stage ring has nothing to split).

        `cuda_graph_max_bs`: on a CUDA device, decode steps of up to this many sequences replay
        as CUDA graphs (backend/cuda/graphs.py), captured once the KV cache is allocated; None or
        0: every step runs eagerly. `graph_recorder` replaces the CUDA recorder (tests record
        "graphs" on a CPU with `EagerRecorder`).

        `overlap`: `launch` returns a queued step (stages/device_step.py); None: on a CUDA
        device. On a CPU it gains nothing (the step has run when launch returns); the tests
        turn it on there to run the GPU's path in real rings.

        `kv_cache_dtype`: --kv-cache-dtype (stages/kv_cache.py resolve_kv_cache_dtype): auto
        keeps K and V in the stage dtype; int8 stores them in 8 bits (stages/kv_quant.py)."""
        if num_threads is not None:
            # One stage per process: stages sharing a host must split its cores, or their
            # OpenMP thread pools fight and every op slows down many times over.
            torch.set_num_threads(num_threads)
        self.config = ModelConfig.from_path(model_dir)
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
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype, self.device)
        # How this stage computes, chosen once (stages/backend/__init__.py)
        self.backend = backend = Backend.pick(self.device, self.dtype, quantization)
        kernels = backend.kernels
        self.quantization = quantization
        weights = load_stage_weights(
            model_dir,
            self.config,
            start_layer,
            end_layer,
            self.dtype,
            self.device,
            lm_head=head_rows is not None,
            matrix_dtype=backend.matrix_dtype(self.dtype),
        )
        self.num_tensors_read = weights.num_tensors_read
        self.model = CausalLMStage(
            self.config, weights.tensors, start_layer, end_layer, backend, head_rows
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
        # gathers each context's K and V for SDPA (stages/backend/torch/attention.py). On a GPU
        # with Triton, decode-only batches read in place too (stages/backend/cuda/ops.py).
        self.attention = "paged" if kernels is not None else "gather"
        self.paged_decode = self.attention == "paged" or self._triton_decode()
        self.graph_recorder = self._graph_recorder(cuda_graph_max_bs, graph_recorder)
        self.cuda_graph_max_bs = cuda_graph_max_bs if self.graph_recorder else None
        self.graphs: DecodeGraphs | None = None
        self.cpu_decode: CpuDecodeStep | None = None  # (allocate_kv)
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.clock = StepClock()
        logger.info(
            "%s %s %s layers (%s); backend: %s; attention: %s; weights: %s",
            self.log_prefix,
            self.config.architecture,
            self.config.layer_spec.describe(),
            "fused"
            if self.model.fused is not None
            else f"one call per op: {backend.compile_refusal(list(self.model.layers), self.dtype)}",
            backend.describe(),
            self.attention,
            "int8 (per-channel scales)"
            if quantization == "int8"
            else describe_matrices(list(self.model.modules()), self.dtype)
            if kernels is not None
            else "unquantized",
        )
        self._num_kv_blocks = num_blocks_for_budget(
            self.config, self.num_local_layers, kv_budget_bytes, self.dtype, self.kv_cache_dtype
        )
        self.kv: KVCache | None = None
        logger.info(
            "%s layers [%d, %d) loaded: %d tensors, %.1f MiB %s on %s; "
            "KV budget %.1f MiB holds %d blocks (%d tokens) of %s KV, %.0f bytes a token",
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
            self.kv_cache_description,
            kv_bytes_per_token(self.config, self.num_local_layers, self.dtype, self.kv_cache_dtype),
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
        cuda_graph_max_bs: int | None = None,
        kv_cache_dtype: str = "auto",
    ) -> StageRunner:
        """Stage `rank` of `pp_size`; the partition defaults to PPRING_LAYER_PARTITION if set,
        else `partition_rule` (stages/partition.py)."""
        config = ModelConfig.from_path(model_dir)
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
            cuda_graph_max_bs=cuda_graph_max_bs,
            kv_cache_dtype=kv_cache_dtype,
        )

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def parameter_bytes(self) -> int:
        """Bytes of weights this stage holds (a tied matrix once; int8 weights with their
        scales; fp32 panels with their padding to 16 channels): a decode step reads them all,
        but for an untied embedding, of which it reads only its tokens' rows."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def weight_bytes_by_format(self) -> dict[str, int]:
        """Of parameter_bytes, the matrices' bytes by how they are held (a GGUF format's codes,
        bf16 or fp32 panels, int8, torch's dtype): stages/backend/cpu/linear.py held_bytes."""
        return held_bytes(list(self.model.modules()))

    def weight_bytes_read(self, rows: int) -> int:
        """Of parameter_bytes, what a forward of `rows` rows reads: a matrix held both as
        codes and as bf16 panels (GridBf16Linear) reads one of them."""
        return self.parameter_bytes - bytes_unread(list(self.model.modules()), rows)

    @property
    def kv_cache_description(self) -> str:
        """What the KV cache holds, in words: the stage dtype, or int8 codes and their scales."""
        if self.kv_cache_dtype == "int8":
            return "int8, K scaled per page and channel, V per token"
        return str(self.dtype).removeprefix("torch.")

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    def allocate_kv(self, num_blocks: int) -> None:
        if not 0 < num_blocks <= self._num_kv_blocks:
            raise ValueError(
                f"{self.log_prefix} cannot allocate {num_blocks} KV blocks; its budget holds "
                f"{self._num_kv_blocks}"
            )
        self.kv = self.graphs = self.cpu_decode = None  # free the old cache (and all over it)
        if self.graph_recorder is not None:
            self.graph_recorder.reset()
        # With graphs, one block more: the scratch block that padding rows write to, which the
        # ring never hands out (it knows num_blocks).
        self.kv = KVCache(
            self.num_local_layers,
            num_blocks + (self.graph_recorder is not None),
            self.config.num_kv_heads,
            self.config.head_dim,
            self.dtype,
            self.device,
            self.kv_cache_dtype,
        )
        logger.info(
            "%s KV cache: %d blocks, %.1f MiB (%s)",
            self.log_prefix,
            num_blocks,
            self.kv.nbytes / 2**20,
            self.kv_cache_description,
        )
        if self.graph_recorder is not None:
            self._capture_graphs(num_blocks)
        elif self.device.type == "cpu":
            # decode-only steps on buffers kept from step to step (backend/cpu/kept_decode.py)
            self.cpu_decode = CpuDecodeStep.build(self.model, self.kv)

    def _triton_decode(self) -> bool:
        """A GPU stage reads the paged cache with the Triton kernel where it builds and checks
        out (backend/cuda/triton_attention.py); otherwise torch's gather path, without graphs."""
        if self.device.type != "cuda":
            return False
        cfg = self.config
        reason = (
            triton_attention.unusable_reason(
                self.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype
            )
            if self.backend.switches.triton_attention
            else f"{triton_attention.DISABLE_ENV}=0"
        )
        if reason is not None:
            logger.warning("%s decode attention: torch's gather path (%s)", self.log_prefix, reason)
        return reason is None

    def _graph_recorder(
        self, max_bs: int | None, recorder: GraphRecorder | None
    ) -> GraphRecorder | None:
        """What records this stage's decode graphs; None: no graphs (a CPU stage, the flag off,
        or nothing to read the paged cache with in a graph)."""
        if not max_bs:
            return None
        if max_bs < 0:
            raise ValueError(f"--cuda-graph-max-bs must be >= 0, got {max_bs}")
        if recorder is None and self.device.type != "cuda":
            return None
        if not self.paged_decode:
            logger.warning(
                "%s CUDA graphs off: decode attention inside a graph needs the Triton kernel",
                self.log_prefix,
            )
            return None
        return recorder or CudaRecorder()

    def _capture_graphs(self, num_blocks: int) -> None:
        assert self.graph_recorder is not None and self.cuda_graph_max_bs
        max_blocks = min(-(-self.config.max_position_embeddings // BLOCK_SIZE), num_blocks)
        buffers = StaticDecodeInputs(
            self.cuda_graph_max_bs,
            max_blocks,
            pad_block=num_blocks,
            hidden_size=None if self.is_first_stage else self.config.hidden_size,
            dtype=self.dtype,
            device=self.device,
            num_kv_heads=self.config.num_kv_heads,
        )
        graphs = DecodeGraphs(
            self._graph_step, buffers, capture_sizes(self.cuda_graph_max_bs), self.graph_recorder
        )
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        with torch.inference_mode():
            graphs.capture()
        memory = (torch.cuda.memory_reserved(self.device) - before) / 2**20 if cuda else 0.0
        self.graphs = graphs
        logger.info(
            "%s CUDA graphs (%s): %d decode batch sizes up to %d captured in %.1f s, %.0f MiB",
            self.log_prefix,
            self.graph_recorder.name,
            len(graphs.sizes),
            graphs.sizes[-1],
            graphs.capture_s,
            memory,
        )

    def _graph_step(
        self, inputs: ForwardInputs, h: torch.Tensor | None, residual: torch.Tensor | None
    ) -> StepOutputs:
        """What a decode graph records: the layers, and on the last stage of an unsplit
        lm_head the logits of every row (each decode samples)."""
        assert self.kv is not None
        h, residual = self.model(inputs, self.kv, h, residual)
        logits = None
        if self.is_last_stage and not self.split_lm_head:
            logits = self.model.compute_logits(h, residual)  # [B, V]
        return h, residual, logits

    def run(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> StageOutput:
        fast = self.cpu_decode
        if fast is not None and fast.takes(chunks, hidden_states, residual):
            if not self.is_last_stage:
                h, residual = fast.seam(chunks, hidden_states, residual)
                return Seam(hidden_states=h, residual=residual)
            if fast.head is not None and _every_row_plain_greedy(chunks, sampling):
                if not self.split_lm_head:
                    return SampleResult(token_ids=fast.tokens(chunks, hidden_states, residual))
                x, best_logit, best_token = fast.share(chunks, hidden_states, residual)
                return LogitsShare(
                    hidden=x, logits=torch.empty(0), best_logit=best_logit, best_token=best_token
                )
        step = self._forward(chunks, hidden_states, residual)
        output = self._finish(chunks, step, sampling, histories)
        if step.from_graph and not self.is_last_stage:
            # The graph's outputs are overwritten by its next replay; the seam leaves as ours.
            output = Seam(hidden_states=step.h.clone(), residual=step.residual.clone())
        if isinstance(output, DeviceSample):
            return output.wait()
        return output

    def launch(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> StepHandle:
        """On a CUDA device the step is only queued when this returns: the seam is on its way
        to pinned host buffers, greedy tokens likewise, and an event marks the end; the ring
        prepares its next step meanwhile. On a CPU, as `Stage.launch`: the step has run
        (unless `overlap`, for tests)."""
        if not self.overlap:
            return super().launch(chunks, hidden_states, residual, sampling, histories)
        launched = time.monotonic()
        start, end = new_event(self.device, timing=True), new_event(self.device, timing=True)
        start.record()
        step = self._forward(chunks, hidden_states, residual)
        output = self._finish(chunks, step, sampling, histories)
        if not self.is_last_stage:
            # Fresh host tensors (a graph's outputs are overwritten by its next replay).
            output = Seam(hidden_states=_to_host(step.h), residual=_to_host(step.residual))
        elif isinstance(output, dict):  # a LogitsShare: every tensor to the host
            output = LogitsShare(**{k: _to_host(v) for k, v in output.items()})  # type: ignore[typeddict-item]
        end.record()
        return DeviceStep(output, start, end, not self.is_last_stage, launched, self.clock)

    def forward_logits(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        all_rows: bool = False,
        graphs: bool = False,
    ) -> torch.Tensor:
        """Last stage: run `chunks` and return fp32 logits, [T, V] for every row if `all_rows`,
        else [num_sampled, V] for the sampled rows. For parity tests and tools; eager unless
        `graphs`, where a decode batch that fits replays its graph (every row samples)."""
        if not self.is_last_stage or self.split_lm_head:
            raise ValueError(f"{self.log_prefix} is not the last stage of an unsplit lm_head")
        step = self._forward(chunks, hidden_states, residual, graphs=graphs)
        if step.logits is not None:  # a graph's (every row is a sampled decode): a copy, as
            return step.logits.to(torch.float32, copy=True)  # the next replay overwrites it
        rows = None if all_rows else step.inputs.sample_rows
        with torch.inference_mode():
            return self.model.compute_logits(step.h, step.residual, rows).float()

    def _forward(
        self,
        chunks: list[SeqChunk],
        hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None,
        graphs: bool = True,
    ) -> Forward:
        if self.kv is None:
            raise RuntimeError(f"{self.log_prefix} has no KV cache; call allocate_kv first")
        size = self.graphs.size_for(chunks) if graphs and self.graphs is not None else None
        with torch.inference_mode():
            if size is not None:
                assert self.graphs is not None
                inputs, (h, residual, logits) = self.graphs.run(
                    chunks, size, hidden_states, residual
                )
                return Forward(inputs, h, residual, logits, from_graph=True)
            inputs = build_inputs(chunks, self.device, self._attention_for(chunks))
            h, residual = self.model(inputs, self.kv, hidden_states, residual)
        return Forward(inputs, h, residual)

    def _attention_for(self, chunks: list[SeqChunk]) -> str:
        """ "paged" where this stage reads the cache in place for this batch, else "gather"."""
        if self.attention == "paged":
            return "paged"
        decode_only = all(chunk.num_tokens == 1 for chunk in chunks)
        return "paged" if self.paged_decode and decode_only else "gather"

    def _hand_on(
        self,
        chunks: list[SeqChunk],
        step: Forward,
        sampling: Sequence[SamplingParams | None] | None,
        histories: Sequence[History | None] | None,
    ) -> Seam:
        return Seam(hidden_states=step.h, residual=step.residual)  # both [T, d]

    def _sample(
        self,
        chunks: list[SeqChunk],
        step: Forward,
        sampling: Sequence[SamplingParams | None] | None,
        histories: Sequence[History | None] | None,
    ) -> SampleResult | DeviceSample:
        """Sample the chunks that sample. On a CUDA device a batch of plain greedy rows leaves
        its tokens on their way to the host (a `DeviceSample`): that copy is the step's only
        wait for the device."""
        picked = [i for i, chunk in enumerate(chunks) if chunk.sample]
        if not picked:
            return SampleResult(token_ids=[])
        params = _picked_params(chunks, sampling)
        greedy = all(_plain_greedy(p) for p in params)
        with torch.inference_mode():
            head = self.model.greedy_head  # (CPU kernels only: never with a graph's logits)
            if greedy and head is not None and len(picked) == step.h.shape[0]:
                # every row samples (a decode batch): final norm, lm_head and argmax at once
                return SampleResult(token_ids=head.tokens(step.h, step.residual).tolist())
            logits = step.logits  # [N, V] from a graph (every row samples), or:
            if logits is None:
                logits = self.model.compute_logits(step.h, step.residual, step.inputs.sample_rows)
            if greedy:
                # No fp32 copy of the logits (the argmax of bf16 values is that of their fp32
                # values), and not torch's argmax: on one Zen 4 thread, 32 rows, the sampler's
                # copy and argmax took 2.5 ms of a 79 ms step.
                tokens = self.model.ops.row_argmax(logits)  # [N]
                if self.overlap:
                    return DeviceSample(_to_host(tokens), new_event(self.device))
                return SampleResult(token_ids=tokens.tolist())
            return _sample_picked(logits, chunks, sampling, histories)

    def _share(
        self,
        chunks: list[SeqChunk],
        step: Forward,
        sampling: Sequence[SamplingParams | None] | None,
        histories: Sequence[History | None] | None,
    ) -> LogitsShare:
        """Last stage, lm_head split: its part of the sampled rows' logits, for the first stage.
        A batch of plain greedy rows needs only each row's best logit: 16 bytes a row travel
        instead of (V - cut) logits."""
        params = _picked_params(chunks, sampling)
        greedy = all(_plain_greedy(p) for p in params)
        empty = torch.empty(0)
        with torch.inference_mode():
            head = self.model.greedy_head
            if greedy and head is not None and len(params) == step.h.shape[0]:
                # every row samples (a decode batch): final norm, lm_head and maxima at once
                x, best_logit, best_token = head.share(step.h, step.residual)
                return LogitsShare(
                    hidden=x, logits=empty, best_logit=best_logit, best_token=best_token
                )
            x = self.model.final_hidden(step.h, step.residual, step.inputs.sample_rows)  # [N, d]
            part = self.model.cap_logits(self.model.lm_head(x))  # [N, V - cut]
            if not greedy:
                return LogitsShare(hidden=x, logits=part, best_logit=empty, best_token=empty)
            best = self.model.ops.row_argmax(part)  # [N]: the first of equal maxima, as over all V
            best_logit = part.gather(1, best[:, None]).squeeze(1)  # [N]
            return LogitsShare(
                hidden=x, logits=empty, best_logit=best_logit, best_token=best + self.vocab_cut
            )

    def sample_share(
        self,
        chunks: list[SeqChunk],
        share: LogitsShare,
        sampling: Sequence[SamplingParams | None] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> SampleResult:
        """First stage, lm_head split: its rows [0, cut) of the logits, joined with the last
        stage's share, sampled as one [N, V] (so every draw equals the unsplit ring's)."""
        if not (self.split_lm_head and self.is_first_stage):
            raise ValueError(f"{self.log_prefix} does not sample a split lm_head")
        picked = [i for i, chunk in enumerate(chunks) if chunk.sample]
        if not picked:
            return SampleResult(token_ids=[])
        with torch.inference_mode():
            hidden = on_device(share["hidden"], self.device).to(self.device, self.dtype)
            head = self.model.greedy_head
            if share["best_token"].numel() and head is not None:  # plain greedy, in one call
                tokens = head.join(hidden, share["best_logit"], share["best_token"])
                return SampleResult(token_ids=tokens.tolist())
            own = self.model.cap_logits(self.model.lm_head(hidden))  # [N, cut]
            if share["best_token"].numel():  # plain greedy: the better of two maxima
                best_own = self.model.ops.row_argmax(own)  # [N]
                own_logit = own.gather(1, best_own[:, None]).squeeze(1)
                theirs = share["best_logit"].to(self.device, own.dtype)
                # A tie goes to the lower token id, as argmax over the whole row would.
                tokens = torch.where(
                    theirs > own_logit, share["best_token"].to(self.device), best_own
                )
                return SampleResult(token_ids=tokens.tolist())
            logits = torch.cat((own, share["logits"].to(self.device, own.dtype)), dim=1)  # [N, V]
            return _sample_picked(logits, chunks, sampling, histories)


@dataclass
class Forward:
    """One forward's result: its inputs, the layers' output (h, residual) [T, d] each, and
    the logits [N, V] where a decode graph computed them (None: the finish computes them).
    `from_graph`: the tensors are a graph's static outputs, overwritten by its next replay."""

    inputs: ForwardInputs
    h: torch.Tensor
    residual: torch.Tensor
    logits: torch.Tensor | None = None
    from_graph: bool = False


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's copy in fresh pinned host memory, queued on the stream (the host does
    not wait); torch's pinned-memory cache reuses the buffer only once the copy is done. On the
    host: a copy, so that nothing the stage writes later can reach it."""
    if tensor.device.type != "cuda":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _sample_picked(
    logits: torch.Tensor,
    chunks: list[SeqChunk],
    sampling: Sequence[SamplingParams | None] | None,
    histories: Sequence[History | None] | None,
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


def _every_row_plain_greedy(
    chunks: list[SeqChunk], sampling: Sequence[SamplingParams | None] | None
) -> bool:
    """Every chunk samples, and plain greedy (a decode batch of plain greedy requests)."""
    if not all(chunk.sample for chunk in chunks):
        return False
    return sampling is None or all(p is None or _plain_greedy(p) for p in sampling)


def _plain_greedy(params: SamplingParams) -> bool:
    """Argmax of the raw logits and nothing else: no penalty or bias to apply, no logprob to
    report."""
    return params.is_greedy and not params.changes_logits and not params.logprobs
