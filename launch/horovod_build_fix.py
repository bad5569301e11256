"""Patch an unpacked Horovod 0.28.1 source tree so it builds against torch 2.13 and TensorFlow 2.21.

Horovod 0.28.1 (June 2023) is the last release and predates both frameworks. Each edit below
replaces one exact piece of text and fails loudly if that text is not there, so a different
Horovod source can never be half-patched in silence.

Usage: python horovod_build_fix.py SOURCE_DIR
"""

from __future__ import annotations

import pathlib
import sys

# (file, old text, new text, why)
EDITS = [
    (
        "horovod/torch/CMakeLists.txt",
        "    set(CMAKE_CXX_STANDARD 14)\n",
        "    # hvd_scale fix: torch >= 2.1 headers stop with '#error C++17 or later compatible\n"
        "    # compiler is required to use PyTorch'.\n"
        "    set(CMAKE_CXX_STANDARD 17)\n",
        "torch 2.13 needs C++17",
    ),
    (
        "horovod/torch/CMakeLists.txt",
        "    if (Pytorch_CXX11)\n        list(APPEND PYTORCH_LINKER_LIBS gloo)\n",
        "    # hvd_scale fix: compiled as C++17, the torch library must link the C++17 copy of Gloo\n"
        "    # that Horovod already builds for TensorFlow >= 2.10; linking the C++14 'gloo' gives\n"
        "    # 'multiple definition of gloo::rendezvous::Store::kDefaultTimeout'. The C++17 copy\n"
        "    # exists only when TensorFlow >= 2.10 is built too, as hvd_scale always does.\n"
        "    if (Pytorch_CXX11 AND Tensorflow_CXX17 AND Tensorflow_CXX11)\n"
        "        list(APPEND PYTORCH_LINKER_LIBS compatible17_gloo)\n"
        "    elseif (Pytorch_CXX11)\n        list(APPEND PYTORCH_LINKER_LIBS gloo)\n",
        "link the C++17 Gloo into the torch library",
    ),
    (
        "horovod/tensorflow/CMakeLists.txt",
        'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n',
        "# hvd_scale fix: xla_mpi_ops.cc includes XLA headers that need highwayhash/arch_specific.h,\n"
        "# which the TensorFlow 2.21 wheel does not ship. Those ops only serve GPU XLA builds.\n",
        "drop the XLA ops (missing headers in the TF 2.21 wheel)",
    ),
]

MARKER = ".hvd_scale_build_fix"


def apply_edits(source_dir: pathlib.Path, edits) -> list[str]:
    """Make ``edits`` ((file, old text, new text, why), ...) in ``source_dir``; return a line for
    each. Raises ValueError where an old text is not there exactly once (the one patch loop: the
    builder's own edits, launch/build_horovod.py's TORCH_ONLY_EDITS, go through it too)."""
    done = []
    for rel, old, new, why in edits:
        path = source_dir / rel
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise ValueError(f"expected the text to replace exactly once in {rel} ({why}), "
                             f"found it {count} times: is this Horovod 0.28.1?")
        path.write_text(text.replace(old, new))
        done.append(f"patched {rel}: {why}")
    return done


def apply(source_dir: pathlib.Path) -> None:
    if (source_dir / MARKER).exists():
        print(f"build fix already applied in {source_dir}")
        return
    try:
        for line in apply_edits(source_dir, EDITS):
            print(line)
    except ValueError as e:
        raise SystemExit(f"horovod_build_fix: {e}") from None
    (source_dir / MARKER).write_text("applied\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python horovod_build_fix.py SOURCE_DIR")
    apply(pathlib.Path(sys.argv[1]))
