"""How a stage multiplies by a weight matrix: one module per matrix, its kind chosen once per
stage by device, dtype and quantization, so a layer only calls `proj(x)`.

- `DenseLinear`: torch's F.linear (cuBLAS on a GPU; oneDNN on a CPU in bf16, which uses AMX or
  AVX-512 BF16 where the CPU has them).
- `CpuLinear` (CPU, fp32): the kernels (`csrc/`) over the weight packed once, at load, in panels of
  16 output channels (the only copy held). One kernel for every row count: a panel streams from
  memory once per call and every block of up to six rows reuses it from cache. It replaced two
  paths, a row-major kernel for a few rows and oneDNN's prepacked weights (a second copy of
  every weight) above: over a SmolLM2 step's matmuls on the 2-core EPYC it was 10-45% faster at
  every row count from 1 to 512 (figures in csrc/), and one thread at 16 rows, what a
  PP=2 stage runs at 32 in flight, gained the most.
- `GridLinear` (CPU, fp32): a weight that lies exactly on a GGUF Q4_1 or Q8_0 grid (a
  checkpoint converted from GGUF, as the default model is) held as its codes, each panel decoded
  back into the same fp32 values just before it is multiplied (stages/backend/cpu/grid.py): the same
  results as `CpuLinear`, from 5.3x (Q4_1) or 3.6x (Q8_0) fewer bytes. Over all of SmolLM2's
  matmuls on the 2-core EPYC (medians of 7 alternated rounds): 1 row 27.2 -> 12.6 ms (a
  single row decodes the codes straight into its FMAs), 16 rows 68.7 -> 56.1, 64 rows 139.9
  -> 130.8 and 176.3 -> 150.6, 512 rows 1599 -> 1182.
- `CpuBf16Linear` (CPU, bf16, where the CPU has AVX512_BF16): the weight packed for
  vdpbf16ps and multiplied by the kernels (`csrc/`) at every row count (faster than oneDNN at each
  on a Zen 4/5 EPYC, and a row's result does not depend on what it is batched with). Where the
  CPU has AMX, calls of `amx_rows` rows or more run on its tiles over the same panels
  (csrc/matmul_amx.c; the row count measured once per machine: amx_choice.py): 1.2-B Llama
  shapes, 2 threads, Xeon with AMX, one run, ms, vdpbf16ps / tiles / oneDNN: [16384, 2048] at 16
  rows 6.54 / 2.46 / 5.00, 128 rows 51.0 / 8.95 / 11.3, 512 rows 203 / 34.8 / 30.0. A row's
  result then depends on which side of amx_rows its batch falls (a bf16 rounding apart).
- `GridBf16Linear` (CPU, bf16, AVX512_BF16; `PPRING_GRID_ACTIVATIONS=bf16`, or a CPU without
  VNNI): a weight whose checkpoint values lie on a GGUF grid, held as its codes, decoded pair by
  pair into the same bf16 CpuBf16Linear would hold, and as CpuBf16Linear's panels too: the same
  results either way, so each call reads whichever is faster for its rows (`code_rows`). The
  codes read 0.625 (Q4_1) or 1.06 (Q8_0) bytes a weight instead of 2: all of SmolLM2's matmuls,
  2 threads, on a Zen 4 EPYC (alternated), 1 row 12.6-13.1 -> 6.7-7.4 ms; but decoding costs
  compute where vdpbf16ps is the bound, and from 6 rows (2 threads; 10 on one) the panels are
  faster (32 rows 26.0 ms against 28.3). A bf16 stage loads its matrices in fp32 for the search
  (`source_dtype`).
- `GridA8Linear` (CPU, bf16, AVX512_BF16 and AVX512_VNNI; the default for a weight on a GGUF
  grid): the codes alone, times each row of x quantized to int8 per block of 32, summed in
  integers (csrc/matmul_a8.c ppr_linear_grid_a8), as llama.cpp multiplies Q4_1 and Q8_0, by
  default in two passes over x (the second over what the first missed: bf16's accuracy, at up
  to twice the integer work; `PPRING_GRID_ACTIVATIONS=int8` for one pass). One pass, all of
  SmolLM2's matmuls, 2 threads, Zen 4 EPYC, 9 alternated rounds, medians, ms, against the bf16
  panels: 1 row 3.7 / 8.9, 16 rows 10.3 / 13.1, 32 rows 18.5 / 22.7, 128 rows 62 / 88 (one
  thread, 16 rows, 21.2 / 23.5). Not the panels' results bit for bit (x keeps ~8 bits a block;
  docs/engine.md gives what that does to perplexity), but a row's result depends on that row alone.
- `Int8Linear` (CPU, `--quantization int8`): weights stored as int8 with one fp32 scale per
  output channel (symmetric, max |w| / 127), multiplied by the kernel in integers: a quarter of
  the bytes of fp32, for the single stream, where reading the weights is the whole step. torch's
  own `_weight_int8pack_mm` ran at 1.4 GB/s on that CPU, slower than fp32. Where the kernels
  have AVX-512, each 4 rows are held as blocks of 32 columns (`pack_int8_quads`), so the
  kernel's quad of rows is one run of memory; the same results bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from torch import nn

from stages.backend.cpu import grid
from stages.backend.cpu.amx_choice import amx_rows_for
from stages.backend.cpu.codes import GridCodes, GridPairs, GridQuads
from stages.backend.cpu.grid import quad_rows, rows_of
from stages.backend.cpu.native import PANEL, NativeKernels
from stages.backend.switches import (
    GRID_ACTIVATIONS_ENV,
    Switches,
    grid_activations,
    grid_weights_on,
)
from stages.backend.torch.linear import DenseLinear
from stages.errors import ConfigError
from stages.gguf_matrix import GgufMatrix

QUANTIZATIONS = ("none", "int8")


class CpuBf16Linear(nn.Module):
    """A bf16 weight on a CPU with AVX512_BF16, packed once at load for vdpbf16ps (panels of 16
    output channels, K pairs adjacent; the only copy held) and multiplied by the kernels (`csrc/`)
    at every row count: faster than oneDNN at each one measured (1 row 13.8 -> 7.9 ms over a
    SmolLM2 step's matmuls, 32 rows 22.8 -> 18.4, 512 rows 221 -> 187), and a row's result does
    not depend on the rows batched with it."""

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape  # N, K
        # [ceil(N/16), ceil(K/2), 16, 2]
        self.register_buffer("panels", kernels.pack_bf16(weight.detach()))
        self.amx_rows = 0  # calls of this many rows or more on AMX tiles; 0: never (make_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, K] -> [T, N]; K itself is checked (the panels know only ceil(K / 2))
        amx = 0 < self.amx_rows <= x.shape[0]
        return self.kernels.linear_bf16(x, self.panels, self.out_features, self.in_features, amx)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, [T, K] (a tied lm_head serves the embedding lookup)."""
        return _bf16_rows(self.panels, ids // PANEL, ids % PANEL, self.in_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight [N, K] back from its panels (for tools that compare with F.linear)."""
        return _from_bf16_panels(self.panels, self.out_features, self.in_features)


def _bf16_rows(
    panels: torch.Tensor, panel: torch.Tensor, lane: torch.Tensor, in_features: int
) -> torch.Tensor:
    """Channel `lane` [T] of panels[panel] [T] from bf16 panels [P, ceil(K / 2), 16, 2]
    (pack_bf16's layout): the weight's rows [T, K]."""
    rows = panels[panel, :, lane]  # [T, ceil(K/2), 2]
    return rows.reshape(panel.shape[0], 2 * panels.shape[1])[:, :in_features].contiguous()


def _from_bf16_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """bf16 panels [P, ceil(K / 2), 16, 2] (pack_bf16's layout) -> the weight [N, K]."""
    n_panels, pairs = panels.shape[:2]
    weight = panels.permute(0, 2, 1, 3).reshape(n_panels * PANEL, pairs * 2)
    return weight[:out_features, :in_features].contiguous()


class CpuLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape  # N, K
        self.register_buffer("panels", kernels.pack_f32(weight.detach()))  # [ceil(N/16), K, 16]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear_f32(x, self.panels, self.out_features)  # [T, K] -> [T, N]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, [T, K], gathered from the panels (a tied lm_head serves
        the embedding lookup, so the vocabulary matrix is held once)."""
        return self.panels[ids // PANEL, :, ids % PANEL]

    def dense_weight(self) -> torch.Tensor:
        """The weight [N, K] back from its panels (for tools that compare with F.linear)."""
        return _from_panels(self.panels, self.out_features)


class _HeldAsCodes(nn.Module):
    """A weight held as grid codes (`grid`: GridCodes or GridPairs), multiplied by the kernels;
    the subclasses say which kernel."""

    def __init__(self, grid: GridCodes | GridPairs, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.grid = grid
        self.out_features, self.in_features = grid.out_features, grid.in_features  # N, K
        # the same tensors as buffers too, so that the stage's parameter_bytes counts them
        self.register_buffer("codes", grid.codes)
        self.register_buffer("scale", grid.scale)
        if grid.offset is not None:
            self.register_buffer("offset", grid.offset)


class GridLinear(_HeldAsCodes):
    """An fp32 weight that lies on a GGUF grid (backend/cpu/grid.py), held as its codes: the same
    values as CpuLinear's panels, read in 3.6-5.3x fewer bytes."""

    grid: GridCodes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear_grid(x, self.grid)  # [T, K] -> [T, N]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, [T, K] (a tied lm_head serves the embedding lookup)."""
        return rows_of(self.grid, ids)

    def dense_weight(self) -> torch.Tensor:
        """The weight [N, K] back from its codes (for tools that compare with F.linear)."""
        return _from_panels(self.kernels.unpack_grid(self.grid), self.out_features)


def _from_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """panels [ceil(N / 16), K, 16] (pack_f32's layout) -> the weight [N, K]."""
    k = panels.shape[1]
    return panels.permute(0, 2, 1).reshape(-1, k)[:out_features].contiguous()


def grid_linear(weight: torch.Tensor, kernels: NativeKernels) -> GridLinear | None:
    """GridLinear for `weight` [N, K] if it lies on a grid and the kernel decodes its codes to
    exactly the weight, bit for bit (else None: keep the fp32 panels)."""
    weight = weight.detach()
    found = grid.find_grid(weight, kernels)
    if found is None or not torch.equal(kernels.unpack_grid(found), kernels.pack_f32(weight)):
        return None
    return GridLinear(found, kernels)


# Rows up to which GridBf16Linear reads its codes; above, its bf16 panels (the same results).
# The codes cost decoding, eight vector operations per 32 weights, whatever the rows; the
# panels cost 2 bytes a weight from memory. Crossovers over a stage's matmuls on the 2-core Zen 4
# EPYC (alternated, medians, ms, codes / panels): one thread, half of SmolLM2 (a PP=2 stage),
# 8 rows 8.56 / 9.65, 10 rows 10.84 / 10.84, 12 rows 13.06 / 11.82, 16 rows 15.5 / 13.8; two
# threads, all of it, 4 rows 7.79 / 8.97, 6 rows 9.31 / 8.35, 32 rows 28.3 / 26.0 (1 row 5.4 /
# 11.1). More threads stream the panels faster, so the crossover comes sooner.
CODE_ROWS_ENV = "PPRING_CODE_ROWS"  # a number: overrides code_rows_for
CODE_ROWS_ONE_THREAD, CODE_ROWS_MORE_THREADS = 9, 5


def code_rows_for(threads: int) -> int:
    """The most rows for which a matrix held both ways reads its codes, on `threads` threads."""
    override = os.environ.get(CODE_ROWS_ENV)
    if override is None:
        return CODE_ROWS_ONE_THREAD if threads <= 1 else CODE_ROWS_MORE_THREADS
    if not override.strip().isdigit():
        raise ConfigError(
            f"{CODE_ROWS_ENV}={override!r} is not a row count; give a whole number >= 0 "
            "(0: the bf16 panels for every call)"
        )
    return int(override)


class GridBf16Linear(_HeldAsCodes):
    """A bf16 weight whose fp32 source lies on a GGUF grid (backend/cpu/grid.py), held twice: as its
    codes, decoded pair by pair into the products (csrc/matmul_bf16.c ppr_linear_grid_bf16), and as
    the bf16 panels CpuBf16Linear holds. Both give the same results bit for bit, so which one a
    call reads is a matter of speed alone, chosen by its rows (`code_rows`): the codes for a
    few rows, where reading 0.625 (Q4_1) or 1.06 (Q8_0) bytes a weight instead of 2 is the
    step, the panels above, where decoding would cost more than it saves. Against the codes
    alone, the equal-work bench on the 2-core Zen 4 EPYC (alternated, medians of 3 rounds): PP=2
    487 -> 552 tok/s at 32 in flight, 563 -> 583 at 64; PP=1 level (626 -> 629, 671 -> 649)."""

    grid: GridPairs

    def __init__(
        self, grid: GridPairs, kernels: NativeKernels, panels: torch.Tensor, code_rows: int
    ) -> None:
        super().__init__(grid, kernels)
        self.register_buffer("panels", panels)  # [ceil(N/16), K / 2, 16, 2] bf16
        self.code_rows = code_rows
        self.amx_rows = 0  # calls of this many rows or more on AMX tiles; 0: never (make_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amx = 0 < self.amx_rows <= x.shape[0]
        if x.shape[0] <= self.code_rows and not amx:
            return self.kernels.linear_grid_bf16(x, self.grid)  # [T, K] -> [T, N]
        return self.kernels.linear_bf16(x, self.panels, self.out_features, self.in_features, amx)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, [T, K] bf16 (a tied lm_head serves the lookup)."""
        return _bf16_rows(self.panels, ids // PANEL, ids % PANEL, self.in_features)

    def dense_weight(self) -> torch.Tensor:
        """The bf16 weight [N, K] back from its panels, which the codes decode to bit for bit
        (checked at load), for tools that compare with F.linear."""
        return _from_bf16_panels(self.panels, self.out_features, self.in_features)

    def bytes_read(self, rows: int) -> int:
        """What a call of `rows` rows reads: the codes, or the panels."""
        if rows <= self.code_rows:
            return self.grid.nbytes
        return self.panels.numel() * self.panels.element_size()

    def bytes_unread(self, rows: int) -> int:
        """What it holds that a call of `rows` rows does not read: the other of the two."""
        held = self.grid.nbytes + self.panels.numel() * self.panels.element_size()
        return held - self.bytes_read(rows)


def _found_codes(weight: torch.Tensor, kernels: NativeKernels) -> grid.Found | None:
    """The grid codes of a bf16 stage's matrix loaded in fp32 (the checkpoint's values), or
    None: codes turned off, a weight already rounded (bf16), or one off every grid."""
    if weight.dtype != torch.float32:
        return None
    return grid.find_codes(weight.detach(), kernels)


def _grid_bf16_linear(
    found: grid.Found, weight: torch.Tensor, kernels: NativeKernels
) -> GridBf16Linear | None:
    """GridBf16Linear for `weight` [N, K] (fp32, the checkpoint's values) and its codes, if the
    kernel decodes them to exactly weight's bf16 panels, bit for bit (else None)."""
    pairs = grid.pack_pairs(found, weight.shape[0])
    panels = kernels.pack_bf16(weight.to(torch.bfloat16))
    if not torch.equal(kernels.unpack_grid_bf16(pairs), panels):
        return None
    return GridBf16Linear(pairs, kernels, panels, code_rows_for(torch.get_num_threads()))


class GridA8Linear(_HeldAsCodes):
    """A bf16 weight whose fp32 source lies on a GGUF grid, held as its codes alone and
    multiplied as llama.cpp multiplies them: each row of x quantized to int8 per block of 32
    (by default in two passes, the second over what the first missed), the codes times it
    summed in integers (csrc/matmul_a8.c ppr_linear_grid_a8). One pass is a quarter of
    GridBf16Linear's work per weight at every row count, from 0.625 (Q4_1) or 1.06 (Q8_0) bytes
    a weight, and no bf16 panels held: all of SmolLM2's matmuls, 2 threads, Zen 4 EPYC (random
    codes of its shapes against the bf16 panels, 9 alternated rounds, medians): 1 row 3.7 /
    8.9 ms, 16 rows 10.3 / 13.1, 32 rows 18.5 / 22.7, 128 rows 62 / 88. The results are not
    bit for bit the bf16 panels' (x loses bits to its int8 grid; docs/engine.md: perplexity),
    but a row's result still depends on that row alone. `PPRING_GRID_ACTIVATIONS=bf16` keeps
    GridBf16Linear instead. Where the CPU has AMX, calls of `amx_rows` rows or more (prefill
    chunks; measured: 16 on the 2-core Xeon) take x unquantized, times the codes decoded to bf16
    a unit at a time, on AMX tiles (csrc/matmul_amx.c ppr_linear_grid_a8_amx): the default
    model's 1,500-token prefill (`ppring bench prefill`, 2 threads, one run) 2.10 -> 1.07 s. A
    row's result then depends on which side of amx_rows its batch falls."""

    grid: GridQuads

    def __init__(self, grid: GridQuads, kernels: NativeKernels, passes: int = 2) -> None:
        super().__init__(grid, kernels)
        self.passes = passes  # int8 passes over each row of x: 2 (the default) or 1
        # calls of this many rows or more: x unquantized times the codes decoded to bf16, on
        # AMX tiles (a prefill chunk); 0: never (make_linear)
        self.amx_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amx = 0 < self.amx_rows <= x.shape[0]
        return self.kernels.linear_grid_a8(x, self.grid, self.passes, amx)  # [T, K] -> [T, N]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, [T, K] bf16 (a tied lm_head serves the lookup): the
        checkpoint's values rounded to bf16, as CpuBf16Linear would hold them (decoded by one
        kernel call: grid.quad_rows's torch ops cost ~50 us a step)."""
        return self.kernels.grid_a8_rows(self.grid, ids)

    def rows_into(self, ids_at: int, out_at: int, rows: int) -> None:
        """`rows` over raw addresses: ids [rows] int64 at ids_at, into out [rows, K] bf16 at
        out_at (stages/backend/cpu/kept_decode.py's kept rows)."""
        self.kernels.grid_a8_rows_at(self.grid, ids_at, out_at, rows)

    def dense_weight(self) -> torch.Tensor:
        """The bf16 weight [N, K] the codes stand for (for tools that compare with F.linear)."""
        return self.rows(torch.arange(self.out_features))


# GridA8Linear's passes over x for each way that multiplies the codes by int8 activations
A8_PASSES = {"int8x2": 2, "int8": 1}


def bf16_grid_way(kernels: NativeKernels, activations: str | None = None) -> str:
    """How a bf16 stage over these kernels multiplies weights held as grid codes: "int8x2" or
    "int8" (GridA8Linear: needs VNNI) as `activations` (None: PPRING_GRID_ACTIVATIONS now) says,
    else "bf16" (GridBf16Linear)."""
    way = activations or grid_activations()
    return way if kernels.a8_dot and way in A8_PASSES else "bf16"


def _grid_a8_linear(
    found: grid.Found, weight: torch.Tensor, kernels: NativeKernels, passes: int
) -> GridA8Linear | None:
    """GridA8Linear for `weight` [N, K] (fp32, the checkpoint's values) and its codes, if they
    decode back to exactly the weight (else None)."""
    quads = grid.pack_quads(found, weight.shape[0])
    if not torch.equal(quad_rows(quads, torch.arange(weight.shape[0])), weight):
        return None
    return GridA8Linear(quads, kernels, passes)


def grid_bf16_stage_linear(
    weight: torch.Tensor, kernels: NativeKernels, activations: str | None = None
) -> GridA8Linear | GridBf16Linear | None:
    """A bf16 stage's module for `weight` [N, K] (fp32, the checkpoint's values) held as its
    grid codes, the way `bf16_grid_way` says (the codes found once); None off every grid."""
    found = _found_codes(weight, kernels)
    if found is None:
        return None
    way = bf16_grid_way(kernels, activations)
    if way in A8_PASSES:
        held = _grid_a8_linear(found, weight, kernels, A8_PASSES[way])
        if held is not None:
            return held
    return _grid_bf16_linear(found, weight, kernels)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels
        qweight, scale = quantize_int8(weight.detach().float())
        n, k = qweight.shape
        # Where the kernels read them faster (AVX-512), the rows are held in quads: the same
        # bytes in pack_int8_quads' order, the same results bit for bit.
        self.quads = kernels.int8_quads and n % 4 == 0 and k % 32 == 0
        self.register_buffer("qweight", pack_int8_quads(qweight) if self.quads else qweight)
        self.register_buffer("scale", scale)  # [N] fp32

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]  # K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, K] -> [T, N]
        return self.kernels.linear_int8(x, self.qweight, self.scale, quads=self.quads)


