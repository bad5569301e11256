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
    assert readers == ["spec.py"]


def test_the_engine_has_no_import_circle():
    """#47: state.py imported policies.py (for parse_spec), which imports state.py. Every
    import between the engine's modules, lazy ones included, goes one way."""
    edges = {}
    for path in sorted(ENGINE.glob("*.py")):
        tree = ast.parse(path.read_text())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    targets.add(node.module.split(".")[0])
                else:
                    targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hvd_scale."):
                targets.add(node.module.split(".")[1])
        edges[path.stem] = targets & {p.stem for p in ENGINE.glob("*.py")}

    def reaches(start, goal, seen=()):
        return any(t == goal or (t not in seen and reaches(t, goal, seen + (t,)))
                   for t in edges.get(start, ()))

    circles = sorted(m for m in edges if m != "__init__" and reaches(m, m))
    assert circles == []
    assert "policies" in edges["run"] and "spec" not in edges["state"]  # the test reads imports


def test_importing_the_engine_loads_no_framework():
    code = ("import sys, hvd_scale, hvd_scale.estimate, hvd_scale.guard, hvd_scale.metrics, "
            "hvd_scale.moments, hvd_scale.policies, hvd_scale.reduce, hvd_scale.schedules, "
            "hvd_scale.run, hvd_scale.spec; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod', 'tensorboardX', "
            "'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
