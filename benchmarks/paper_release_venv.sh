#!/usr/bin/env bash
# A venv holding the ByteCheckpoint paper authors' own release (PyPI bytecheckpoint==0.0.2), the peer of
# benchmarks/bench_paper_release.py. Its import name is also `bytecheckpoint`, so it cannot share a venv
# with ours.
#
#   bash benchmarks/paper_release_venv.sh [VENV_DIR]      # default /work/paper_release_venv
#
# torch is always pinned to the CPU build our venv uses (2.13.0, a wheel on this disk): an unpinned
# `torch` would make pip resolve a multi-GB CUDA build. The release pins torch<=2.5, hence --no-deps
# for it and its needs listed by hand (those its modules import).
set -euo pipefail

VENV="${1:-/work/paper_release_venv}"
TORCH="torch==2.13.0"

python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" "$TORCH"
"${PIP[@]}" --no-deps "bytecheckpoint==0.0.2"
# Its declared needs, within its own pins (grpcio and protobuf exactly: its generated gRPC stubs), with
# --no-deps so none of them may pull torch; fsspec and typing_extensions are what these need in turn.
"${PIP[@]}" --no-deps numpy "mmh3>=4.1.0,<=4.2.0" "universal-pathlib>=0.2.2,<=1.0.0" fsspec \
    "cachetools>=5.4.0,<=10.0.0" "safetensors>=0.4.5,<=1.0.0" "grpcio==1.69.0" "protobuf==3.20.3" \
    typing_extensions
"$VENV/bin/python" -c "import bytecheckpoint as b, torch; print(b.__version__, b.__file__, torch.__version__)"
