# SPDX-License-Identifier: Apache-2.0
"""One pinned file from the package indexes pip is configured with.

``pip download`` cannot fetch vLLM's source distribution without building it (it
prepares the sdist's metadata, which needs vLLM's build requirements), so this
reads the indexes the way pip does and downloads the one file:

* the sources are pip's own configuration (``pip config list``: files and
  ``PIP_*`` variables): ``index-url`` (default ``https://pypi.org/simple``),
  ``extra-index-url``, ``find-links``, ``no-index``, ``cert`` and ``proxy``;
* an index is a simple repository (PEP 503 HTML or PEP 691 JSON, asked for by
  content negotiation), ``https://`` or ``file://``; a find-links entry is a
  folder or an HTML page of links;
* the file is checked against its pinned sha256 while it downloads, and only a
  checked file is kept.

``fetch_pinned`` tries ``$<override_env>`` first, then the cache, then every
source; when all fail, :class:`FileUnavailable` says what each source answered
and how to provide the file by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"
# PEP 691: JSON preferred, the PEP 503 HTML page accepted.
ACCEPT = (
    "application/vnd.pypi.simple.v1+json, "
    "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
)


class FileUnavailable(RuntimeError):
    """No source gave the pinned file; the message says what each answered."""


@dataclass
class PipSources:
    """Where pip looks for distributions, read from pip's configuration."""

    indexes: list[str] = field(default_factory=list)
    find_links: list[str] = field(default_factory=list)
    cafile: str | None = None
    proxy: str | None = None


def _pip_option(config: dict[str, str], name: str) -> str | None:
    # pip's precedence: PIP_* variables, then the command's section, then
    # [global] (files already merged by `pip config list`, later files winning).
    for section in (":env:", "download", "global"):
        value = config.get(f"{section}.{name}")
        if value is not None:
            return value
    return None


