"""#48 item 10: the site's search stayed at "Initializing search" when the built site was opened
from its files (file://: the browser refuses the search its index and worker). ``make docs-serve``
serves it on this machine (127.0.0.1), where the search's index is fetched like any page; README
says to open it there."""

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
# The set-up stamp counts as up to date here: the test serves the site, it does not set up .venv.
NO_SETUP = ["-o", ".venv/.hvd_scale_ready"]


def test_docs_serve_listens_on_this_machine_only_by_default():
    dry = subprocess.run(["make", "-n", *NO_SETUP, "docs-serve"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"mkdocs serve .*-a 127\.0\.0\.1:8000\b", dry.stdout), dry.stdout


def test_readme_says_where_to_open_the_site():
    assert "make docs-serve" in README and "http://127.0.0.1:8000/" in README
    assert "Initializing search" in README
    assert "then `site/index.html`" not in README  # the advice that left the search dead


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200, url
        return response.read()


@pytest.mark.timeout(300)
def test_docs_serve_serves_the_pages_and_the_search_index():
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    port = _free_port()
    proc = subprocess.Popen(["make", *NO_SETUP, "docs-serve", f"DOCS_ADDR=127.0.0.1:{port}"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline, page = time.monotonic() + 240, None
        while page is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                page = _get(base).decode()
            except OSError:
                time.sleep(1)
        assert page is not None, f"no site at {base}:\n{proc.stdout.read() if proc.poll() is not None else ''}"
        assert "hvd_scale" in page and 'data-md-component="search"' in page
        index = json.loads(_get(base + "search/search_index.json"))
        assert {"elastic.html", "getting-started.html"} <= {d["location"] for d in index["docs"]}
        assert _get(base + "elastic.html")
    finally:
        # SIGINT, as Ctrl-C: mkdocs serve removes its temporary site and the API source tree
        # (docs/hooks.py, at exit); SIGTERM would leave both in /tmp.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