def pack_int8_quads(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 (N % 4 = K % 32 = 0) -> [N, K] whose memory holds each 4 rows as blocks
    of 32 columns, the four rows' 32 bytes back to back ([N / 4, K / 32, 4, 32]): a quad of rows
    is then one run of memory for csrc/matmul_int8.c ppr_linear_int8_quads, not four."""
    n, k = q.shape
    return q.view(n // 4, 4, k // 32, 32).permute(0, 2, 1, 3).contiguous().view(n, k)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (q [N, K] int8, scale [N]): symmetric, round to nearest, one scale per
    output channel (max |w| / 127). A search over clip ratios (keep the ratio in 0.75-1.0 with
    the least squared error) chose 1.0 for every row of the default model, so it is not done."""
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # [N]
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def make_linear(
    weight: torch.Tensor | nn.Parameter,
    quantization: str,
    kernels: NativeKernels | None,
    dtype: torch.dtype | None = None,
    switches: Switches | None = None,
) -> nn.Module:
    """The module for one weight matrix [N, K] of a stage computing in `dtype` (None: the
    weight's own). A bf16 stage may hand the checkpoint's fp32 weight (see `source_dtype`), so
    that a weight on a GGUF grid can be found and held as its codes. `kernels` None means they
    are not available (or not wanted: a GPU stage). `switches`: the backend's (None: read from
    the environment now)."""
    switches = switches or Switches.read()
    if isinstance(weight, GgufMatrix):
        return _gguf_linear(weight, quantization, kernels, dtype or torch.float32, switches)
    dtype = dtype or weight.dtype
    grids = switches.grid_weights
    on_cpu = kernels is not None and weight.device.type == "cpu"
    if quantization == "int8":
        assert kernels is not None  # check_quantization ran at start-up
        return Int8Linear(weight, kernels)
    if on_cpu and dtype == torch.float32:
        return (grids and grid_linear(weight, kernels)) or CpuLinear(weight, kernels)
    if on_cpu and dtype == torch.bfloat16 and kernels.bf16_dot:
        held = grids and grid_bf16_stage_linear(weight, kernels, switches.grid_activations)
        module = held or CpuBf16Linear(weight.to(torch.bfloat16), kernels)
        module.amx_rows = amx_rows_for(module, kernels, switches.amx_rows)
        return module
    return DenseLinear(weight.to(dtype))


def _gguf_linear(
    weight: GgufMatrix,
    quantization: str,
    kernels: NativeKernels | None,
    dtype: torch.dtype,
    switches: Switches,
) -> nn.Module:
    """The module for a matrix as its GGUF file's blocks: on the CPU kernels held as its codes
    where a layout takes them (`_codes_linear`), else from its dequantized values, as
    make_linear holds a checkpoint's."""
    on_cpu = kernels is not None and weight.device.type == "cpu"
    if on_cpu and quantization == "none" and switches.grid_weights:
        assert kernels is not None
        held = _codes_linear(weight, kernels, dtype, switches)
        if held is not None:
            return held
    dense = weight.dequantize()  # [N, K] fp32: the file's values
    return make_linear(dense, quantization, kernels, dtype, replace(switches, grid_weights=False))


def _codes_linear(
    weight: GgufMatrix, kernels: NativeKernels, dtype: torch.dtype, switches: Switches
) -> nn.Module | None:
    """A CPU stage's module holding `weight` as codes read from its blocks, or None: Q4_0,
    Q4_1, Q5_0 and Q8_0 on the grid kernels (fp32 or bf16; no fp32 copy, no search); the
    k-quants on the int8-activation kernel (bf16 with VNNI)."""
    way = bf16_grid_way(kernels, switches.grid_activations)
    a8 = dtype == torch.bfloat16 and way in A8_PASSES
    module: nn.Module | None = None
    codes = weight.legacy_codes()
    if codes is not None:
        found = grid.Found(codes.bits, codes.q, codes.d, codes.m)
        if dtype == torch.float32:
            return GridLinear(grid.pack_codes(found, weight.out_features), kernels)
        if a8:
            module = GridA8Linear(
                grid.pack_quads(found, weight.out_features), kernels, A8_PASSES[way]
            )
        elif dtype == torch.bfloat16 and kernels.bf16_dot:
            module = _grid_bf16_linear(found, weight.dequantize(), kernels)
    elif a8 and (k_codes := weight.k_quant_codes()) is not None:
        quads = grid.pack_k_quads(
            k_codes.format, k_codes.q, k_codes.d, k_codes.m, weight.out_features
        )
        module = GridA8Linear(quads, kernels, A8_PASSES[way])
    if module is not None:
        module.amx_rows = amx_rows_for(module, kernels, switches.amx_rows)
    return module


def source_dtype(
    dtype: torch.dtype,
    quantization: str,
    kernels: NativeKernels | None,
    switches: Switches | None = None,
) -> torch.dtype:
    """The dtype a stage loads its matmul weights in: fp32 for a bf16 stage whose kernels
    multiply bf16 themselves (weights on a grid are found in the checkpoint's fp32 values, then
    held as codes; the rest is rounded to bf16 at load), else the stage's own."""
    if (
        dtype == torch.bfloat16
        and quantization == "none"
        and kernels is not None
        and kernels.bf16_dot
        and (switches.grid_weights if switches else grid_weights_on())
    ):
        return torch.float32
    return dtype


def check_quantization(
    quantization: str, device: torch.device, kernels: NativeKernels | None, reason: str | None
) -> None:
    """One clear sentence at start-up for a quantization this stage cannot run."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {quantization} is not supported; use none or int8")
    if quantization != "int8":
        return
    if device.type != "cpu":
        raise ConfigError(
            f"--quantization int8 runs on the CPU only; on {device.type} use --dtype bfloat16"
        )
    if kernels is None:
        raise ConfigError(f"--quantization int8 needs ppring's CPU kernels, but {reason}")


def describe_matrices(modules: list[nn.Module], dtype: torch.dtype) -> str:
    """How a CPU stage holds its fp32 or bf16 matrices (`modules`: all of the stage's) and where
    they move to AMX tiles, for the start-up log."""
    return _describe_held(modules, dtype) + _describe_amx(modules)


_CODED = (GridLinear, GridBf16Linear, GridA8Linear)  # matrices held as GGUF codes
_KERNEL_MATRICES = (CpuLinear, CpuBf16Linear, *_CODED)  # every matrix the kernels multiply


def _describe_amx(modules: list[nn.Module]) -> str:
    """ "; AMX tiles from R rows" (the matrices' measured row counts, as a range where they
    differ), or "" where no matrix takes them."""
    matrices = [m for m in modules if isinstance(m, _KERNEL_MATRICES)]
    counts = sorted({m.amx_rows for m in matrices if getattr(m, "amx_rows", 0) > 0})
    if not counts:
        return ""
    some = sum(getattr(m, "amx_rows", 0) > 0 for m in matrices)
    which = "" if some == len(matrices) else f" ({some} of {len(matrices)} matrices)"
    rows = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"; AMX tiles from {rows} rows{which}"


def held_bytes(modules: list[nn.Module]) -> dict[str, int]:
    """The bytes `modules` hold in matrices, by how they hold them: a GGUF format's codes
    ("Q4_K", ...; a Q4_0 matrix's as "Q4_1", a Q5_0's as "Q8_0": the layouts they are held in),
    "bf16 panels", "fp32 panels", "int8" or torch's own ("bfloat16", ...)."""
    held: dict[str, int] = {}
    for module in modules:
        if isinstance(module, _CODED):
            kind, tensors = module.grid.name, list(module.buffers(recurse=False))
        elif isinstance(module, (CpuLinear, CpuBf16Linear)):
            kind = "fp32 panels" if isinstance(module, CpuLinear) else "bf16 panels"
            tensors = [module.panels]
        elif isinstance(module, Int8Linear):
            kind, tensors = "int8", [module.qweight, module.scale]
        elif isinstance(module, DenseLinear):
            kind, tensors = str(module.weight.dtype).removeprefix("torch."), [module.weight]
        else:
            continue
        held[kind] = held.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors)
    return held


def _describe_held(modules: list[nn.Module], dtype: torch.dtype) -> str:
    name = "fp32" if dtype == torch.float32 else "bf16"
    grids = [m.grid.name for m in modules if isinstance(m, _CODED)]
    total = sum(isinstance(m, _KERNEL_MATRICES) for m in modules)
    if not total:
        return f"{name}, multiplied by torch"
    if not grids:
        return f"{name}, packed in panels for the kernels"
    held = held_bytes(modules)
    counts = ", ".join(
        f"{grids.count(n)} {n} {held[n] / 2**20:.1f} MiB" for n in sorted(set(grids))
    )
    rest = "" if len(grids) == total else ", the rest packed in panels"
    both = [m.code_rows for m in modules if isinstance(m, GridBf16Linear)]
    if any(isinstance(m, GridA8Linear) for m in modules):
        passes = max(m.passes for m in modules if isinstance(m, GridA8Linear))
        also = (
            ", multiplied by int8 activations (per 32, as llama.cpp does; "
            f"{GRID_ACTIVATIONS_ENV}=bf16 for the bf16 panels' results)"
            if passes == 1
            else ", multiplied by activations quantized to int8 per 32 in two passes (bf16's "
            f"accuracy; {GRID_ACTIVATIONS_ENV}=int8 for one, as llama.cpp does)"
        )
    else:
        also = f" and as panels (codes read up to {max(both)} rows)" if both else ""
    return (
        f"{name}, {len(grids)} of {total} matrices held losslessly as GGUF codes ({counts})"
        f"{also}{rest}"
    )


def bytes_unread(modules: list[nn.Module], rows: int) -> int:
    """Of the bytes `modules` hold, what a forward of `rows` rows does not read: a matrix held
    both as codes and as bf16 panels (GridBf16Linear) reads one of them."""
    return sum(m.bytes_unread(rows) for m in modules if isinstance(m, GridBf16Linear))
