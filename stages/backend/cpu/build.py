"""Building the CPU kernels: every .c of csrc/ in one compiler call, on first use, cached by
what the library depends on (stages/backend/cpu/native.py says why it is built here)."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# The kernels' C: one header (ppring.h) and a translation unit per concern (attention, each
# matmul family, the small ops, the layer stack), compiled together into one library. A test
# that builds a modified copy points SOURCE_DIR at its own folder (monkeypatch).
SOURCE_DIR = Path(__file__).with_name("csrc")
DISABLE_ENV = "PPRING_NATIVE_KERNELS"  # "0": use the torch paths
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# No -march: the compiler's baseline (x86-64 without AVX2 here), so the portable C paths run;
# the tests build this too, so both are checked on every machine.
PORTABLE_CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")
# A test-only build (`make test-asan`): every build of the kernels under AddressSanitizer and
# UBSan, any report fatal. The interpreter must have libasan preloaded (LD_PRELOAD).
SANITIZE_ENV = "PPRING_SANITIZE"  # "1": sanitized builds
SANITIZE_CFLAGS = (
    "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
)  # fmt: skip
COMPILE_TIMEOUT_S = 120


def source_files() -> list[Path]:
    """Every .c and .h of the kernels (SOURCE_DIR), sorted by name: a build compiles the .c
    files, and its cache key hashes all of them (an edit to the header rebuilds too)."""
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h") and p.is_file())


def build(compiler: str) -> Path:
    """The library for these sources, compiler and CPU: from the cache, or compiled into it."""
    # each file's name and bytes: a file renamed, added or removed changes the key too
    source = b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in source_files())
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256(
        b"\0".join(
            [source, version.encode(), " ".join(_flags(CFLAGS)).encode(), _cpu_signature().encode()]
        )
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if not target.is_file():
        compile_kernels(target, compiler, CFLAGS)
        logger.info("built the CPU kernels: %s", target)
    return target


def compile_kernels(target: Path, compiler: str, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Compile the kernels (every .c of SOURCE_DIR, in one compiler call) into the one library
    `target`. Stage processes starting together may all build: each writes its own file and
    renames it into place, which is atomic, so a reader never sees half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    sources = [str(p) for p in source_files() if p.suffix == ".c"]
    try:
        result = subprocess.run(
            [compiler, *_flags(cflags), "-o", partial, *sources, "-lm"],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr else "")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _flags(cflags: tuple[str, ...]) -> tuple[str, ...]:
    """`cflags`, with the sanitizers' where PPRING_SANITIZE=1 asks for them."""
    return (*cflags, *SANITIZE_CFLAGS) if os.environ.get(SANITIZE_ENV) == "1" else cflags


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    return platform.machine() + flags


def cache_dir() -> Path:
    """`$PPRING_CACHE`, else ~/.cache/ppring: where ppring keeps what it builds once."""
    env = os.environ.get("PPRING_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ppring"
