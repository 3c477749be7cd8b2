"""`ppring local`: every stage of a ring on this machine, plus the frontend, supervised.

    ppring local [--model DIR] [--pp-size S] [--pp-async-batch-depth D] [--port P] ...

Starts S stage processes (`python -m launch.stage`), runs the frontend in this process, prints
a start-up summary and one line `ready: tcp://HOST:PORT` once the ring has agreed its KV
capacity. If a stage dies, every request in flight gets `error` (ring_down), the other stages
are stopped and this command exits 1. SIGINT/SIGTERM shut the ring down gracefully: exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.flags import add_flags, cuda_graph_max_bs, flag_argv, ring_config, stage_threads
from launch.procs import ProcessGroup
from protocol.curve import NodeKeys
from ring.config import RingConfig
from ring.topology import DEFAULT_HTTP_PORT, DEFAULT_PORT, RingAddresses
from stages.batch import BLOCK_SIZE

# The API key for --api-key, from the environment (a command line shows in `ps`).
API_KEY_ENV = "PPRING_API_KEY"

logger = logging.getLogger("ppring")

SUPERVISE_INTERVAL_S = 0.5
READY_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 30.0


def say(text: str) -> None:
    """Print a status line to stdout. A reader that went away (a closed pipe) is not the
    launcher's problem: it keeps serving and shuts down on SIGTERM as before, and stdout goes
    to /dev/null from then on (so the exit's own flush cannot fail either)."""
    try:
        print(text, flush=True)
    except OSError:  # BrokenPipeError and the like
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ppring local", description=__doc__.split("\n\n")[0])
    add_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="where clients connect")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the frontend's port")
    parser.add_argument("--log-dir", type=Path, default=None, help="stage logs (default stderr)")
    add_http_args(parser)
    add_restart_args(parser)
    args = parser.parse_args(argv)
    if args.threads_per_stage is None and args.device == "cpu":
        # Stages share this machine's cores; OpenMP pools that oversubscribe slow every op.
        # (A GPU stage's own rule is launch.flags.stage_threads.)
        args.threads_per_stage = max(1, (os.cpu_count() or 1) // args.pp_size)
    return args


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible HTTP server on node 0 (launch/openai_api.py), as vLLM's flags."""
    parser.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT, help="the OpenAI API's port; 0: off"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: the "
        "model folder's name)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key",
        type=api_key,
        default=os.environ.get(API_KEY_ENV),
        help="the API's routes but /health and /metrics need `Authorization: Bearer KEY` "
        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list; none: open)",
    )


