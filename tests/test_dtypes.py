"""tokenmill.dtypes: the one dtype table."""

from __future__ import annotations

import pytest
import torch

from tokenmill.dtypes import dtype_bytes, dtype_name, parse_dtype


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("half", torch.float16), ("fp32", torch.float32),
                                              ("torch.float16", torch.float16), ("BFloat16", torch.bfloat16)])
def test_parse_dtype_spellings(name, dtype):
    assert parse_dtype(name) is dtype
    assert parse_dtype(dtype) is dtype


def test_parse_dtype_unknown():
    with pytest.raises(ValueError, match="Unknown dtype 'int3'"):
        parse_dtype("int3")


def test_names_and_bytes():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("half") == "float16"
    assert [dtype_bytes(d) for d in ("float32", "bfloat16", "fp8", torch.float16)] == [4, 2, 1, 2]
