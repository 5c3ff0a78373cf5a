"""What a tools/ script needs, checked before it imports or writes anything: a missing package is named with the
command that installs it, and a python without torch is told to use the project's (issue 51: `python
tools/build_resnet.py` took the system python, and then failed on onnxruntime after writing its file).

Standard library only: it runs before anything else can be imported.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# import name -> the package that installs it, where they differ
PACKAGES = {"sklearn": "scikit-learn", "PIL": "pillow"}


def missing(*modules: str) -> list[str]:
    """The packages of `modules` (import names) that this python cannot import."""
    return [PACKAGES.get(m, m) for m in modules if importlib.util.find_spec(m) is None]


def require(*modules: str) -> None:
    """Exit 2 with what to install unless every one of `modules` imports here; call it before any other work."""
    lacking = missing(*modules)
    if not lacking:
        return
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    venv = REPO / ".venv" / "bin" / "python"
    lines = [f"{script} needs {', '.join(lacking)}, which {sys.executable} cannot import."]
    if "torch" in lacking and venv.exists() and Path(sys.prefix).resolve() != venv.parent.parent.resolve():
        lines.append(f"Run it with the project's python: {venv.relative_to(REPO)} {script} ...")
    lines.append(f"Install them: {venv.relative_to(REPO) if venv.exists() else 'python'} -m pip install -e "
                 f"'.[tools]'   (or: pip install {' '.join(lacking)})")  # fmt: skip
    print("\n".join(lines), file=sys.stderr)
    raise SystemExit(2)