def api_key(value: str) -> str:
    """--api-key's check: an empty key would leave the API open unnoticed, and a header holds
    printable ASCII only (a key the client can send at all)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"the API key is empty (--api-key or ${API_KEY_ENV})")
    if not (value.isascii() and value.isprintable()) or value != value.strip():
        raise argparse.ArgumentTypeError(
            "the API key must be printable ASCII without surrounding spaces"
        )
    return value


def add_restart_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-stage-restarts",
        type=_at_least_zero,
        default=3,
        help="re-form the ring this many times after a stage dies, replaying the requests in "
        "flight (0: a dead stage fails every request, as vLLM and SGLang do)",
    )
    parser.add_argument(
        "--stage-restart-window", type=float, default=600.0, help="seconds the limit counts over"
    )


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return value


def stage_argv(
    args: argparse.Namespace,
    rank: int,
    model_dir: Path,
    ring_hosts: list[str] | None = None,
    epoch: int = 0,
) -> list[str]:
    argv = [
        sys.executable, "-m", "launch.stage", "--rank", str(rank),
        "--host", args.host, "--port", str(args.port), "--transport", "tcp",
        "--ring-epoch", str(epoch), *flag_argv(args, model=model_dir),
    ]  # fmt: skip
    if ring_hosts:
        argv += ["--ring-hosts", ",".join(ring_hosts)]
    return argv


def load_keys(args: argparse.Namespace, ranks: range) -> NodeKeys | None:
    """Node `ranks[0]`'s CURVE keys from --curve-dir, or None without it. Every rank in `ranks`
    runs here (ppring local: all of them), so each one's keys are checked now, before any stage
    starts. Raises CurveError naming what is missing."""
    if not args.curve_dir:
        return None
    keys = [NodeKeys.load(args.curve_dir, rank, args.pp_size) for rank in ranks]
    return keys[0]


@dataclass(frozen=True)
class Startup:
    """What start-up reads from the model folder, once: the lines to print (model, layer
    split, slots), the context length, the config and the layer split."""

    lines: list[str]
    context_length: int
    config: Any  # stages.config.ModelConfig, imported lazily
    partition: list[int]


def summary(args: argparse.Namespace, model_dir: Path) -> Startup:
    from stages.config import ModelConfig
    from stages.partition import PARTITION_ENV, StageCosts, partition_for_model

    config = ModelConfig.from_path(model_dir)
    cfg = ring_config(args, rank=0)
    split = partition_for_model(config, args.pp_size, args.partition_rule, cfg.split_lm_head)
    context = (
        args.sim_context_length if args.stage_impl == "sim" else config.max_position_embeddings
    )
    costs = StageCosts.for_model(config, split_lm_head=cfg.split_lm_head)
    shares = ", ".join(f"{100 * x:.0f}%" for x in costs.shares(split))
    how = PARTITION_ENV if os.environ.get(PARTITION_ENV) else f"rule {args.partition_rule}"
    if cfg.split_lm_head:
        how += "; lm_head split between the first and the last stage, the first samples"
    lines = [
        f"model: {model_dir} ({config.num_layers} layers, d={config.hidden_size}), "
        f"on {args.device}, stage impl {args.stage_impl}",
        *compute_lines(args, config),
        f"layers per stage: {split} ({how}; estimated share of a decode step: {shares})",
        f"slots: {cfg.pp_loop_size} (pp_size {cfg.pp_size} + async depth "
        f"{cfg.pp_async_batch_depth}); requests per micro-batch <= {cfg.micro_batch_cap}, "
        f"running <= {cfg.max_running_requests}; {stage_threads(args)} threads per stage",
        prefix_cache_line(cfg),
    ]
    if args.device.startswith("cuda"):
        max_bs = cuda_graph_max_bs(args, cfg)
        lines.append(
            f"CUDA graphs: decode batches of up to {max_bs} sequences"
            if max_bs
            else "CUDA graphs: off"
        )
    return Startup(lines, context, config, split)


def prefix_cache_line(cfg: RingConfig) -> str:
    if cfg.disable_radix_cache:
        return "prefix cache: off (--disable-radix-cache): every prompt is computed whole"
    return (
        "prefix cache: on, in 16-token blocks on every stage alike: a prompt prefills only "
        "what earlier requests did not leave in the KV cache (--disable-radix-cache: off)"
    )


def compute_lines(args: argparse.Namespace, config: Any) -> list[str]:
    """What the stages will compute in and why: the dtype (`auto` resolved for this machine),
    the quantization, and the CPU kernels. Raises ConfigError for a choice the device cannot
    run, so a bad flag is one sentence here, not a crash in a stage."""
    if args.stage_impl == "sim":
        return []
    import torch

    from stages.backend.cpu import native
    from stages.backend.cpu.linear import check_quantization
    from stages.dtype import resolve_dtype
    from stages.gguf_file import formats_line, is_gguf

    choice = resolve_dtype(args.dtype, args.device, config.torch_dtype)
    device = torch.device(args.device)
    kernels, reason = native.kernels_for(device, choice.dtype)
    check_quantization(args.quantization, device, kernels, reason)
    lines = [f"dtype: {choice.name} ({choice.reason})"]
    if choice.warning:
        lines.append(f"warning: {choice.warning}")
    if args.quantization == "int8":
        lines.append("weights: int8, one scale per output channel (--quantization int8)")
    if is_gguf(args.model or ""):
        lines.append(formats_line(Path(args.model).expanduser(), choice.name))
    lines.append(kv_cache_line(args.kv_cache_dtype, choice, device, config))
    if device.type == "cpu":
        lines.append(f"CPU kernels: {reason}" if kernels else f"CPU kernels: off ({reason})")
        grid_line = grid_weights_line(choice.dtype, args.quantization, kernels)
        if grid_line:
            lines.append(grid_line)
        tiles_line = amx_tiles_line(choice.dtype, kernels)
        if tiles_line:
            lines.append(tiles_line)
    return lines


def kv_cache_line(requested: str, choice: Any, device: Any, config: Any) -> str:
    """What every stage's KV cache stores for --kv-cache-dtype and its bytes a token and layer
    (ConfigError for a choice the stages cannot store)."""
    from stages.kv_cache import kv_bytes_per_token, resolve_kv_cache_dtype

    kv_cache = resolve_kv_cache_dtype(requested, choice.dtype, device)
    own = kv_bytes_per_token(config, 1, choice.dtype)
    if kv_cache == "auto":
        return f"KV cache: {choice.name}, {own:.0f} bytes a token and layer"
    eight = kv_bytes_per_token(config, 1, choice.dtype, kv_cache)
    return (
        f"KV cache: int8 (--kv-cache-dtype int8), K scaled per 16-token page and channel, V per "
        f"token: {eight:.1f} bytes a token and layer against {choice.name}'s {own:.0f} "
        f"({own / eight:.2f}x the tokens in the same --kv-memory-gib)"
    )


def amx_tiles_line(dtype: Any, kernels: Any) -> str | None:
    """Where a bf16 stage on a CPU with AMX multiplies on its tiles (stages/backend/cpu/
    amx_choice.py, prefill_attention.py), as PPRING_AMX_ROWS says (a bad value is one error
    here); None where the CPU has no AMX or the stage does not compute in bf16."""
    import torch

    from stages.backend.cpu.prefill_attention import PREFILL_ROWS
    from stages.backend.switches import AMX_ROWS_ENV, amx_rows

    if dtype != torch.bfloat16 or kernels is None or not kernels.amx_bf16:
        return None
    setting = amx_rows()
    if setting == "0":
        return f"AMX tiles: off ({AMX_ROWS_ENV}=0: every row's result independent of its batch)"
    rows = (
        "from the row count measured per matrix on this machine (each stage's log names it)"
        if setting == "auto"
        else f"from {setting} rows ({AMX_ROWS_ENV})"
    )
    return (
        f"AMX tiles: bf16 matmuls {rows}, prefill chunks of {PREFILL_ROWS}+ rows' attention; "
        f"{AMX_ROWS_ENV}=0 keeps every row's result independent of its batch"
    )


def grid_weights_line(dtype: Any, quantization: str, kernels: Any) -> str | None:
    """How a CPU stage will multiply weights that lie on a GGUF grid (backend/cpu/grid.py), where
    that changes its numbers: a bf16 stage multiplies their codes by int8-quantized rows unless
    PPRING_GRID_ACTIVATIONS=bf16 (a bad value is one error here). None where it does not apply:
    wherever a stage does not load fp32 weights to look for the grid (`source_dtype`)."""
    import torch

    from stages.backend.cpu.linear import GRID_ACTIVATIONS_ENV, bf16_grid_way, source_dtype

    if dtype != torch.bfloat16 or source_dtype(dtype, quantization, kernels) == dtype:
        return None
    way = bf16_grid_way(kernels)
    if way == "int8x2":
        return (
            "GGUF-grid weights: held as codes, multiplied by activations quantized to int8 per "
            f"32 in two passes (bf16's accuracy; {GRID_ACTIVATIONS_ENV}=int8 for one pass, as "
            "llama.cpp does, or bf16 for exact bf16 products)"
        )
    if way == "int8":
        return (
            "GGUF-grid weights: held as codes, multiplied by int8-quantized activations (per "
            f"32, one pass, as llama.cpp does; {GRID_ACTIVATIONS_ENV}=int8x2 for bf16's accuracy)"
        )
    return "GGUF-grid weights: held as codes, decoded to exactly their bf16 values"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from launch.prepare_model import PrepareModelError, resolve_model

    try:
        model_dir = resolve_model(args.model)
        startup = summary(args, model_dir)
        keys = load_keys(args, range(args.pp_size))
    except (PrepareModelError, ValueError) as exc:  # ConfigError, CurveError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in startup.lines:
        say(line)
    addrs = RingAddresses(args.pp_size, hosts=(args.host,), base_port=args.port)
    group = ProcessGroup()
    restarter = Restarter(args, model_dir, group)
    try:
        restarter.start_stages(epoch=0)
        return run_frontend(args, addrs, model_dir, startup.context_length, group, keys, restarter)
    except OSError as exc:  # e.g. the port is taken
        print(f"error: {exc}; pick another --port", file=sys.stderr)
        return 2
    finally:
        group.stop()


@dataclass
class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds (--max-stage-restarts,
    --stage-restart-window)."""

    limit: int
    window_s: float
    times: list[float] = field(default_factory=list)

    def allows(self, now: float) -> bool:
        self.times = [t for t in self.times if now - t < self.window_s]
        return len(self.times) < self.limit

    def used(self, now: float) -> None:
        self.times.append(now)

    def give_up_reason(self) -> str:
        if self.limit == 0:
            return "restarts are off (--max-stage-restarts 0)"
        n = len(self.times)
        return (
            f"the ring was re-formed {n} time{'s' if n != 1 else ''} within "
            f"{self.window_s:.0f} s (--max-stage-restarts {self.limit}); not again"
        )


