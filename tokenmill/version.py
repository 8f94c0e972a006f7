"""The installed tokenmill version (from the package metadata; a dev marker when run from a source tree)."""

from __future__ import annotations


def get_version() -> str:
    """Version string of the installed `tokenmill` distribution, or "0.1.0.dev0" if not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenmill")
    except PackageNotFoundError:
        return "0.1.0.dev0"
