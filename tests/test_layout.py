"""Issue #23, 4: the engine (``hvd_scale/``) imports numpy, the standard library and, lazily
for its MPI reducer, mpi4py only: no framework, no logger library, no environment read."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ENGINE = pathlib.Path(__file__).resolve().parent.parent / "hvd_scale"
ALLOWED = set(sys.stdlib_module_names) | {"numpy", "__future__"}


def imports(tree):
    """(top-level module, at module level?) for every import in a module."""
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name.split(".")[0], id(node) in top


def test_engine_modules_import_numpy_and_the_standard_library_only():
    found = {}
    for path in sorted(ENGINE.glob("*.py")):
        for module, module_level in imports(ast.parse(path.read_text())):
            if module not in ALLOWED and not (module == "mpi4py" and not module_level):
                found.setdefault(path.name, []).append(module)
    assert found == {}
    # The environment is read at the edges: the engine reads only $HVD_SCALE_POLICY, where
    # make_policy(None) documents it (its public default, kept for engine-only users).
    readers = sorted(p.name for p in ENGINE.glob("*.py") if "os.environ" in p.read_text())
    assert readers == ["policies.py"]


def test_importing_the_engine_loads_no_framework():
    code = ("import sys, hvd_scale, hvd_scale.estimate, hvd_scale.guard, hvd_scale.metrics, "
            "hvd_scale.moments, hvd_scale.policies, hvd_scale.reduce, hvd_scale.schedules; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod', 'tensorboardX', "
            "'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
