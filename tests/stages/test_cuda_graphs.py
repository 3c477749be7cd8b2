"""The bookkeeping of decode graphs (backend/cuda/graphs.py), checked on a CPU: which sizes are
captured, which size a batch replays, how a batch is padded into the static buffers, and that
decode steps run through those buffers give the tokens of eager steps. `EagerRecorder` stands in
for CUDA graph capture (the same static inputs and outputs, no graph); on the GPU machine
tests/stages/test_cuda.py checks real graphs against eager steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.backend.cpu import native
from stages.backend.cuda.graphs import EagerRecorder, StaticDecodeInputs, capture_sizes, size_for
from stages.batch import BLOCK_SIZE, SeqChunk
from tests.stages.conftest import Chain, decode_logits, hf_logits
from tests.stages.test_parity import random_seqs

needs_kernels = pytest.mark.skipif(
    native.kernels() is None, reason="the graph path on a CPU reads the cache with the kernels"
)


def test_capture_sizes_are_powers_of_two_then_multiples_of_16_and_the_largest() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError, match=">= 1"):
        capture_sizes(0)


@pytest.mark.parametrize(
    ("num_seqs", "size"), [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (17, 32), (33, 40), (41, None)]
)
def test_a_batch_replays_the_smallest_size_that_holds_it(num_seqs: int, size: int | None) -> None:
    assert size_for(num_seqs, capture_sizes(40)) == size


def _decode(token: int, start_pos: int, blocks: list[int]) -> SeqChunk:
    return SeqChunk([token], start_pos, blocks, sample=True)


def test_fill_pads_rows_to_the_scratch_block_and_leaves_unread_columns() -> None:
    buffers = StaticDecodeInputs(
        8, max_blocks=4, pad_block=9, hidden_size=3, dtype=torch.float32, device=torch.device("cpu")
    )
    # A wide step first, so the narrower one below leaves its old columns behind.
    wide = [_decode(5, 50, [1, 2, 3, 4])]
    buffers.fill(wide, 1, torch.ones(1, 3), torch.ones(1, 3))
    chunks = [_decode(7, 17, [6, 3]), _decode(8, 0, [2])]
    hidden = torch.arange(6.0).view(2, 3)
    buffers.fill(chunks, 4, hidden, -hidden)
    inputs = buffers.inputs(4)
    assert inputs.input_ids.tolist() == [7, 8, 0, 0]
    assert inputs.positions.tolist() == [17, 0, 0, 0]
    pad_slot = 9 * BLOCK_SIZE
    assert inputs.slot_mapping.tolist() == [3 * BLOCK_SIZE + 1, 2 * BLOCK_SIZE, pad_slot, pad_slot]
    assert inputs.paged is not None
    assert inputs.paged.ctx_len.tolist() == [18, 1, 1, 1]
    # Only as wide as the longest context (2 blocks): row 0's columns 2-3 are the wide step's,
    # the rest the pad block they were made with.
    assert inputs.paged.block_table.tolist() == [
        [6, 3, 3, 4],
        [2, 9, 9, 9],
        [9, 9, 9, 9],
        [9, 9, 9, 9],
    ]
    assert inputs.paged.max_q_len == 1
    assert buffers.hidden_states is not None and buffers.residual is not None
    assert torch.equal(buffers.hidden_states[:2], hidden)
    assert torch.equal(buffers.residual[:2], -hidden)


def test_only_decodes_whose_context_fits_the_table_replay() -> None:
    buffers = StaticDecodeInputs(
        4,
        max_blocks=2,
        pad_block=9,
        hidden_size=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert buffers.fits([_decode(1, 31, [0, 1])])
    assert not buffers.fits([_decode(1, 32, [0, 1, 2])])  # needs a third block
    assert not buffers.fits([SeqChunk([1, 2], 0, [0], sample=True)])  # a prefill chunk
    assert not buffers.fits([SeqChunk([1], 3, [0], sample=False)])  # a token that samples not


def test_a_first_stage_without_a_seam_buffer_refuses_one_and_a_later_stage_needs_one() -> None:
    later = StaticDecodeInputs(
        2, max_blocks=2, pad_block=9, hidden_size=3, dtype=torch.float32, device=torch.device("cpu")
    )
    with pytest.raises(ValueError, match="seam"):
        later.fill([_decode(1, 0, [0])], 1, None, None)


def serve_greedy(chain: Chain, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    """Greedy generation where requests end at different steps, so the decode batch shrinks
    through sizes that hit and miss the captured ones; one request joins late, so a step mixes
    its prefill with the others' decodes."""
    tables: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = {
        i: SeqChunk(p, 0, chain.blocks.grow(tables[i], len(p)), True)
        for i, p in enumerate(prompts)
        if i
    }
    late = 0
    for step in range(max(new_tokens) + 2):
        if step == 2:  # request 0 arrives now: a prefill among decodes
            pending[late] = SeqChunk(
                prompts[late], 0, chain.blocks.grow(tables[late], len(prompts[late])), True
            )
        if not pending:
            break
        owners = sorted(pending)
        tokens = chain.sample([pending[i] for i in owners]).token_ids
        for i, token in zip(owners, tokens):
            chunk = pending.pop(i)
            outputs[i].append(token)
            if len(outputs[i]) < new_tokens[i]:
                pending[i] = SeqChunk(
                    [token], chunk.seq_len, chain.blocks.grow(tables[i], chunk.seq_len + 1), True
                )
    return outputs


