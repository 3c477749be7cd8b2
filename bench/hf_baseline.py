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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.workload import Workload


class HFGenerate:
    """The model loaded once; `run` serves a workload in static batches of `batch_size`."""

    def __init__(
        self, model_dir: Path, threads: int, dtype: str = "float32", device: str = "cpu"
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        # On an accelerator, load straight onto it (an 8B model would cost 16 GB of host
        # memory and a second copy otherwise).
        placement = {} if device == "cpu" else {"device_map": device}
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), **placement
        )
        self.model = model.eval()  # already on `device`: loaded there
        self.device = device
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
        """Per-request timings and the run's output tokens/s, as `bench.serve` records them."""
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        model, device, pad_id = self.model, self.device, self.pad_id

        class StepTimer(LogitsProcessor):
            """Called once per decoding step, right after the forward that produced the step."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.times.append(time.perf_counter())
                if on_tokens is not None:
                    on_tokens(int(scores.shape[0]))
                return scores

        requests = workload.requests
        records = []
        start = time.perf_counter()
        for first in range(0, len(requests), batch_size):
            batch_start = time.perf_counter()
            batch = requests[first : first + batch_size]
            longest = max(len(r.input_ids) for r in batch)
            ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, r in enumerate(batch):  # left padding: every prompt ends at the last column
                ids[row, longest - len(r.input_ids) :] = torch.tensor(r.input_ids)
                mask[row, longest - len(r.input_ids) :] = 1
            steps = max(r.max_new_tokens for r in batch)
            timer = StepTimer()
            with torch.inference_mode():
                model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=steps,
                    min_new_tokens=steps,  # like ignore_eos: the same work as the ring does
                    do_sample=False,
                    pad_token_id=pad_id,
                    logits_processor=LogitsProcessorList([timer]),
                )
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
        elapsed = time.perf_counter() - start
        return {"records": records, "elapsed_s": elapsed}
