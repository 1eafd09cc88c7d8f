"""A local HTTP server that answers as the Hugging Face Hub does, for the calls huggingface_hub
makes in hf_hub_download and HfApi.model_info (nothing else):

  HEAD/GET /ORG/REPO/resolve/REV/FILE   a small (git) file: 200 with ETag = its git blob SHA-1;
                                        an LFS file: 302 to the CDN (another origin), with
                                        X-Linked-Etag = its SHA-256 and X-Linked-Size;
                                        X-Repo-Commit on both
  GET  CDN/SHA256                       an LFS file's bytes
  GET  /api/models/ORG/REPO[/revision/REV]?blobs=true   the repository's listing (siblings with
                                        size, blobId and lfs.sha256)
Errors carry X-Error-Code as the hub's do: RepoNotFound (401, as the hub answers for a repository
it will not say exists), RevisionNotFound and EntryNotFound (404).

`served` lets a test serve other bytes than the ones the checksums describe (a corrupted download);
`delay_s` makes every answer wait that long (a slow hub, there all the same).
"""

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubFile:
    data: bytes
    lfs: bool
    served: bytes | None = None  # what the server sends instead of `data`, if set

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, HubFile]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) as received, hub and CDN
        self.delay_s = 0.0
        self.hub = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(cdn=False))
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(cdn=True))
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def add(self, repo: str, name: str, data: bytes, lfs: bool = True, served: bytes | None = None) -> HubFile:
        f = self.repos.setdefault(repo, {})[name] = HubFile(data, lfs, served)
        return f

    def __enter__(self) -> "FakeHub":
        for server in (self.hub, self.cdn):
            threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    def _handler(self, cdn: bool) -> type[BaseHTTPRequestHandler]:
        """The request handler of the hub (cdn=False) or of its CDN, answering from this hub."""
        return type("Handler", (_Handler,), {"hub": self, "cdn": cdn})


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    cdn: bool

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _send(self, status: int, headers: dict[str, str], payload: bytes, body: bool) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(payload)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def _error(self, status: int, code: str, body: bool, commit: bool = False) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"}
        if commit:
            headers["X-Repo-Commit"] = COMMIT
        self._send(status, headers, json.dumps({"error": code}).encode(), body)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, ("cdn" if self.cdn else "") + path))
        time.sleep(self.hub.delay_s)
        if self.cdn:
            return self._blob(path.strip("/"), body)
        for pattern, route in HUB_ROUTES:
            m = re.fullmatch(pattern, path)
            if m:
                return route(self, *m.groups(), body=body)
        return self._send(404, {}, b"", body)

    def _blob(self, sha256: str, body: bool) -> None:
        """The CDN: an LFS file's bytes, by their SHA-256."""
        f = next((f for files in self.hub.repos.values() for f in files.values() if f.lfs and f.sha256 == sha256),
                 None)
        if f is None:
            return self._send(404, {}, b"", body)
        return self._send(200, {"Content-Type": "application/octet-stream"}, f.served or f.data, body)

    def _unknown(self, repo: str, revision: str, body: bool) -> bool:
        """Answers the hub's error for a repository or revision it does not have (True), or nothing."""
        if repo not in self.hub.repos:
            self._error(401, "RepoNotFound", body)
        elif revision not in ("main", COMMIT):
            self._error(404, "RevisionNotFound", body)
        else:
            return False
        return True

    def _resolve(self, repo: str, revision: str, name: str, body: bool) -> None:
        """One file: a git file's bytes, or an LFS file's redirect to the CDN."""
        if self._unknown(repo, revision, body):
            return None
        f = self.hub.repos[repo].get(name)
        if f is None:
            return self._error(404, "EntryNotFound", body, commit=True)
        if f.lfs:
            return self._send(302, {"Location": f"{self.hub.cdn_url}/{f.sha256}", "X-Repo-Commit": COMMIT,
                                    "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(len(f.data)),
                                    "ETag": f'"{git_sha1(f.data)}"'}, b"", body)
        return self._send(200, {"ETag": f'"{git_sha1(f.data)}"', "X-Repo-Commit": COMMIT}, f.served or f.data, body)

    def _listing(self, repo: str, revision: str | None, body: bool) -> None:
        """The repository's listing at a revision (main when the path names none)."""
        if self._unknown(repo, revision or "main", body):
            return None
        siblings = []
        for name, f in self.hub.repos[repo].items():
            sibling = {"rfilename": name, "size": len(f.data), "blobId": git_sha1(f.data)}
            if f.lfs:
                sibling["lfs"] = {"size": len(f.data), "sha256": f.sha256, "pointerSize": 134}
            siblings.append(sibling)
        doc = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}
        return self._send(200, {"Content-Type": "application/json"}, json.dumps(doc).encode(), body)


# The hub's paths, tried in order: each pattern's groups are its route's arguments.
HUB_ROUTES: list[tuple[str, Callable[..., None]]] = [
    (r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", _Handler._listing),
    (r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", _Handler._resolve),
]