@needs_kernels
@pytest.mark.parametrize(
    ("model", "partition"), [("gqa", [4]), ("tied", [2, 2]), ("mqa", [1, 2, 1])]
)
def test_decode_steps_through_the_static_buffers_equal_eager_steps(
    tiny_dirs: dict[str, Path], model: str, partition: list[int]
) -> None:
    prompts = random_seqs([5, 23, 9, 40, 17, 12, 30], seed=11)
    new_tokens = [6, 20, 3, 12, 9, 1, 16]  # batches of 7, 6, 5, 4, 3, 2 and 1 decodes
    eager = Chain(tiny_dirs[model], partition)
    graphs = Chain(
        tiny_dirs[model],
        partition,
        cuda_graph_max_bs=4,
        graph_recorder=EagerRecorder(),
        # Unwritten slots read as NaN, and blocks go out from 0 up, so padding that wrote
        # anywhere but its scratch block would overwrite a live sequence's KV.
        poison=True,
        scattered=False,
    )
    expected = serve_greedy(eager, prompts, new_tokens)
    assert serve_greedy(graphs, prompts, new_tokens) == expected
    for stage in graphs.stages:
        assert stage.graphs is not None and stage.graphs.sizes == [1, 2, 4]
        assert stage.graphs.replays > 0  # 3 rows padded to 4, 2 and 1 as they are


@needs_kernels
def test_graph_decode_logits_are_transformers_logits(tiny_dirs: dict[str, Path]) -> None:
    """The last stage's logits out of its graph (`forward_logits(graphs=True)`), teacher-forced
    as the batch shrinks 7 -> 1, against transformers; each a copy that later replays leave."""
    folder = tiny_dirs["gqa"]
    prompt_lens = [5, 23, 9, 40, 17, 12, 30]
    seqs = random_seqs([p + n for p, n in zip(prompt_lens, [6, 20, 3, 12, 9, 1, 16])], seed=11)
    chain = Chain(folder, [2, 2], cuda_graph_max_bs=4, graph_recorder=EagerRecorder())
    got = decode_logits(chain, seqs, prompt_lens, graphs=True)
    assert all(stage.graphs is not None and stage.graphs.replays > 0 for stage in chain.stages)
    for seq, by_pos in zip(seqs, got):
        expected = hf_logits(folder, seq)
        for pos, logits in by_pos.items():
            assert (logits - expected[pos]).abs().max().item() < 1e-5, pos
