"""The baseline a user would otherwise pick: Hugging Face `generate` on static batches.

Requests are served in order, `batch_size` at a time (the same concurrency the ring gets); a
batch starts when the previous one ends, as a closed loop's next request is sent when a place
frees. A batch is left-padded to its longest prompt and decodes until its longest request is
done; each request counts only its own `max_new_tokens`, and its tokens are timed as they are
produced (a logits processor stamps every decoding step). TTFT and end-to-end latency count
from the batch's start, as the ring's closed loop counts from a request's send; output tokens/s
counts the whole run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.workload import Request, Workload


class HFGenerate:
    """The model loaded once; `run` serves a workload in static batches of `batch_size`.

    `compiled`: what the transformers docs advise for fast `generate`: a static KV cache and
    the forward under `torch.compile(mode="reduce-overhead", fullgraph=False)` (CUDA graphs on a
    GPU). Done transformers 5's way: given a static cache and a `CompileConfig`, `generate`
    compiles the decoding steps itself and leaves the prefill eager. Compiling `model.forward`
    by hand, as older docs show, would compile the prefill too, once per prompt length, and on
    a GPU run under `generate`'s own compiled call. The cache is sized once for the longest
    sequence of the run, so every batch of the same size decodes in the same shapes.

    A compiled forward compiles (and records its CUDA graphs) at every new shape it meets: the
    first batch of each size, and the prefill-to-decode switch. Timed cold, `run` would measure
    compilation, minutes on an 8B model, not serving; so compiled, `run` first serves the same
    batches once untimed (same padding, same `max_new_tokens`, so the same shapes), then times a
    second pass, as a server warmed up before its first user would be.
    """

    def __init__(
        self,
        model_dir: Path,
        threads: int,
        dtype: str = "float32",
        device: str = "cpu",
        compiled: bool = False,
    ) -> None:
        import torch

        from launch.prepare_model import load_hf_model

        torch.set_num_threads(threads)
        # On an accelerator, load straight onto it (an 8B model would cost 16 GB of host
        # memory and a second copy otherwise).
        placement = {} if device == "cpu" else {"device_map": device}
        model = load_hf_model(model_dir, dtype=getattr(torch, dtype), **placement)
        self.model = model.eval()  # already on `device`: loaded there
        self.device = device
        self.compiled = compiled
        pad_id = model.generation_config.pad_token_id
        if pad_id is None:
            eos = model.generation_config.eos_token_id
            pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
        self.pad_id = pad_id

    def run(
        self,
        workload: Workload,
        batch_size: int,
        on_tokens: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """Per-request timings and the run's output tokens/s, as `bench.serve` records them.
        Compiled, the batches are served once untimed first (see the class docstring); only
        the timed pass reports to `on_tokens`."""
        requests = workload.requests
        batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
        options = self._compile_options(batches) if self.compiled else {}
        if self.compiled:
            for batch in batches:
                self._generate(batch, options, on_tokens=None)
        records: list[dict[str, Any]] = []
        start = time.perf_counter()
        for batch in batches:
            records += self._generate(batch, options, on_tokens)
        return {"records": records, "elapsed_s": time.perf_counter() - start}

    def _compile_options(self, batches: list[Sequence[Request]]) -> dict[str, Any]:
        """`generate` kwargs for a static cache and a compiled decoding step."""
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=False, mode="reduce-overhead")
        # `generate` compiles by itself only on an accelerator; transformers' flag for
        # compiling elsewhere lets the CPU (tests, the dry run) take the GPU's path.
        compile_config._compile_all_devices = True
        # One cache length for the whole run (prompt padded to its batch's longest, plus that
        # batch's steps): a batch's cache never differs in shape from the warm-up's.
        longest = max(
            max(len(r.input_ids) for r in b) + max(r.max_new_tokens for r in b) for b in batches
        )
        return {
            "cache_implementation": "static",
            "max_cache_len": longest,
            "compile_config": compile_config,
        }

    def _generate(
        self,
        batch: Sequence[Request],
        options: dict[str, Any],
        on_tokens: Callable[[int], None] | None,
    ) -> list[dict[str, Any]]:
        """One static batch through `generate`; its requests' records, timed from its start."""
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        class StepTimer(LogitsProcessor):
            """Called once per decoding step, right after the forward that produced the step."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.times.append(time.perf_counter())
                if on_tokens is not None:
                    on_tokens(int(scores.shape[0]))
                return scores

        batch_start = time.perf_counter()
        longest = max(len(r.input_ids) for r in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)  # [B, longest]
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[row, longest - len(r.input_ids) :] = torch.tensor(r.input_ids)
            mask[row, longest - len(r.input_ids) :] = 1
        steps = max(r.max_new_tokens for r in batch)
        timer = StepTimer()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=steps,
                min_new_tokens=steps,  # like ignore_eos: the same work as the ring does
                do_sample=False,
                pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList([timer]),
                **options,
            )
        records = []
        for r in batch:
            first_token = timer.times[0] - batch_start
            last_token = timer.times[r.max_new_tokens - 1] - batch_start
            n = r.max_new_tokens
            records.append(
                {
                    "prompt_tokens": len(r.input_ids),
                    "output_tokens": n,
                    "ttft_s": first_token,
                    "tpot_s": (last_token - first_token) / (n - 1) if n > 1 else None,
                    "e2e_s": last_token,
                }
            )
        return records