class StageRestarter(ABC):
    """What the frontend's supervision asks of a launcher whose stages can be started again as
    a new ring epoch, while --max-stage-restarts within --stage-restart-window allow: `ppring
    local`'s `Restarter` (every stage) and `ppring serve`'s `NodeRestarter` (this node's)."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, group: ProcessGroup) -> None:
        self.args, self.model_dir, self.group = args, model_dir, group
        self.budget = RestartBudget(args.max_stage_restarts, args.stage_restart_window)
        self.epoch = 0

    def can_restart(self, now: float) -> bool:
        return self.budget.allows(now)

    def give_up_reason(self) -> str:
        return self.budget.give_up_reason()

    def stop_stages(self, now: float) -> None:
        """Count a restart and stop what is left of this launcher's stages."""
        self.budget.used(now)
        self.group.stop(grace_s=3.0)
        self.group.procs.clear()

    @abstractmethod
    async def restart(self, now: float) -> int:
        """Stop the stages, start them again as the next ring epoch; returns it."""


class Restarter(StageRestarter):
    """`ppring local`'s stages, started again as a new ring epoch when one dies or the ring
    reports a failure, while the budget allows; then the ring fails as it would without
    restarts. Every stage is started again (same ranks, same layers): the survivors' KV caches
    and schedulers held the lost ring's state, and new processes start from nothing, so no
    stale state or message survives; the frontend replays the requests in flight
    (launch/frontend.py)."""

    def start_stages(self, epoch: int) -> None:
        """Every stage, from this (the main) thread: a stage dies with the thread that
        started it (launch/stage.py)."""
        self.epoch = epoch
        for rank in range(self.args.pp_size):
            log = self.args.log_dir / f"stage{rank}.log" if self.args.log_dir else None
            if log:
                self.args.log_dir.mkdir(parents=True, exist_ok=True)
            argv = stage_argv(self.args, rank, self.model_dir, epoch=epoch)
            self.group.start(argv, log, inherit=log is None)

    async def restart(self, now: float) -> int:
        """Stop what is left of the ring, start it again as the next epoch; returns it."""
        self.stop_stages(now)
        self.start_stages(self.epoch + 1)
        return self.epoch


