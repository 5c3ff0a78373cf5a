"""Finding the external programs some tests run (hadolint, promtool, prometheus, docker-compose)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def find_binary(name: str) -> str | None:
    """Beside the running interpreter first (a venv's bin/, used without activating it, as .ci/run
    does), then on PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def require_binary(name: str, why: str) -> str:
    """The binary's path; without it skip, except under CI=true, where it is a failure."""
    path = find_binary(name)
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {why}", pytrace=False)
        pytest.skip(why)
    return path
