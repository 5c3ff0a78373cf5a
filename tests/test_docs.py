"""The docs say what the code does. The README opens with the two commands CI runs, fits in 12 KiB and
links to the rest; docs/configuration.md and docs/metrics.md are what `fusedserve docs` generates from the
Settings and the metrics registry, and document every setting and metric family; every link between the docs
resolves; every shell command in them is run here, or, where it needs Docker or a GPU, checked against the
files it uses; and the benchmark figures the docs quote match the committed results."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.config import ENV_PREFIX, Settings, SettingsError, load_settings
from service.metrics import EngineMetrics, RequestMetrics, SupervisorMetrics

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
README_MAX_BYTES = 12 * 1024
CONFIGURATION = REPO / "docs" / "configuration.md"
METRICS = REPO / "docs" / "metrics.md"
API = REPO / "docs" / "api.md"
DOCS = (
    "README.md",
    "CONTRIBUTING.md",
    "bench/README.md",
    "bench/probes/README.md",
    "docs/performance.md",
    "docs/api.md",
    "docs/models.md",
    "docs/scaling.md",
    "docs/configuration.md",
    "docs/metrics.md",
    "docs/security.md",
)
FUSEDSERVE = ".venv/bin/fusedserve"
RESULTS = REPO / "bench" / "results"  # one folder per GPU: results/h100/kernels_h100.md


def _opening_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block and README.index(block.group(0)) < 200, "the README must open with its two commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _shell_commands(text: str) -> list[str]:
    """Each command of the ```bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in _blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


# A command quoted inline (`fusedserve serve --help`), as opposed to an example with a placeholder in it.
_INLINE = re.compile(r"`((?:\.venv/bin/)?fusedserve [^`]+|(?:\.venv/bin/)?python -m [^`]+|\./setup\.sh[^`]*"
                     r"|(?:[A-Z_]+=\S+ )*bash [^`]+|git show [^`]+)`")  # fmt: skip
_PLACEHOLDERS = ("NAME", "REV:PATH", "--option", "MODEL --samples")


def _inline_commands(text: str) -> list[str]:
    """Commands quoted in the prose, with `fusedserve` and `python` as the README's commands spell them."""
    found = [c for c in _INLINE.findall(text) if not any(p in c for p in _PLACEHOLDERS)]
    return [re.sub(r"^(fusedserve|python) ", r".venv/bin/\1 ", c) for c in found]


def _all_commands() -> list[tuple[str, str]]:
    return [
        (doc, cmd)
        for doc in DOCS
        for cmd in [*_shell_commands((REPO / doc).read_text()), *_inline_commands((REPO / doc).read_text())]
    ]


_ENV = r"(?:[A-Z_]+=(?:\"[^\"]*\"|\S+) )*"
_PYTEST = r"\.venv/bin/python -m pytest(?: -n auto --maxprocesses 4)?"  # the README's test command, CI's too
# Every command a doc shows, by the test that runs or checks it.
KINDS = {
    "setup": rf"^\./setup\.sh(?: --test)?(?: && (?:{FUSEDSERVE} serve|{_PYTEST}))?$",
    "pytest": r"^\.venv/bin/python -m pytest .*$",
    "images": r"^curl .*localhost:8001/.*$",  # an image model's examples, before try-it's curls to :8000
    "try-it": rf"^(?:{FUSEDSERVE} serve &|curl .*)$",
    "help": rf"^{FUSEDSERVE} [\w -]*--help$",
    "serve": rf"^{_ENV}{FUSEDSERVE} serve(?: .*)?$",
    "check-model": rf"^{FUSEDSERVE} check-model \S+$",
    "import": rf"^{FUSEDSERVE} import \S+\.onnx \S+(?: --name \S+)?(?: --(?:resize|mean|std|channels) \S+)*$",
    "docs": rf"^{FUSEDSERVE} docs(?: --check)?$",
    "calibrate": rf"^{FUSEDSERVE} calibrate \S+ --samples \S+(?: --percentile [\d.]+)?$",
    "bench-smoke": rf"^{FUSEDSERVE} bench kernels --device cpu --quick --out \S+$",
    "gpu": rf"^(?:{_ENV}bash bench/gpu_session\.sh.*|{FUSEDSERVE} bench (?:kernels|serve|pool|soak|zoo)"
    r"(?! --device cpu).*)$",
    "probe": r"^\.venv/bin/python -m bench\.probes\.\w+(?: --out \S+)?$",
    "gpu-script": r"^\.venv/bin/python -m bench\.serve\.issue5[02] --out \S+(?: --models [\w,]+)?(?: --ab-only)?$",
    "gpu-suite": r"^bash tests/gpu_suite\.sh (?:PART|kernels-a|kernels-b|service|two-gpu|all|record \S+.*)$",
    "report": r"^\.venv/bin/python -m bench\.kernels\.report \S+$",
    "docker": r"^docker compose (?:--profile \w+ )?up --build(?: [\w-]+)*$",
    "git": r"^git show [0-9a-f]{7,40}:\S+$",
}


def _kind(cmd: str) -> str | None:
    return next((k for k, pattern in KINDS.items() if re.match(pattern, cmd)), None)


def _commands(kind: str) -> list[str]:
    found = list(dict.fromkeys(cmd for _, cmd in _all_commands() if _kind(cmd) == kind))
    assert found, f"no command of kind {kind!r} in {DOCS}: update KINDS with the docs"
    return found


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    # The checkout on the path, as an installed fusedserve would be: the GPU host runs the suite uninstalled.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _fusedserve_argv(cmd: str) -> list[str]:
    """`.venv/bin/fusedserve ARGS` as this interpreter runs it (the test process's venv and checkout)."""
    words = shlex.split(cmd)
    assert words[0] == FUSEDSERVE, cmd
    return [sys.executable, "-m", "fusedserve", *words[1:]]


# ------------------------------------------------------------------------------------ the README


def test_readme_opens_with_serve_and_test_commands():
    serve, test = _opening_commands()
    assert serve.startswith("./setup.sh") and "fusedserve serve" in serve
    assert test.startswith("./setup.sh --test") and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert _opening_commands()[1] in ci, f"{_opening_commands()[1]!r} is not a line of .ci/run"


def test_ci_lints_before_it_tests():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    test = ci.index(_opening_commands()[1])
    assert ".venv/bin/ruff check ." in ci[:test] and ".venv/bin/ruff format --check ." in ci[:test], ci


def test_readme_fits_in_12_kib():
    size = len(README.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}: move detail to docs/"


def test_readme_links_to_the_reference_and_the_story():
    for page in ("docs/configuration.md", "docs/metrics.md", "docs/performance.md", "docs/api.md", "CONTRIBUTING.md"):
        assert f"]({page})" in README, f"README does not link to {page}"


def _links(doc: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", (REPO / doc).read_text())


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_resolves():
    broken, checked = [], 0
    for doc in DOCS:
        for target in _links(doc):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (REPO / doc).parent / path if path else REPO / doc
            checked += 1
            if not dest.exists():
                broken.append(f"{doc}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = {_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{doc}: {target} (no such heading)")
    assert checked >= 30 and not broken, broken


def _table(path: Path) -> list[list[str]]:
    """The rows of every markdown table in `path`, as cells (`\\|` inside a cell kept)."""
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return rows


def test_every_setting_is_documented():
    documented = {row[0].strip("`") for row in _table(CONFIGURATION)}
    missing = [ENV_PREFIX + f.upper() for f in Settings.model_fields if ENV_PREFIX + f.upper() not in documented]
    assert not missing, f"docs/configuration.md lacks {missing}: run `fusedserve docs`"
    for name, field in Settings.model_fields.items():
        row = next(r for r in _table(CONFIGURATION) if r[0] == f"`{ENV_PREFIX}{name.upper()}`")
        assert row[-1] == field.description, f"{name}: docs/configuration.md's description is not the Field's"


def test_documented_defaults_are_the_settings_defaults():
    header, *rows = _table(CONFIGURATION)
    column = header.index("default")
    shown = {row[0].strip("`"): row[column].strip("`") for row in rows}
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, Path):
            default = str(default)
        want = "unset" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        got = shown[ENV_PREFIX + name.upper()]
        assert got in (want, want.removesuffix(".0")), f"{name}: docs say {got!r}, Settings {default!r}"


def test_every_variable_the_docs_name_is_a_setting():
    """A FUSEDSERVE_ name in the docs is a setting, or a variable setup.sh or bench/gpu_session.sh reads."""
    scripts = (REPO / "setup.sh").read_text() + (REPO / "bench" / "gpu_session.sh").read_text()
    known = {ENV_PREFIX + f.upper() for f in Settings.model_fields}
    named = {n for doc in DOCS for n in re.findall(r"\bFUSEDSERVE_[A-Z0-9_]*[A-Z0-9]\b", (REPO / doc).read_text())}
    unknown = sorted(n for n in named if n not in known and n not in scripts)
    assert len(named) >= 20 and not unknown, unknown


def _metric_families() -> dict[str, str]:
    registries = (
        RequestMetrics("m", "fused").registry,
        EngineMetrics("m", "fused", "cpu", "float32").registry,
        SupervisorMetrics().registry,
    )
    return {m.name: m.type for r in registries for m in r.collect() if m.name.startswith("fusedserve_")}


def test_every_metric_family_is_documented():
    families = _metric_families()
    assert len(families) >= 8, families
    header, *rows = _table(METRICS)
    documented = {row[0].strip("`"): row[header.index("type")] for row in rows if row[0].startswith("`fusedserve_")}
    for name, kind in families.items():
        series = f"{name}_total" if kind == "counter" else name
        assert series in documented, f"docs/metrics.md lacks {series}: run `fusedserve docs`"
        assert documented[series].split(",")[0] == kind, f"{series}: docs say {documented[series]!r}, code {kind!r}"
    assert len(documented) == len(families), sorted(set(documented) - {f"{n}_total" for n in families} - set(families))


def test_generated_docs_match_the_code(tmp_path):
    """`fusedserve docs --check` passes on the committed files; `fusedserve docs` writes exactly them, twice alike;
    and --check on a stale copy exits 1 with a diff, writing nothing."""
    assert _commands("docs"), "no doc shows the command that generates the reference pages"
    res = _run(_fusedserve_argv(f"{FUSEDSERVE} docs --check"), REPO)
    assert res.returncode == 0, f"the committed docs differ from the code; run `fusedserve docs`:\n{res.stdout}"
    assert "2 file(s) checked, all match the code" in res.stdout, res.stdout  # it says what it checked
    for out in (tmp_path / "a", tmp_path / "b"):
        res = _run([*_fusedserve_argv(f"{FUSEDSERVE} docs"), "--out", str(out)], REPO)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"{out / METRICS.name}: written from the code (new)" in res.stdout, res.stdout  # and what it wrote
    res = _run([*_fusedserve_argv(f"{FUSEDSERVE} docs"), "--out", str(tmp_path / "a")], REPO)
    assert f"{tmp_path / 'a' / METRICS.name}: matches the code, left as it is" in res.stdout, res.stdout
    for page in (CONFIGURATION, METRICS):
        assert (tmp_path / "a" / page.name).read_text() == page.read_text() == (tmp_path / "b" / page.name).read_text()
    stale = tmp_path / "a" / METRICS.name
    stale.write_text(stale.read_text().replace("Requests by outcome", "Requests by result"))
    res = _run([*_fusedserve_argv(f"{FUSEDSERVE} docs --check"), "--out", str(tmp_path / "a")], REPO)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "-| `fusedserve_requests_total`" in res.stdout and "+| `fusedserve_requests_total`" in res.stdout, res.stdout
    assert "Requests by result" in stale.read_text(), "--check must not write"


# ------------------------------------------------------------------------------------ the commands


def test_every_shell_command_in_the_docs_is_checked():
    unchecked = [f"{doc}: {cmd}" for doc, cmd in _all_commands() if _kind(cmd) is None]
    assert not unchecked, "commands no test runs or checks (add them to KINDS):\n" + "\n".join(unchecked)


def test_setup_commands():
    assert len(_commands("setup")) >= 2
    setup = REPO / "setup.sh"
    assert setup.stat().st_mode & 0o111, "setup.sh must be executable"
    assert _run(["bash", "-n", str(setup)], REPO).returncode == 0


def test_pytest_commands_use_registered_markers():
    markers = (REPO / "pyproject.toml").read_text()
    for cmd in _commands("pytest"):
        for expr in re.findall(r'-m "([^"]+)"|-m (\w+)', cmd.split("-m pytest", 1)[1]):
            for word in re.findall(r"\w+", " ".join(expr)):
                assert word in ("not", "and", "or") or f'"{word}:' in markers, f"{cmd}: no marker {word!r}"


def test_serve_commands_are_valid_settings(monkeypatch):
    from service.cli import _add_setting_options

    for cmd in _commands("serve"):
        words = shlex.split(cmd)
        env = dict(w.split("=", 1) for w in words[: words.index(FUSEDSERVE)])
        argv = words[words.index(FUSEDSERVE) + 2 :]
        if argv[-1:] == ["&"]:
            argv = argv[:-1]
        for k in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            assert k.startswith(ENV_PREFIX) or k == "CUDA_VISIBLE_DEVICES", f"{cmd}: {k} is not a setting"
            if k.startswith(ENV_PREFIX):
                monkeypatch.setenv(k, v)
        parser = argparse.ArgumentParser()
        _add_setting_options(parser)
        args = parser.parse_args(argv)
        try:
            load_settings(**{n: getattr(args, n, None) for n in Settings.model_fields})
        except SettingsError as e:
            pytest.fail(f"{cmd}: {e}")


def test_help_commands(tmp_path):
    for cmd in _commands("help"):
        res = _run(_fusedserve_argv(cmd), REPO)
        assert res.returncode == 0 and "usage: fusedserve" in res.stdout, f"{cmd}:\n{res.stdout}{res.stderr}"


def test_calibrate_commands_parse(monkeypatch):
    """docs/models.md's `fusedserve calibrate` commands parse as written (the calibration itself: test_calibrate.py)."""
    from fusedserve.cli import main

    seen = []
    monkeypatch.setattr("service.cli._calibrate", lambda args: seen.append(args) or 0)
    commands = _commands("calibrate")
    for cmd in commands:
        assert main(shlex.split(cmd)[1:]) == 0, cmd
    assert [a.samples for a in seen] == [shlex.split(c)[4] for c in commands]
    assert any(a.percentile is not None for a in seen), "the percentile form is shown"


def test_export_snippet_and_check_model_commands(tmp_path, monkeypatch, capsys):
    """The README's export snippet runs as written (in an empty directory), its import commands write model
    directories, and each check-model command there then validates its model and prints the fused plan. The commands
    run in this process (fusedserve.cli.main, as the console script calls it): a process each, importing torch, took
    most of this test's 73 s on the 2-core CI machine."""
    from fusedserve.cli import main

    (snippet,) = [b for b in _blocks(README, "python") if "export_sequential" in b]
    (tmp_path / "model_weights").symlink_to(REPO / "model_weights")
    res = _run([sys.executable, "-c", snippet], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "wrote my-mlp/config.json (3 ops)" in res.stdout, res.stdout  # the export helpers say what they wrote
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith("FUSEDSERVE_")]:
        monkeypatch.delenv(name)  # as a user's shell runs them
    for cmd in _commands("import") + _commands("check-model"):  # import first: check-model reads what it writes
        code = main(_fusedserve_argv(cmd)[3:])
        out = capsys.readouterr()
        assert code == 0 and "fused plan" in out.out, f"{cmd}:\n{out.out}{out.err}"
    # the exported 64-32-2 MLP fits the whole-MLP kernel: one kernel, as the server runs it
    assert main(["check-model", "my-mlp"]) == 0
    assert "fused plan (1 kernel): mlp_0_1" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_smoke_command(tmp_path):
    """The docs' CPU smoke run of the benchmark. Without CUDA, tests/test_bench_kernels.py runs that very command
    (SMOKE_ARGV: its cpu_run, in its process) and checks what it writes; running it here too took another 40-75
    CPU-s of the 2-core machine. With CUDA, where that check is skipped, the command runs here."""
    import torch

    from tests.test_bench_kernels import SMOKE_ARGV

    if not torch.cuda.is_available():
        for cmd in _commands("bench-smoke"):
            argv = _fusedserve_argv(cmd)
            assert argv[3:-1] == SMOKE_ARGV, f"{cmd}: tests/test_bench_kernels.py runs {' '.join(SMOKE_ARGV)} DIR"
        return
    for cmd in _commands("bench-smoke"):
        argv = _fusedserve_argv(cmd)
        argv[argv.index("--out") + 1] = str(tmp_path)
        res = _run(argv, REPO, timeout=240)
        assert res.returncode == 0, f"{cmd}:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
        assert list(tmp_path.glob("kernels_*.md")), res.stdout[-2000:]


def test_gpu_commands_name_what_exists():
    """GPU-only commands cannot run here: their script parses, and every step, probe and flag they name exists."""
    script = (REPO / "bench" / "gpu_session.sh").read_text()
    assert _run(["bash", "-n", "bench/gpu_session.sh"], REPO).returncode == 0
    from fusedserve.cli import main

    for cmd in _commands("gpu"):
        words = shlex.split(cmd)
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        for step in env.get("STEPS", "").split():
            assert f'" {step} "' in script, f"{cmd}: gpu_session.sh has no step {step!r}"
        for probe in env.get("PROBE", "").split():
            assert (REPO / "bench" / "probes" / f"{probe.replace('-', '_')}.py").is_file(), f"{cmd}: no probe {probe}"
        for name in env:
            assert name in script, f"{cmd}: gpu_session.sh does not read {name}"
        if FUSEDSERVE in words:  # parses as given (--help exits 0 before running anything)
            with pytest.raises(SystemExit) as e:
                main([*words[words.index(FUSEDSERVE) + 1 :], "--help"])
            assert e.value.code == 0, cmd


def test_gpu_suite_commands_name_its_parts():
    """tests/gpu_suite.sh parses, and every part a doc names is one it runs (PART: each of them)."""
    script = (REPO / "tests" / "gpu_suite.sh").read_text()
    assert _run(["bash", "-n", "tests/gpu_suite.sh"], REPO).returncode == 0
    for cmd in _commands("gpu-suite"):
        part = shlex.split(cmd)[2]
        parts = ["kernels-a", "kernels-b", "service", "two-gpu"] if part == "PART" else [part]
        for name in parts:
            assert f"{name})" in script or f"{name} " in script, f"{cmd}: gpu_suite.sh has no part {name}"


def test_probe_commands_name_importable_probes():
    import importlib

    for cmd in _commands("probe"):
        module = shlex.split(cmd)[2]
        assert hasattr(importlib.import_module(module), "main"), cmd


def test_gpu_script_commands_parse_their_arguments():
    """The GPU-host scripts the docs name (bench/serve/issue50.py, issue52.py) import here and accept the documented
    arguments: --help after them exits 0 (the run itself needs the GPU host)."""
    for cmd in _commands("gpu-script"):
        words = shlex.split(cmd)
        run = _run([sys.executable, "-m", words[2], *words[3:], "--help"], REPO)
        assert run.returncode == 0 and "--out" in run.stdout, (cmd, run.stderr[-2000:])


def test_report_command_rerenders_the_committed_results(tmp_path):
    """`python -m bench.kernels.report JSON` on the committed run writes exactly the committed markdown."""
    from bench.kernels.report import main as rerender

    for cmd in _commands("report"):
        src = REPO / shlex.split(cmd)[3]
        shutil.copy(src, tmp_path / src.name)
        assert rerender([str(tmp_path / src.name)]) == 0
        assert (tmp_path / src.with_suffix(".md").name).read_text() == src.with_suffix(".md").read_text(), cmd


def test_git_commands_name_what_history_holds():
    """`git show REV:PATH` (where the docs point at a deleted probe) names an object the history has."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    if _run(["git", "rev-parse", "--is-shallow-repository"], REPO).stdout.strip() != "false":
        pytest.skip("a shallow clone lacks the history these commands name")
    for cmd in _commands("git"):
        res = _run(["git", "cat-file", "-e", cmd.split()[2]], REPO)
        assert res.returncode == 0, f"{cmd}: {res.stderr}"


def test_docker_commands_match_the_compose_file():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert any("build" in s for s in services.values()), "no service is built from the repository"
    assert (REPO / "Dockerfile").is_file()
    for cmd in _commands("docker"):
        profile = re.search(r"--profile (\w+)", cmd)
        if profile:
            assert any(profile.group(1) in s.get("profiles", []) for s in services.values()), cmd
        named = cmd.split("--build", 1)[1].split()  # services started by name (the cpu profile's)
        assert all(n in services for n in named), cmd


@pytest.mark.slow
def test_try_it_against_a_real_server():
    """The README's "Try it" block against a real server on a loopback port: the same curl commands, and
    the predictions the README prints."""
    from .server import running_server

    block = next(b for b in _blocks(README, "bash") if "curl" in b)
    expected = re.search(r"^# (\[.*\])", block, re.M).group(1)
    curls = [c for c in _commands("try-it") if c.startswith("curl")]
    assert len(curls) >= 2
    with running_server("fused", max_batch_size=8) as url:
        outputs = []
        for cmd in curls:
            here = cmd.replace("localhost:8000", url.removeprefix("http://"))
            res = _run(["bash", "-c", "set -o pipefail; " + here], REPO, 60)
            assert res.returncode == 0, f"{cmd}:\n{res.stdout}{res.stderr}"
            outputs.append(res.stdout.strip())
    assert '"ready"' in outputs[0], outputs[0]
    assert outputs[-1] == expected, outputs[-1]


@pytest.mark.slow
def test_open_inference_protocol_example_against_a_real_server():
    """docs/api.md's tritonclient example, as written but for the ports, against a real server with gRPC on, prints
    the labels it shows."""
    from .server import free_port, running_server

    pytest.importorskip("tritonclient.grpc", reason="tritonclient[http,grpc] is not installed (the test extra)")
    (snippet,) = [b for b in _blocks(API.read_text(), "python") if "tritonclient" in b and "digits-mlp" in b]
    expected = re.search(r"^# (\[.*\])", snippet, re.M).group(1)
    grpc_port = free_port()
    with running_server("unfused", grpc_port=grpc_port, max_batch_size=8):
        code = snippet.replace("localhost:8001", f"127.0.0.1:{grpc_port}")
        res = _run([sys.executable, "-c", code], REPO, 60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expected, res.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_image_examples_against_a_real_server(tmp_path):
    """The docs' image examples (README's "Try it", docs/api.md's Images): the import command that declares the
    preprocessing, then every curl to :8001 and the tritonclient snippet against a real server of what it wrote; each
    answers the labels of the files it sends (examples_labels.json: the images are examples.json's digits)."""
    from .server import running_server

    pytest.importorskip("tritonclient.http", reason="tritonclient[http,grpc] is not installed (the test extra)")
    labels = [str(v) for v in json.loads((REPO / "model_weights/digits-resnet/examples_labels.json").read_text())]
    (imported,) = {c for c in _commands("import") if " digits-images " in c}
    (tmp_path / "model_weights").symlink_to(REPO / "model_weights")
    res = _run(_fusedserve_argv(imported), tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    curls = _commands("images")
    assert len(curls) >= 4 and any(c in README for c in curls)
    with running_server("unfused", model=str(tmp_path / "digits-images"), max_batch_size=8) as url:
        for cmd in curls:
            res = _run(["bash", "-c", "set -o pipefail; " + cmd.replace("localhost:8001", url.removeprefix("http://"))],
                       REPO, 60)  # fmt: skip
            assert res.returncode == 0, f"{cmd}:\n{res.stdout}{res.stderr}"
            sent = re.findall(r"images/(\d)\.", cmd)
            assert json.loads(res.stdout)["predictions"] == [labels[int(i)] for i in sent], f"{cmd}: {res.stdout}"
        (snippet,) = [b for b in _blocks(API.read_text(), "python") if "digits-images" in b]
        expected = re.search(r"^# (\[.*\])", snippet, re.M).group(1)
        res = _run([sys.executable, "-c", snippet.replace("localhost:8001", url.removeprefix("http://"))], REPO, 60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expected == str(labels[:3]), res.stdout


# ------------------------------------------------------------------------------------ the numbers


def _md_row(first_cells: list[str], gpu: str = "h200", models: bool = False) -> str:
    """The row of the committed kernels_<gpu>.md whose leading cells are first_cells; for a model, in the fp16
    table (the bf16 one has the same leading cells)."""
    md = RESULTS / gpu / f"kernels_{gpu}.md"
    lines, section = [], ""
    for line in md.read_text().splitlines():
        section = line if line.startswith("## ") else section
        if line.startswith("|") and (not models or section.startswith("## Models: whole forward, float16")):
            lines.append(line)
    want = [c.strip() for c in first_cells]
    hits = [r for r in lines if [c.strip() for c in r.strip("|").split("|")][: len(want)] == want]
    assert len(hits) == 1, f"{want}: {len(hits)} rows in {md.name}"
    return hits[0]


@pytest.mark.parametrize("doc", ["README.md", "docs/performance.md"])
def test_quoted_benchmark_tables_match_the_committed_results(doc):
    """Every figure of the docs' layer and model tables appears in the same case's row of kernels_h200.md (or of
    the GPU a row names: | model | H100 | batch | ...)."""
    checked = 0
    for line in (REPO / doc).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if m := re.fullmatch(r"(\d+)×(\d+)×(\d+)", cells[0]):
            row = _md_row([cells[0], "float16", "relu"])
        elif m := re.fullmatch(r"(digits-mlp|wide-mlp|digits-cnn|wide-cnn)\b.*", cells[0]):
            gpu = "h200"
            if len(cells) > 1 and cells[1] in ("H100", "H200"):
                gpu, cells = cells[1].lower(), cells[1:]
            row = _md_row([m.group(1), cells[1]], gpu, models=True)
            cells = cells[1:]
        else:
            continue
        for cell in cells[1:]:
            for figure in re.findall(r"\d+(?:\.\d+)?x?|[a-zA-Z-]+ \d+(?:\.\d+)?", cell):
                assert figure in row, f"{doc}: {figure!r} ({line.strip()}) is not in {row}"
        checked += 1
    assert checked >= 8, f"{doc}: found only {checked} benchmark rows"


def _serve_closed_loop() -> dict[tuple[str, int, int, int], dict[str, str]]:
    """The committed bench serve run's closed-loop rows: (system, workers, rows, conns) -> {column: cell}."""
    text = (RESULTS / "h100" / "serve_h100.md").read_text()
    section = text.split("## Closed loop", 1)[1].split("\n## ", 1)[0]
    header, *rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line[:2] == "| "
    ]
    found = {}
    for row in rows:
        if not row[0].startswith("-"):
            cells = dict(zip(header, row, strict=True))
            found[row[0], int(cells["workers"]), int(cells["rows"]), int(cells["conns"])] = cells
    return found


@pytest.mark.parametrize("doc", ["README.md", "docs/performance.md"])
def test_quoted_serve_figures_match_the_committed_run(doc):
    """Every cell of the docs' end-to-end tables (a row `N workers, M connections, [64-row] req/s | p50 ms | rows/s`,
    a column per system) is the same case's figure in the committed bench serve run, a p99 in brackets too."""
    run = _serve_closed_loop()
    systems = {"empty FastAPI route": "empty", "fusedserve fused": "fused", "fusedserve unfused": "unfused"}
    header, checked = [], 0
    for line in (REPO / doc).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 1 and cells[1] in systems:
            header = cells
        m = re.fullmatch(
            r"(\d+) workers?, (\d+) connections?, (?:single-row )?(64-row )?(req/s|p50 ms|rows/s)", cells[0]
        )
        if not m:
            continue
        workers, conns, rows, metric = int(m[1]), int(m[2]), 64 if m[3] else 1, m[4]
        for column, cell in zip(header[1:], cells[1:], strict=True):
            case = run[systems[column], workers, rows, conns]
            value, p99 = re.fullmatch(r"([\d.,]+)(?: \(p99 ([\d.]+) ms\))?", cell).groups()
            assert value == case[metric], f"{doc}: {cell!r} ({line}): the run has {metric} {case[metric]}"
            assert p99 in (None, case["p99 ms"]), f"{doc}: {cell!r} ({line}): the run has p99 {case['p99 ms']}"
            checked += 1
    assert checked >= 9, f"{doc}: found only {checked} end-to-end figures"


def test_result_files_the_docs_and_code_cite_exist():
    cited = set()
    for path in [*(REPO / d for d in DOCS), *REPO.glob("kernels/*.py"), *REPO.glob("bench/**/*.py")]:
        # (not `git show REV:bench/results/...`: that file is in git, no longer in the tree)
        text = path.read_text()
        cited |= {(path, c) for c in re.findall(r"(?<!:)bench/results/([\w./-]+\.\w+)", text)}
        cited |= {(path, c) for c in re.findall(r"\]\((?:\.\./)*(?:bench/)?results/([\w./-]+\.\w+)\)", text)}
    missing = sorted(f"{p.relative_to(REPO)}: {c}" for p, c in cited if not (RESULTS / c).is_file())
    assert len(cited) >= 10 and not missing, missing


def test_every_committed_result_is_in_a_gpu_folder_and_in_the_index():
    """bench/results/<gpu>/ holds each GPU's results, and bench/README.md's index links every one of them (a result no
    document needs any more is deleted: git keeps it)."""
    index = (REPO / "bench" / "README.md").read_text()
    linked = set(re.findall(r"\]\(results/([\w./-]+)\)", index))
    files = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()}
    assert files, "no committed results"
    misplaced = sorted(f for f in files if f.count("/") != 1 or f"_{f.split('/')[0]}" not in f)
    assert not misplaced, f"not in the folder of their GPU: {misplaced}"
    assert not files - linked, f"not in bench/README.md's index: {sorted(files - linked)}"
