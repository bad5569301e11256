"""The machine a stored run ran on, for every result writer: ``machine()`` returns a dict.

Per-seed figures hold per machine: the same code (e45008d's) gave B1's S = 16 seed 0 96.00% in
685 steps in one stored rerun and 96.75% in 673 steps on another machine of the same kind (the
CPU's instruction set picks torch's kernels, whose float sums differ in their last bits, and a
training run amplifies that). What carries over between machines is the seeds' spread, so each
stored run says where it ran.

    python benchmarks/machine.py          # prints this machine's record as JSON

Standard library only; torch's threads are read only where torch is already imported (a numpy
benchmark does not pay torch's import for it), or asked for with ``torch=True``.
"""

from __future__ import annotations

import json
import os
import platform
import sys

# The x86 / Arm instruction-set extensions that pick a numeric library's kernels (AVX-512 or AVX2
# in torch's and numpy's dispatch, AMX for bf16 matmuls, NEON / SVE on Arm).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16", "neon", "asimd", "sve", "sve2")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(torch: bool | None = None) -> dict:
    """This machine, as a stored run records it: CPU model, the instruction-set extensions that
    pick kernels (``ISA_FLAGS`` present), logical CPUs, the load average when the run was
    recorded, Python, numpy, and torch's version and intra-/inter-op threads (``torch``: None
    reads them only if torch is already imported, True imports it, False never)."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    record = {
        "cpu": info.get("model name") or info.get("Processor") or platform.processor() or "unknown",
        "isa": [f for f in ISA_FLAGS if f in flags],
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "load": _load(),
        "python": platform.python_version(),
    }
    if "numpy" in sys.modules or torch is not False:
        try:
            import numpy

            record["numpy"] = numpy.__version__
        except ImportError:
            pass
    if torch or (torch is None and "torch" in sys.modules):
        try:
            import torch as _torch

            record["torch"] = _torch.__version__
            record["torch_threads"] = _torch.get_num_threads()
            record["torch_interop_threads"] = _torch.get_num_interop_threads()
        except ImportError:
            pass
    return record


def describe(record: dict) -> str:
    """One line for a report: 'Intel(R) Xeon(R) Processor (avx2, avx512f, ...), 2 CPUs, load
    0.3 / 0.6 / 1.2, torch 2.13.0 (2 threads)'."""
    isa = ", ".join(f for f in record.get("isa", []) if f.startswith(("avx", "amx", "sve")))
    text = f"{record.get('cpu', 'unknown')} ({isa or record.get('arch', '?')}), {record.get('cpus')} CPUs"
    if record.get("load"):
        text += ", load " + " / ".join(f"{x:.1f}" for x in record["load"])
    if "torch" in record:
        text += f", torch {record['torch']} ({record['torch_threads']} threads)"
    elif "numpy" in record:
        text += f", numpy {record['numpy']}"
    return text


if __name__ == "__main__":
    print(json.dumps(machine(torch=True), indent=1))
