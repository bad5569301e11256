"""What a worker under tests/workers/ uses to report to the test (parsed by hvdrun.worker_results).

    from _report import emit_result, error_of
    emit_result(rank=hvd.rank(), size=hvd.size(), value=[...])
    emit_result(rank=hvd.rank(), error=error_of(lambda: make_something_bad()))

Prints one ``RESULT {json}`` line (another tag with ``tag=``) with hvd_scale.launch.jobs'
print_result (one write), after checking that it holds the worker's rank.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from hvd_scale.launch.jobs import RESULT_TAG, print_result


def emit_result(payload: Mapping[str, Any] | None = None, tag: str = RESULT_TAG,
                **fields: Any) -> None:
    data = dict(payload or {}, **fields)
    if "rank" not in data:
        raise ValueError("a worker result needs a 'rank' field")
    print_result(data, tag)


def error_of(make: Callable[[], Any]) -> str | None:
    """'Type: message' of the exception make() raises (None when it raises none): what each rank
    saw is the result."""
    try:
        make()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None