def run_frontend(
    args: argparse.Namespace,
    addrs: RingAddresses,
    model_dir: Path,
    context_length: int,
    group: ProcessGroup,
    keys: NodeKeys | None = None,
    restarter: StageRestarter | None = None,
) -> int:
    """Node 0's frontend (and HTTP API) until the ring shuts down or fails. `restarter`
    (`Restarter`, or `ppring serve`'s `NodeRestarter`) re-forms a failed ring; None: a failure
    fails every request."""
    from launch.prepare_model import load_tokenizer, served_name

    tokenizer = load_tokenizer(model_dir)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        pass
    model_name = args.served_model_name or served_name(model_dir)
    return asyncio.run(
        _serve(args, addrs, tokenizer, context_length, model_name, group, keys, restarter)
    )


def _open_frontend(
    args: argparse.Namespace,
    addrs: RingAddresses,
    tokenizer: Any,
    context_length: int,
    model_name: str,
    keys: NodeKeys | None,
) -> tuple[Any, Any]:
    """The ZeroMQ frontend and, unless --http-port 0, the OpenAI API sharing it (not started).
    Raises OSError when the HTTP port cannot be bound."""
    from launch.frontend import Frontend

    metrics = None
    if args.http_port:
        from launch.metrics import FrontendMetrics

        metrics = FrontendMetrics(model_name)
    frontend = Frontend(
        tokenizer,
        client_addr=addrs.frontend(),
        intake_addr=addrs.intake(),
        deltas_addr=addrs.deltas(),
        context_length=context_length,
        metrics=metrics,
        security=keys and keys.clients_server(),
    )
    if not args.http_port:
        return frontend, None
    from launch.openai_api import HttpServer, build_app

    try:
        return frontend, HttpServer(
            build_app(frontend, model_name, metrics, args.api_key), args.host, args.http_port
        )
    except OSError:
        frontend.close()
        raise


