"""Before any child starts: import what the front ends will import, so that a package at a version the service cannot
load stops the start once, naming the package and the version range to install, instead of every front end dying at
import and being started again (issue 51: protobuf 6.33, pulled by `pip install tritonclient`, against gencode 7.35
killed six front ends in a row).

The ranges come from the installed distribution's own metadata (pyproject.toml's dependencies), so the message and
the declaration cannot drift apart.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re

DISTRIBUTION = "fusedserve"


class DependencyError(RuntimeError):
    """A module the service needs cannot be imported; the message says what to install."""


def declared(package: str) -> str:
    """The version range fusedserve declares for `package` ('protobuf' -> 'protobuf<8,>=6.30.0'), or the bare name."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return package
    want = _canonical(package)
    for req in requires:
        if "extra ==" in req:
            continue
        name = re.match(r"[A-Za-z0-9._-]+", req)
        if name and _canonical(name.group()) == want:
            return req.split(";")[0].strip()
    return package


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def explain(error: BaseException) -> str:
    """What to install to get past an import's `error`, in one line."""
    text = str(error)
    if type(error).__name__ == "VersionError" or "Protobuf Gencode/Runtime" in text:
        package = "protobuf"
    elif "grpc package installed" in text or "grpcio>=" in text:
        package = "grpcio"
    elif isinstance(error, ImportError) and error.name:
        top = error.name.split(".")[0]
        package = (importlib.metadata.packages_distributions().get(top) or [top])[0]
    else:
        return f"{type(error).__name__}: {text}"
    have = installed(package)
    now = f"{package} {have} is installed" if have else f"{package} is not installed"
    first = text.splitlines()[0] if text else type(error).__name__
    return f'{now} and cannot be used ({first}); install what fusedserve declares: pip install "{declared(package)}"'


def front_end_modules(grpc: bool) -> list[str]:
    """The modules a front end imports as it starts; gRPC's generated code only where gRPC is served."""
    modules = ["service.frontend.routes", "service.frontend.fastpath", "service.frontend.engine_client"]
    return modules + (["service.v2.grpc_server"] if grpc else [])


def check_imports(modules: list[str]) -> None:
    """Import each of `modules`; DependencyError saying what to install at the first that fails."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # VersionError, grpc's RuntimeError, ImportError: all mean the same to a user
            raise DependencyError(f"cannot import {name}: {explain(e)}") from e


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
