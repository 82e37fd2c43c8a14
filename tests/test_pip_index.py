# SPDX-License-Identifier: Apache-2.0
"""scripts/pip_index.py: one pinned file from the indexes pip is configured with
(PEP 503 HTML over file://, PEP 691 JSON over HTTP, find-links folders), checked
by sha256, with an error that names every source tried and the override."""

from __future__ import annotations

import hashlib
import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from pip_index import FileUnavailable, PipSources, fetch_pinned, pip_sources  # noqa: E402

NAME = "demo_pkg-1.0.tar.gz"
DATA = b"the demo sdist\n" * 1000
PIN = hashlib.sha256(DATA).hexdigest()
ENV = "DDTREE_TEST_DEMO_FILE"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def _html_index(root: Path, data: bytes = DATA, listed: str | None = None) -> str:
    """A file:// simple index: simple/demo-pkg/index.html links ../../files/NAME
    (with ``#sha256=listed``, default the data's own digest)."""
    (root / "files").mkdir(parents=True)
    (root / "files" / NAME).write_bytes(data)
    page = root / "simple" / "demo-pkg"
    page.mkdir(parents=True)
    digest = listed or hashlib.sha256(data).hexdigest()
    (page / "index.html").write_text(
        f'<html><body><a href="../../files/{NAME}#sha256={digest}">{NAME}</a>'
        '<a href="../../files/other-2.0.tar.gz">other-2.0.tar.gz</a></body></html>')
    return (root / "simple").as_uri()


class _Index(http.server.BaseHTTPRequestHandler):
    """/good/: a PEP 691 JSON index (relative file URL); everything else 404."""

    accepts: list[str] = []

    def do_GET(self):
        if self.path == "/good/demo-pkg/":
            type(self).accepts.append(self.headers.get("Accept", ""))
            body = json.dumps({"meta": {"api-version": "1.1"}, "name": "demo-pkg",
                               "files": [{"filename": NAME, "url": f"../../files/{NAME}",
                                          "hashes": {"sha256": PIN}}]}).encode()
            ctype = "application/vnd.pypi.simple.v1+json"
        elif self.path == f"/files/{NAME}":
            body, ctype = DATA, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_index():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_html_index_over_file_url(tmp_path):
    index = _html_index(tmp_path / "repo")
    dest = tmp_path / "cache"
    got = fetch_pinned("Demo.Pkg", NAME, PIN, dest, ENV, PipSources(indexes=[index]))
    assert got == dest / NAME and got.read_bytes() == DATA
    # Cached: a second call needs no source at all.
    assert fetch_pinned("demo-pkg", NAME, PIN, dest, ENV, PipSources()) == got


def test_json_index_after_an_index_that_answers_404(tmp_path, http_index):
    # The reported failure: the first place asked answers 404; the next index
    # pip is configured with serves the file (PEP 691 JSON, relative URL).
    sources = PipSources(indexes=[f"{http_index}/pypi", f"{http_index}/good"])
    got = fetch_pinned("demo-pkg", NAME, PIN, tmp_path, ENV, sources)
    assert got.read_bytes() == DATA
    assert "application/vnd.pypi.simple.v1+json" in _Index.accepts[-1]


def test_find_links_folder(tmp_path):
    links = tmp_path / "wheels"
    links.mkdir()
    (links / NAME).write_bytes(DATA)
    got = fetch_pinned("demo-pkg", NAME, PIN, tmp_path / "cache", ENV,
                       PipSources(find_links=[str(links)]))
    assert got == links / NAME


def test_a_file_that_is_not_the_pinned_one_is_never_kept(tmp_path):
    dest = tmp_path / "cache"
    # The index lists another digest: refused before downloading.
    index = _html_index(tmp_path / "listed", data=b"other")
    with pytest.raises(FileUnavailable, match="lists .* not the pinned one"):
        fetch_pinned("demo-pkg", NAME, PIN, dest, ENV, PipSources(indexes=[index]))
    # The index lists the pinned digest but serves other bytes: refused after.
    index = _html_index(tmp_path / "lying", data=b"tampered", listed=PIN)
    with pytest.raises(FileUnavailable, match=f"{NAME}: sha256 .* not the pinned one"):
        fetch_pinned("demo-pkg", NAME, PIN, dest, ENV, PipSources(indexes=[index]))
    assert not dest.exists() or not any(dest.iterdir())


def test_the_error_names_every_source_and_how_to_provide_the_file(
        tmp_path, http_index, monkeypatch):
    empty = tmp_path / "empty-index"
    empty.mkdir()
    sources = PipSources(indexes=[f"{http_index}/pypi", empty.as_uri()],
                         find_links=[str(tmp_path)])
    dest = tmp_path / "cache"
    with pytest.raises(FileUnavailable) as failure:
        fetch_pinned("demo-pkg", NAME, PIN, dest, ENV, sources)
    message = str(failure.value)
    assert f"{http_index}/pypi/demo-pkg/: HTTP Error 404" in message
    assert f"{empty.as_uri()}/demo-pkg/" in message
    assert f"{tmp_path} (find-links folder)" in message
    assert ENV in message and str(dest) in message and PIN in message
    # The override it names is honoured (and checked).
    copy = tmp_path / "by-hand.tar.gz"
    copy.write_bytes(DATA)
    monkeypatch.setenv(ENV, str(copy))
    assert fetch_pinned("demo-pkg", NAME, PIN, dest, ENV, sources) == copy
    copy.write_bytes(b"other")
    with pytest.raises(FileUnavailable, match="not the pinned"):
        fetch_pinned("demo-pkg", NAME, PIN, dest, ENV, sources)


def test_pip_sources_reads_pip_configuration(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///srv/a file:///srv/b")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CERT", "/etc/ca.pem")
    got = pip_sources()
    assert got.indexes == ["https://mirror.example/simple", "file:///srv/a", "file:///srv/b"]
    assert got.find_links == [str(tmp_path)] and got.cafile == "/etc/ca.pem"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert pip_sources().indexes == []
