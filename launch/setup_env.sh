#!/usr/bin/env bash
# Take a fresh Debian machine (Python 3.11, root, no GPU) to a working hvd_scale environment in .venv/.
#
#   bash launch/setup_env.sh            # idempotent: fast when everything is already there
#
# Horovod 0.28.1 has no wheels on PyPI: its sdist is downloaded, checked against a pinned sha256,
# patched by launch/horovod_build_fix.py and built once (~15-20 minutes on 2 cores). The wheel is
# cached outside the repository, keyed by the Horovod, torch, TensorFlow and Python versions, so
# later set-ups (and CI runs on the same machine) only install it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_SCALE_VENV:-$ROOT/.venv}"
CACHE="${HVD_SCALE_CACHE:-$HOME/.cache/hvd_scale}"
PYTHON="${PYTHON:-python3.11}"

HOROVOD_VERSION=0.28.1
HOROVOD_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
TORCH_VERSION=2.13.0            # the CPU wheel on this machine's disk; never a CUDA build
TENSORFLOW_SPEC='tensorflow-cpu==2.21.*'

log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
start=$(date +%s)

# 1. Debian's OpenMPI: Horovod's MPI controller and mpi4py build against it.
if ! command -v mpicxx >/dev/null || ! command -v mpirun >/dev/null; then
    log "installing Debian's OpenMPI"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
fi
command -v cmake >/dev/null || NEED_CMAKE=1

# 2. The virtual environment and the frameworks.
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# One resolver run (each pip call costs seconds); torch is pinned in it, so nothing can
# resolve it to a (CUDA) build from PyPI.
"${PIP[@]}" install 'setuptools>=68' wheel ${NEED_CMAKE:+'cmake>=3.13'} \
    "torch==$TORCH_VERSION" "$TENSORFLOW_SPEC" 'numpy>=1.26' \
    pytest pytest-timeout hypothesis tqdm matplotlib tensorboard scikit-learn mnist1d \
    cffi cloudpickle psutil pyyaml packaging
# mpi4py from source, so it links Debian's OpenMPI (the one horovodrun --mpi uses).
if ! "$VENV/bin/python" -c 'import mpi4py' 2>/dev/null; then
    log "building mpi4py against OpenMPI"
    "${PIP[@]}" install --no-binary mpi4py mpi4py
fi

# 3. Horovod: the cached wheel, or build it.
TORCH_V=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
TF_V=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))')
PY_V=$("$VENV/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
KEY="horovod-$HOROVOD_VERSION-torch-$TORCH_V-tf-$TF_V-py$PY_V-fix-$(sha256sum "$ROOT/launch/horovod_build_fix.py" | cut -c1-12)"
WHEEL_DIR="$CACHE/wheels/$KEY"
installed=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true)
if [ "$installed" != "$HOROVOD_VERSION" ] || [ ! -f "$VENV/.horovod-key" ] || [ "$(cat "$VENV/.horovod-key")" != "$KEY" ]; then
    if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
        log "no cached Horovod wheel for $KEY: building it (takes ~15-20 minutes on 2 cores)"
        build=$(mktemp -d)
        trap 'rm -rf "$build"' EXIT
        "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
        sdist="$build/horovod-$HOROVOD_VERSION.tar.gz"
        echo "$HOROVOD_SHA256  $sdist" | sha256sum -c --quiet -
        tar xzf "$sdist" -C "$build"
        "$VENV/bin/python" "$ROOT/launch/horovod_build_fix.py" "$build/horovod-$HOROVOD_VERSION"
        mkdir -p "$build/wheel"
        (
            cd "$build/horovod-$HOROVOD_VERSION"
            export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
                   HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1
            export MAKEFLAGS="-j$(nproc)"
            # --no-build-isolation: an isolated build cannot see torch ("Could NOT find Pytorch").
            PATH="$VENV/bin:$PATH" "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$build/wheel" . \
                > "$build/build.log" 2>&1 || { tail -50 "$build/build.log"; exit 1; }
        )
        mkdir -p "$WHEEL_DIR"
        cp "$build"/wheel/horovod-*.whl "$WHEEL_DIR/"
        log "cached $(ls "$WHEEL_DIR")"
    fi
    log "installing Horovod from $WHEEL_DIR"
    "${PIP[@]}" install --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
    echo "$KEY" > "$VENV/.horovod-key"
fi

# 4. The project itself, editable.
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

# What Horovod was built with (tests/test_environment.py checks the same, thoroughly).
"$VENV/bin/python" - <<'PY'
import horovod
import horovod.torch as hvd
print(f"horovod {horovod.__version__}: PyTorch, Gloo {hvd.gloo_built()}, MPI {hvd.mpi_built()}, NCCL {hvd.nccl_built()}")
PY
log "environment ready in $(( $(date +%s) - start )) s"
