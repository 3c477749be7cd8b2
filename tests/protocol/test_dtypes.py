"""protocol/dtypes.py: the one dtype table every layer reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protocol import codec
from protocol.dtypes import TABLE, WIRE_DTYPES, canonical, dtype_bytes, spellings
from protocol.errors import ProtocolError
from protocol.messages import Proxy


@pytest.mark.parametrize(
    ("alias", "name", "num_bytes"),
    [
        ("fp32", "float32", 4),
        ("bf16", "bfloat16", 2),
        ("fp16", "float16", 2),
        ("fp8", "float8_e4m3fn", 1),
    ],
)
def test_aliases_resolve_to_the_canonical_name_and_its_size(alias, name, num_bytes):
    assert canonical(alias) == canonical(name) == name
    assert dtype_bytes(alias) == dtype_bytes(name) == num_bytes


def test_a_torch_dtype_resolves_like_its_name():
    assert canonical(torch.bfloat16) == "bfloat16"
    assert dtype_bytes(torch.int64) == 8


def test_every_size_is_torchs_and_every_name_is_a_torch_attribute():
    for row in TABLE:
        assert getattr(torch, row.name).itemsize == row.num_bytes, row.name


def test_no_spelling_names_two_dtypes():
    every = [spelling for row in TABLE for spelling in spellings(row.name)]
    assert len(every) == len(set(every))


def test_an_unknown_name_is_one_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown dtype 'float64'; use one of float32, fp32,") as e:
        dtype_bytes("float64")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        canonical("int4")


def test_the_codec_carries_exactly_the_wire_dtypes():
    assert set(codec.DTYPES) == set(WIRE_DTYPES)
    assert set(WIRE_DTYPES) == {"float32", "bfloat16", "float16", "int32", "int64"}


@pytest.mark.parametrize("name", [row.name for row in TABLE if not row.on_wire])
def test_the_codec_refuses_a_dtype_the_table_keeps_off_the_wire(name):
    tensor = torch.zeros(2, dtype=getattr(torch, name))
    with pytest.raises(ProtocolError, match=f"dtype {name}"):
        codec.encode(Proxy(0, 0, "x", tensor, torch.zeros(2)))


def test_the_table_and_the_codec_import_without_torch():
    check = "import protocol.dtypes, protocol.codec, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, cwd=Path(__file__).parents[2])
