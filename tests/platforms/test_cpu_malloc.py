"""glibc malloc tuning of the CPU worker."""

from __future__ import annotations

import sys

import pytest

from tokenmill.platforms.cpu import tune_malloc


def test_opt_out_changes_nothing(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_MALLOC_TUNING", "0")
    assert tune_malloc() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_applies_on_glibc():
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt  # noqa: B018 - probing for glibc
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert tune_malloc() is True
