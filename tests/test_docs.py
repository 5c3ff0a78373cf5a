"""The README says what the code does: its two commands are the ones CI runs, and every setting and
metric family is documented."""

from __future__ import annotations

import re
from pathlib import Path

from service.config import ENV_PREFIX, Settings
from service.metrics import EngineMetrics, RequestMetrics

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block and README.index(block.group(0)) < 200, "the README must open with its two commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_serve_and_test_commands():
    serve, test = _commands()
    assert serve.startswith("./setup.sh") and "fusedserve serve" in serve
    assert test.startswith("./setup.sh --test") and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert _commands()[1] in ci, f"{_commands()[1]!r} is not a line of .ci/run"


def test_every_setting_is_documented():
    missing = [ENV_PREFIX + f.upper() for f in Settings.model_fields if f"`{ENV_PREFIX}{f.upper()}`" not in README]
    assert not missing, f"README's configuration table lacks {missing}"


def test_every_metric_family_is_documented():
    registries = (RequestMetrics("m", "fused").registry, EngineMetrics("m", "fused", "cpu", "float32").registry)
    names = {m.name for r in registries for m in r.collect() if m.name.startswith("fusedserve_")}
    assert len(names) >= 8, names
    missing = sorted(n for n in names if n not in README)
    assert not missing, f"README's metrics table lacks {missing}"