async def _serve(
    args: argparse.Namespace,
    addrs: RingAddresses,
    tokenizer: Any,
    context_length: int,
    model_name: str,
    group: ProcessGroup,
    keys: NodeKeys | None,
    restarter: StageRestarter | None,
) -> int:
    try:
        frontend, http = _open_frontend(args, addrs, tokenizer, context_length, model_name, keys)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if http is not None:
        http.start()
    loop = asyncio.get_running_loop()
    stopping = False

    stopping_since = 0.0

    def on_signal() -> None:
        nonlocal stopping, stopping_since
        if not stopping:
            stopping, stopping_since = True, time.monotonic()
            frontend.request_shutdown()  # first: nothing below may stop it
            say("shutting down")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    serve = asyncio.create_task(frontend.serve())
    started = time.monotonic()
    announced = False
    exit_code = 0
    try:
        while not frontend.stopped.is_set():
            if frontend.ring_ready.is_set() and not announced:
                blocks = frontend.num_kv_blocks
                say(f"KV blocks agreed: {blocks} ({blocks * BLOCK_SIZE} tokens)")
                if http is not None:
                    say(f"OpenAI API: {http.url}/v1 (model {model_name!r})")
                say(f"ready: {frontend.addr}")
                announced = True
            elif not announced and time.monotonic() - started > READY_TIMEOUT_S:
                frontend.ring_down("the ring was not ready in time")
                exit_code = 1
                break
            now = time.monotonic()
            if restarter is not None:
                frontend.restartable = restarter.can_restart(now)
            dead = group.poll_dead()
            failure = frontend.ring_failure
            if dead:
                rank = group.procs.index(dead[0])
                failure = f"stage {rank} exited with code {dead[0].returncode}"
            if failure and not stopping:
                if restarter is not None and restarter.can_restart(now):
                    frontend.reform(failure)
                    frontend.epoch = await restarter.restart(now)
                    continue
                if restarter is not None:
                    failure += f"; {restarter.give_up_reason()}"
                frontend.ring_down(failure)
                exit_code = 1
                break
            if stopping and len(dead) == len(group.procs):
                break  # every stage has exited: nothing more will come
            if stopping and time.monotonic() - stopping_since > SHUTDOWN_TIMEOUT_S:
                frontend.ring_down("the ring did not shut down in time")
                exit_code = 1
                break
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
        if frontend.ring_error and not stopping:
            exit_code = 1
        await asyncio.sleep(0.2)  # let the last error/done messages go out
    finally:
        if http is not None:
            await http.stop()
        serve.cancel()
        await asyncio.gather(serve, return_exceptions=True)
        frontend.close()
    if stopping:
        codes = group.wait(timeout_s=30)
        if any(code != 0 for code in codes):
            exit_code = 1
    return exit_code
