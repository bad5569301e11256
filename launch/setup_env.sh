#!/usr/bin/env bash
# Take a fresh Debian machine (Python 3.11, root, no GPU) to a working hvd_scale environment in .venv/.
#
#   bash launch/setup_env.sh            # idempotent: fast when everything is already there
#
# Horovod 0.28.1 has no wheels on PyPI: launch/build_horovod.py downloads its sdist, checks it
# against a pinned sha256, patches it with launch/horovod_build_fix.py and builds it once (about
# 10 minutes on 2 cores). The wheel is cached outside the repository, keyed by the Horovod, torch,
# TensorFlow and Python versions and the fix, so later set-ups (and CI runs on the same machine)
# only install it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_SCALE_VENV:-$ROOT/.venv}"
CACHE="${HVD_SCALE_CACHE:-$HOME/.cache/hvd_scale}"
PYTHON="${PYTHON:-python3.11}"

# Horovod 0.28.1 and its sdist's sha256 are pinned in launch/build_horovod.py; the frameworks
# Horovod is built against here, below (pyproject.toml gives only their lowest versions); every
# other pin is in pyproject.toml, whose extras step 2 installs.
TORCH_VERSION=2.13.0            # the CPU wheel on this machine's disk; never a CUDA build
TENSORFLOW_SPEC='tensorflow-cpu==2.21.*'
# The extras the tests, benchmarks and examples use (`mpi` is left out: mpi4py is built below).
EXTRAS=torch,tensorflow,metrics,plot,ray,spark,bleu,docs,lightning,accelerate,dev

log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
start=$(date +%s)

# 1. Debian's packages: OpenMPI (Horovod's MPI controller and mpi4py build against it), an SSH
#    server (multi-host tests start their own sshd) and a Java runtime (pyspark), each only when
#    missing. No service is left running: Debian's postinst would start sshd.
APT=()
{ command -v mpicxx && command -v mpirun; } >/dev/null || APT+=(libopenmpi-dev openmpi-bin)
[ -x /usr/sbin/sshd ] || APT+=(openssh-server)
command -v java >/dev/null || APT+=(default-jre-headless)
# Headless Chromium: screenshots of the documentation site (docs/screenshots/, by hand).
command -v chromium >/dev/null || APT+=(chromium)
if [ ${#APT[@]} -gt 0 ]; then
    log "installing Debian's ${APT[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # policy-rc.d exiting 101 tells invoke-rc.d not to start services (Docker images have one).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -qq "${APT[@]}" >/dev/null
    # A package marked installed whose files were removed (a trimmed image) needs --reinstall.
    [ -x /usr/sbin/sshd ] || apt-get install -y -qq --reinstall openssh-server >/dev/null
    if [ "$(trap -p EXIT)" ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
    # Should a postinst have started sshd all the same, stop it.
    if [ -f /run/sshd.pid ] && kill -0 "$(cat /run/sshd.pid)" 2>/dev/null; then
        log "stopping the sshd that the installation started"
        kill "$(cat /run/sshd.pid)"
    fi
fi
command -v cmake >/dev/null || NEED_CMAKE=1

# 2. The virtual environment and the frameworks.
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# One resolver run (each pip call costs seconds): the project itself, editable, with its extras
# (pyproject.toml's dependencies include filelock and packaging, which step 3 needs); torch is
# pinned in it, so nothing can resolve it to a (CUDA) build from PyPI. setuptools and wheel are
# what Horovod's --no-build-isolation build uses; cffi, cloudpickle, psutil and pyyaml are
# Horovod's own requirements (here, they save step 3 a pip run).
"${PIP[@]}" install 'setuptools>=68' wheel ${NEED_CMAKE:+'cmake>=3.13'} \
    "torch==$TORCH_VERSION" "$TENSORFLOW_SPEC" -e "$ROOT[$EXTRAS]" \
    cffi cloudpickle psutil pyyaml
# mpi4py from source, so it links Debian's OpenMPI (the one horovodrun --mpi uses).
if ! "$VENV/bin/python" -c 'import mpi4py' 2>/dev/null; then
    log "building mpi4py against OpenMPI"
    "${PIP[@]}" install --no-binary mpi4py mpi4py
fi

# 3. Horovod: the cached wheel, or build it. launch/build_horovod.py (`hvd-scale build-horovod`)
# does it for any environment; here with both frameworks and MPI required. It keys the cache as
# horovod-0.28.1-torch-T-tf-TF-pyXY-fix-<sha256 of horovod_build_fix.py, 12 hex>, checks
# the sdist against its pinned sha256, and does nothing when $VENV/.horovod-key already matches.
"$VENV/bin/python" "$ROOT/launch/build_horovod.py" --with torch,tensorflow,mpi --cache-dir "$CACHE"

# What Horovod was built with (tests/test_environment.py checks the same, thoroughly).
"$VENV/bin/python" - <<'PY'
import horovod
import horovod.torch as hvd
print(f"horovod {horovod.__version__}: PyTorch, Gloo {hvd.gloo_built()}, MPI {hvd.mpi_built()}, NCCL {hvd.nccl_built()}")
PY
log "environment ready in $(( $(date +%s) - start )) s"
