"""HF generate as the bench's baseline (bench/hf_baseline.py): the compiled variant serves the
same requests with a static cache, warmed up so that its timed pass compiles nothing."""

from __future__ import annotations

import pytest

from bench.hf_baseline import HFGenerate
from bench.workload import make_workload
from tests.tiny_llama import make_tiny_llama

# Prompt ids are drawn from [256, vocab): the tiny Llama needs a vocabulary past 256.
VOCAB = 512


def tiny_workload(num_requests: int = 5):
    return make_workload(
        num_requests, seed=0, vocab_size=VOCAB, prompt_tokens=(4, 20), output_tokens=(2, 6)
    )


def test_compiled_generate_sizes_one_static_cache_for_the_whole_run(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny", num_layers=2, vocab=VOCAB)
    requests = tiny_workload().requests
    batches = [requests[:2], requests[2:4], requests[4:]]
    options = HFGenerate(model, threads=1, compiled=True)._compile_options(batches)
    longest = max(
        max(len(r.input_ids) for r in b) + max(r.max_new_tokens for r in b) for b in batches
    )
    assert options["cache_implementation"] == "static" and options["max_cache_len"] == longest
    assert options["compile_config"].mode == "reduce-overhead"
    assert options["compile_config"].fullgraph is False


@pytest.mark.long  # compiling the tiny model's decode step takes ~40 s on a 2-core CPU
@pytest.mark.timeout(300)
def test_compiled_generate_serves_the_same_tokens_and_compiles_only_while_warming_up(tmp_path):
    from torch._dynamo.utils import counters

    model = make_tiny_llama(tmp_path / "tiny", num_layers=2, vocab=VOCAB)
    workload = tiny_workload()
    batches = [workload.requests[i : i + 2] for i in (0, 2, 4)]
    eager = HFGenerate(model, threads=1).run(workload, batch_size=2)
    compiled = HFGenerate(model, threads=1, compiled=True)
    generate = compiled._generate
    graphs_after: list[tuple[bool, int]] = []  # per batch served: (timed, graphs compiled)

    def counting(batch, options, on_tokens):
        records = generate(batch, options, on_tokens)
        graphs_after.append((on_tokens is not None, counters["stats"]["unique_graphs"]))
        return records

    compiled._generate = counting
    graphs_before = counters["stats"]["unique_graphs"]
    reported: list[int] = []
    run = compiled.run(workload, batch_size=2, on_tokens=reported.append)

    def counts(records):
        return [(r["prompt_tokens"], r["output_tokens"]) for r in records]

    assert counts(run["records"]) == counts(eager["records"])
    assert run["elapsed_s"] > 0 and all(r["e2e_s"] > 0 for r in run["records"])
    warm_up = [graphs for timed, graphs in graphs_after if not timed]
    timed = [graphs for timed, graphs in graphs_after if timed]
    assert len(warm_up) == len(timed) == len(batches)  # the same batches, twice
    assert warm_up[-1] > graphs_before  # it did compile
    assert set(timed) == {warm_up[-1]}  # but not while timed
    # Only the timed pass reports progress: a row per request of a batch, per decoding step.
    rows = sum(len(b) * max(r.max_new_tokens for r in b) for b in batches)
    assert sum(reported) == rows
