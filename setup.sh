#!/usr/bin/env bash
# Set up fusedserve in ./.venv:  ./setup.sh          (to serve)
#                                ./setup.sh --test   (also test tools, Debian's prometheus and haproxy, for the tests)
#
# torch comes first and deliberately: with a GPU, PyPI's default (CUDA) build; without one, a CPU
# build and never the multi-GB CUDA one. The CPU build is `torch==2.13.0+cpu` where pip can find it
# (this project's dev and CI machines carry it locally); elsewhere set FUSEDSERVE_TORCH_INDEX_URL to
# PyTorch's CPU wheel index, or install a torch into .venv yourself first: an installed torch is kept.
set -euo pipefail
cd "$(dirname "$0")"

with_tests=0
case "${1:-}" in
  --test) with_tests=1 ;;
  "") ;;
  *) echo "usage: ./setup.sh [--test]" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
# A second run over a .venv this script set up for the same pyproject.toml and setup.sh (the README's test command
# runs it before every test run; CI after its own first run) has nothing to install: ~25 s of pip's resolving and
# torch's imports, skipped. Remove the stamp to install again (a newer tritonclient, say).
stamp=.venv/.fusedserve-setup
want=$(cat pyproject.toml setup.sh | sha256sum | cut -c1-16)
# This project's own modules compiled to bytecode, as pip compiles what it installs (an editable install is not):
# where PYTHONDONTWRITEBYTECODE=1 (CI's machine sets it) every process would otherwise compile them from source on
# each start, 0.65 CPU-s of an engine's 3.3 and ~0.1 of each other process, over ~300 processes in the test suite.
# 1.8 CPU-s for all of them; files already compiled and unchanged are skipped. Stale files are never read (Python
# checks each source's size and time).
compile_project() { .venv/bin/python -m compileall -q -j 0 service kernels fusedserve bench tools tests >/dev/null; }
tools_found() { command -v prometheus >/dev/null 2>&1 && { command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; }; }
if [ -x .venv/bin/python ] && [ -f "$stamp" ]; then
  read -r have have_tests < "$stamp" || true
  if [ "$have" = "$want" ] && [ "${have_tests:-0}" -ge "$with_tests" ] && { [ "$with_tests" = 0 ] || tools_found; }; then
    compile_project
    echo "setup: .venv is set up for this pyproject.toml$([ "$with_tests" = 1 ] && echo ' with the test tools'); nothing to install ($stamp: remove it to install again)"
    exit 0
  fi
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

if .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: keeping installed torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: GPU found; installing torch (CUDA build)"
  "${pip[@]}" install torch
elif [ -n "${FUSEDSERVE_TORCH_INDEX_URL:-}" ]; then
  echo "setup: no GPU; installing CPU torch from $FUSEDSERVE_TORCH_INDEX_URL"
  "${pip[@]}" install --index-url "$FUSEDSERVE_TORCH_INDEX_URL" torch
elif "${pip[@]}" install "torch==2.13.0+cpu" 2>/dev/null; then
  echo "setup: no GPU; installed torch 2.13.0+cpu"
else
  echo "setup: no GPU, and no CPU build of torch found. Set FUSEDSERVE_TORCH_INDEX_URL to PyTorch's CPU" >&2
  echo "       wheel index (see pytorch.org, 'Get started'), or pip install a CPU torch into .venv first." >&2
  exit 1
fi

if [ "$with_tests" = 1 ]; then
  "${pip[@]}" install -e ".[test]"
  # The latest tritonclient, as `pip install "tritonclient[http,grpc]"` (docs/api.md) gets it for a user, beside the
  # service: its grpc extra pins protobuf (2.73: >=6.30,<7), and the gRPC tests run against what it pulls.
  "${pip[@]}" install --upgrade "tritonclient[http,grpc]"
  # Debian's prometheus (with promtool) and haproxy: the tests start real ones on loopback.
  missing=()
  command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "setup: installing Debian's ${missing[*]} (the tests start real ones on loopback)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
      echo "setup: ${missing[*]} not found and cannot apt-get it; the tests that need it will skip" >&2
    fi
  fi
else
  "${pip[@]}" install -e .
fi
compile_project
echo "$want $with_tests" > "$stamp"
echo "setup: done ($(.venv/bin/python -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.cuda.is_available()}")'))"