def pip_sources(python: str = sys.executable) -> PipSources:
    """The indexes, find-links, CA bundle and proxy that ``python -m pip
    download`` would use here."""
    done = subprocess.run(
        [python, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    if done.returncode != 0:
        raise FileUnavailable(f"`{python} -m pip config list` failed:\n{done.stderr}")
    config = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip().strip("'\"")
    no_index = (_pip_option(config, "no-index") or "").lower() in (
        "1",
        "true",
        "yes",
        "on",
    )
    indexes = []
    if not no_index:
        indexes.append(_pip_option(config, "index-url") or DEFAULT_INDEX)
        indexes += (_pip_option(config, "extra-index-url") or "").split()
    return PipSources(
        indexes=indexes,
        find_links=(_pip_option(config, "find-links") or "").split(),
        cafile=_pip_option(config, "cert"),
        proxy=_pip_option(config, "proxy"),
    )


def normalize(project: str) -> str:
    """PEP 503 project name normalization."""
    return re.sub(r"[-_.]+", "-", project).lower()


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href, self._text = dict(attrs).get("href"), []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _file_path(url: str) -> Path | None:
    if url.startswith("file:"):
        return Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    if "://" not in url:
        return Path(url)
    return None


class _Fetcher:
    def __init__(self, sources: PipSources, timeout: float):
        context = ssl.create_default_context(cafile=sources.cafile or None)
        handlers: list[urllib.request.BaseHandler] = [
            urllib.request.HTTPSHandler(context=context)
        ]
        if sources.proxy:
            handlers.append(
                urllib.request.ProxyHandler(
                    {"http": sources.proxy, "https": sources.proxy}
                )
            )
        self.opener = urllib.request.build_opener(*handlers)
        self.timeout = timeout

    def open(self, url: str, accept: str | None = None):
        path = _file_path(url)
        if path is not None and path.is_dir():
            # pip reads a file:// index's folder as its index.html.
            url = (path / "index.html").as_uri()
        request = urllib.request.Request(
            url, headers={"Accept": accept} if accept else {}
        )
        return self.opener.open(request, timeout=self.timeout)

    def listing(self, page_url: str) -> dict[str, tuple[str, str | None]]:
        """filename -> (absolute url, sha256 the page gives or None)."""
        with self.open(page_url, ACCEPT) as reply:
            ctype = reply.headers.get("Content-Type", "")
            final_url = reply.geturl()
            body = reply.read()
        files = {}
        if "json" in ctype:
            for entry in json.loads(body).get("files", []):
                url = urllib.parse.urljoin(final_url, entry["url"])
                files[entry["filename"]] = (url, entry.get("hashes", {}).get("sha256"))
            return files
        parser = _Links()
        parser.feed(body.decode("utf-8", "replace"))
        for href, text in parser.links:
            url, _, fragment = urllib.parse.urljoin(final_url, href).partition("#")
            name = urllib.parse.unquote(url.rsplit("/", 1)[-1]) or text
            digest = (
                fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
            )
            files[name] = (url, digest)
        return files


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_pinned(
    project: str,
    filename: str,
    sha256: str,
    dest_dir: Path,
    override_env: str,
    sources: PipSources | None = None,
    timeout: float = 300.0,
) -> Path:
    """``dest_dir/filename``, checked against ``sha256``, downloaded if absent.

    Args:
        project: the distribution's project name on the index (``"vllm"``).
        filename: the file's name as the index lists it (``"vllm-0.32.0.tar.gz"``).
        sha256: the pinned digest; a file that does not match is never used.
        dest_dir: the cache folder; the checked file is kept there.
        override_env: an environment variable that may name the file by hand.
        sources: where to look (default: :func:`pip_sources`).
        timeout: seconds per connection.

    Raises:
        FileUnavailable: no source gave the file; the message lists what each
            source answered and how to provide the file.
    """
    given = os.environ.get(override_env)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise FileUnavailable(f"${override_env}={given} is not a file")
        got = _sha256(path)
        if got != sha256:
            raise FileUnavailable(
                f"${override_env}={given}: sha256 {got} is not the pinned {sha256}"
            )
        return path
    path = dest_dir / filename
    if path.is_file() and _sha256(path) == sha256:
        return path
    sources = sources if sources is not None else pip_sources()
    fetcher = _Fetcher(sources, timeout)
    tried: list[str] = []

    def download(url: str) -> Path | None:
        dest_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        h = hashlib.sha256()
        try:
            with fetcher.open(url) as reply, open(partial, "wb") as out:
                for chunk in iter(lambda: reply.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
        except (OSError, urllib.error.URLError) as e:
            partial.unlink(missing_ok=True)
            tried.append(f"{url}: {e}")
            return None
        if h.hexdigest() != sha256:
            partial.unlink()
            tried.append(f"{url}: sha256 {h.hexdigest()} is not the pinned one")
            return None
        partial.replace(path)
        return path

    def listed(page: str, label: str) -> tuple[str, str | None] | None:
        """(url, listed sha256) of ``filename`` on a simple page, else None."""
        try:
            files = fetcher.listing(page)
        except (OSError, urllib.error.URLError, ValueError) as e:
            tried.append(f"{page}{label}: {e}")
            return None
        if filename not in files:
            tried.append(f"{page}{label}: does not list {filename}")
            return None
        return files[filename]

    for link in sources.find_links:
        local = _file_path(link)
        if local is not None and local.is_dir():
            candidate = local / filename
            if candidate.is_file() and _sha256(candidate) == sha256:
                return candidate
            tried.append(f"{link} (find-links folder): no {filename} with that sha256")
            continue
        found = listed(link, " (find-links)")
        if found is not None and download(found[0]) is not None:
            return path
    for index in sources.indexes:
        page = f"{index.rstrip('/')}/{normalize(project)}/"
        found = listed(page, "")
        if found is None:
            continue
        url, digest = found
        if digest is not None and digest != sha256:
            tried.append(
                f"{page}: lists {filename} with sha256 {digest}, not the pinned one"
            )
            continue
        if download(url) is not None:
            return path
    where = (
        "\n".join(f"  {line}" for line in tried)
        or "  (pip is configured with no index)"
    )
    raise FileUnavailable(
        f"could not get {filename} (sha256 {sha256}) from the sources pip is "
        f"configured with:\n{where}\n"
        f"Provide it by hand: download {filename} from any mirror of the package "
        f"index, then set {override_env}=/path/to/{filename} or put it in {dest_dir}/"
    )
