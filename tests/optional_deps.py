"""Packages of the test extra: a test that needs one fails under `make test` and skips elsewhere.

`make test` installs the test extra (pyproject.toml) and sets
TOKENMILL_TEST_REQUIRE_EXTRAS=1, so a package that is missing there is a broken
install, never a reason to skip a module: `require()` fails the module (a
collection error) with the line that installs it. A bare `pytest` run without
the variable skips instead, so a partial environment still runs what it can.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "TOKENMILL_TEST_REQUIRE_EXTRAS"
INSTALL = "pip install -e '.[serve,gguf,test]' (make test does it)"


def extras_required() -> bool:
    """True under `make test` (TOKENMILL_TEST_REQUIRE_EXTRAS=1): a missing test-extra package is a failure."""
    return os.environ.get(REQUIRE_ENV, "0") == "1"


def missing(what: str) -> NoReturn:
    """Fail (under `make test`) or skip (elsewhere) because `what` is not installed.

    Usable at module level (fails the module's collection or skips the module),
    in a fixture, or in a test.
    """
    msg = f"{what} is not installed: {INSTALL}"
    if extras_required():
        pytest.fail(f"{msg}; {REQUIRE_ENV}=1 turns a missing test-extra package into a failure", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def require(module: str, package: str | None = None) -> ModuleType:
    """`import module`; when it is absent, `missing(package or module)`.

    Only a ModuleNotFoundError counts as absent: any other import error (a
    broken install, a bug) propagates as itself.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise  # the module exists but imports something that does not
    missing(package or module.split(".")[0])  # outside the except: no chained traceback in the report
