"""What a worker under tests/workers/ uses to report to the test (parsed by hvdrun.worker_results).

    from _report import emit_result, error_of
    emit_result(rank=hvd.rank(), size=hvd.size(), value=[...])
    emit_result(rank=hvd.rank(), error=error_of(lambda: make_something_bad()))

Prints one ``RESULT {json}`` line (another tag with ``tag=``) and flushes. Kept free of heavy
imports so that workers stay quick to start.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Mapping


def emit_result(payload: Mapping[str, Any] | None = None, tag: str = "RESULT", **fields: Any) -> None:
    data = dict(payload or {}, **fields)
    if "rank" not in data:
        raise ValueError("a worker result needs a 'rank' field")
    # One write, newline included: print() writes the text and its newline separately, and
    # under PYTHONUNBUFFERED=1 OpenMPI can then tag them as two chunks (hvdrun copes either way).
    sys.stdout.write(f"{tag} {json.dumps(data, sort_keys=True)}\n")
    sys.stdout.flush()


def error_of(make: Callable[[], Any]) -> str | None:
    """'Type: message' of the exception make() raises (None when it raises none): what each rank
    saw is the result."""
    try:
        make()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None
