"""Ollama's model management on the same port: /api/pull, /api/create, /api/copy, /api/delete and
the blobs /api/create takes its files from (HEAD and POST /api/blobs/sha256:HEX), for Open
WebUI's model manager and `ollama pull` / `ollama create` / `ollama cp` / `ollama rm`.

    POST /api/pull    {"model"}: a package model, or ORG/REPO[/FILE] (also written hf.co/ORG/REPO...)
                      from the Hugging Face Hub through the same code as `scratchllm models pull`
                      (formats/hub.py: checksums checked), streamed as Ollama's status lines with
                      each file's total and completed bytes
    POST /api/create  {"model", "from" | "files", "system", "template", "parameters", "messages"},
                      or the older {"model", "modelfile"} (server/modelfile.py reads it)
    POST /api/copy    {"source", "destination"}: another name for a model
    DELETE /api/delete {"model"}: a name made here (a pulled model's files go with it)

Every name made here is kept in the user's names file (formats/names.py), so `models list`,
`serve NAME` and `generate NAME` know it too, and is served at once: a name for a model this
server serves shares its engine (an alias); a name for any other model is a new model, loaded
on its first request (`ModelRegistry.new_spec`). What a name adds (a system prompt, sampling
parameters by Ollama's names, earlier messages) is added to every request made through it, on
the OpenAI routes and Ollama's alike (`with_profile`): a request's own fields win. A chat
template (TEMPLATE) replaces the model's own for requests through the name. The API key guards
all of these as it does every /api/ route.
"""

import asyncio
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field
from tqdm import tqdm

from scratchllm.errors import ConfigError
from scratchllm.formats import names, refs, stores
from scratchllm.formats.names import Named
from scratchllm.server import modelfile
from scratchllm.server.errors import APIError, bad_request
from scratchllm.server.messages import Strict
from scratchllm.server.ollama_protocol import error_body, openai_fields
from scratchllm.server.protocol import parse_body
from scratchllm.server.registry import ModelRegistry, models_of

NDJSON = "application/x-ndjson"
HF_PREFIXES = ("hf.co/", "huggingface.co/")
PROGRESS_EVERY_S = 0.1  # a pull's progress lines, at most this often per file


class OllamaPullRequest(Strict):
    model: str | None = None
    name: str | None = None  # the older spelling
    insecure: bool = False
    stream: bool = True


class OllamaCreateRequest(Strict):
    model: str | None = None
    name: str | None = None
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, str]] | None = None
    modelfile: str | None = None
    quantize: str | None = None
    stream: bool = True


class OllamaCopyRequest(Strict):
    source: str
    destination: str


class OllamaDeleteRequest(Strict):
    model: str | None = None
    name: str | None = None


def _name_of(req: OllamaPullRequest | OllamaCreateRequest | OllamaDeleteRequest) -> str:
    name = req.model or req.name
    if not name:
        raise bad_request("'model' is required", param="model")
    return name


def blob_dir() -> Path:
    """Where /api/blobs keeps the files /api/create takes (beside the joined package models)."""
    return refs.cache_dir().parent / "blobs"


# ---- pull -------------------------------------------------------------------------------------------
def _lines(emit: Callable[[dict[str, Any]], None]) -> type[tqdm]:
    """A tqdm class (what huggingface_hub reports a download's bytes to) that emits Ollama's
    status lines: one when a file starts, then its completed bytes at most every 0.1 s, and at
    its end."""

    class Lines(tqdm):
        def __init__(self, *args: Any, label: str | None = None, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            self.label = label or str(kwargs.get("desc") or "model")
            self.goal = int(kwargs.get("total") or 0)
            self.done = int(kwargs.get("initial") or 0)
            self.last = 0.0
            super().__init__(*args, **{**kwargs, "disable": True})
            self._emit()

        def _emit(self) -> None:
            self.last = time.monotonic()
            emit({"status": f"pulling {self.label}", "digest": self.label, "total": self.goal,
                  "completed": self.done})

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            if time.monotonic() - self.last >= PROGRESS_EVERY_S:
                self._emit()
            return None

        def close(self) -> None:
            self._emit()
            super().close()

    return Lines


def _hub_ref(name: str) -> str | None:
    """ORG/REPO[/FILE] when `name` names one on the Hugging Face Hub, else None."""
    for prefix in HF_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):].replace(":", "/", 1) if ":" in name[len(prefix):] else name[len(prefix):]
    return name if name.count("/") >= 1 and not name.startswith(("/", ".", "~")) else None


def _pull(name: str, emit: Callable[[dict[str, Any]], None]) -> str:
    """Fetch `name` (the module doc), in a worker thread; the model reference it runs by."""
    from scratchllm.formats.hub import pull

    if name in refs.MODEL_PACKAGES or name in refs.JOINED_MODELS:
        try:
            refs.resolve_model(name)  # installed (a joined model: joined now, checked)
        except ConfigError as err:
            raise bad_request(str(err), param="model") from None
        return name
    ref = _hub_ref(name)
    if ref is None:
        raise bad_request(f"cannot pull '{name}': this server pulls the package models ("
                          f"{', '.join([*refs.MODEL_PACKAGES, *refs.JOINED_MODELS])}) and Hugging Face models "
                          "(ORG/REPO[/FILE], or hf.co/ORG/REPO[/FILE]), not Ollama's registry", param="model")
    emit({"status": "pulling manifest"})
    try:
        pulled = pull(ref, progress=_lines(emit))
    except ConfigError as err:
        raise APIError(400, str(err), param="model") from None
    emit({"status": "verifying sha256 digest"})
    return pulled.name


async def pull_route(request: Request) -> Response | dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaPullRequest, lenient=registry.config.lenient_fields)
    name = _name_of(req)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def emit(line: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, line)

    async def run() -> None:
        ref = await asyncio.to_thread(_pull, name, emit)
        queue.put_nowait({"status": "writing manifest"})
        if ref != name:
            names.save(Named(name, ref, origin="pull"))
        _serve(registry, name, ref)
        queue.put_nowait({"status": "success"})

    if not req.stream:
        await run()
        return {"status": "success"}
    task = asyncio.ensure_future(run())
    task.add_done_callback(lambda _: queue.put_nowait(None))

    async def lines() -> AsyncIterator[bytes]:
        try:
            while (line := await queue.get()) is not None:
                yield _line(line)
            if task.exception() is not None:
                err = task.exception()
                yield _line(error_body(err) if isinstance(err, APIError) else {"error": f"{type(err).__name__}: {err}"})
        finally:
            if not task.done():
                task.cancel()

    return StreamingResponse(lines(), media_type=NDJSON)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _not_started_with(registry: ModelRegistry, given: str) -> None:
    """A name the server was started with is not to be replaced (nor `NAME:latest` for it)."""
    for name in (given, given.removesuffix(":latest")):
        if name in registry.entries and name not in registry.added:
            raise APIError(409, f"'{name}' is a model this server was started with; give the new model another "
                                "name", param="model", code="model_exists")


def _served(registry: ModelRegistry, ref: str, name: str = "") -> str | None:
    """The served model `ref` is, following names of the user's (a name for a name), or None."""
    seen = {name}
    while ref not in registry.entries and (named := names.lookup(ref)) is not None and named.name not in seen:
        seen.add(named.name)
        ref = named.base
    return ref if ref in registry.entries else None


def _serve(registry: ModelRegistry, name: str, ref: str, named: Named | None = None) -> None:
    """Serve `name` from now on: the model `ref` is, an alias when this server serves it."""
    if name in registry.added:
        registry.remove_name(name)
        registry.profiles.pop(name, None)
    if named is not None:
        _not_started_with(registry, name)
    if name in registry.entries:
        return  # pulled again: already served
    target = _served(registry, ref, name)
    if target is not None:
        registry.add_alias(name, target)
    elif registry.new_spec is not None:
        registry.add_spec(registry.new_spec(name, ref))
    else:
        raise APIError(400, f"this server serves only the models it was started with; '{name}' is kept in your "
                            "names (scratchllm serve NAME serves it)", param="model", code="cannot_add_model")
    if named is not None and not named.adds_nothing():
        registry.profiles[name] = named


# ---- create, copy, delete --------------------------------------------------------------------------
def _base(req: OllamaCreateRequest, fields: dict[str, Any]) -> str:
    """The model a new name runs: `from` (a served name, a name of the user's, any reference), or
    the one GGUF file of `files` (uploaded to /api/blobs first)."""
    if req.adapters:
        raise bad_request("adapters (LoRA) are not supported by this server", param="adapters")
    if req.quantize:
        raise bad_request("quantize is not supported: create from a file already quantized", param="quantize")
    if req.files:
        ggufs = [(f, d) for f, d in req.files.items() if f.endswith(".gguf")]
        if len(ggufs) != 1 or len(req.files) != 1:
            raise bad_request(f"'files' must be one GGUF file, got {sorted(req.files)}", param="files")
        path = blob_dir() / ggufs[0][1].replace(":", "-")
        if not stores.DIGEST.fullmatch(ggufs[0][1]) or not path.is_file():
            raise bad_request(f"no blob {ggufs[0][1]} here: upload it first (POST /api/blobs/DIGEST)", param="files")
        return str(path)
    base = req.from_ or fields.get("from")
    if not base:
        raise bad_request("'from' (or a Modelfile's FROM, or 'files') names the model to create from", param="from")
    return str(base)


async def create_route(request: Request) -> Response | dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaCreateRequest, lenient=registry.config.lenient_fields)
    name = names.canonical(_name_of(req))
    fields = modelfile.parse(req.modelfile) if req.modelfile else {}
    base = _base(req, fields)
    parameters = {**fields.get("parameters", {}), **(req.parameters or {})}
    openai_fields(parameters, None)  # unknown or unsupported options: a 400 now, not on each request
    messages = req.messages if req.messages is not None else fields.get("messages", [])
    for m in messages:
        if m.get("role") not in modelfile.ROLES or not isinstance(m.get("content"), str):
            raise bad_request("each message is {\"role\": system|user|assistant, \"content\": text}", param="messages")
    source = registry.profiles.get(base) or names.lookup(base)
    if _served(registry, base, name) is None:
        try:
            await asyncio.to_thread(refs.resolve_model, base)
        except ConfigError as err:
            raise APIError(404, f"cannot create '{name}' from '{base}': {err}", param="from",
                           code="model_not_found") from None
    system = req.system if req.system is not None else fields.get("system", getattr(source, "system", None))
    named = Named(name, base, system=system,
                  parameters={**(source.parameters if source else {}), **parameters},
                  messages=tuple(messages or (source.messages if source else ())),
                  template=req.template or fields.get("template") or (source.template if source else None))
    if named.template is not None and "{{ ." in named.template.replace("{{- .", "{{ ."):
        raise bad_request("TEMPLATE is written in Go's template syntax (Ollama's); this server's chat templates are "
                          "Jinja, as model files carry them: write it as a Jinja chat template, or leave it out to "
                          "use the model's own", param="template")
    _serve(registry, name, base, named)
    names.save(named)
    done = [{"status": "parsing modelfile"}, {"status": f"using model {base}"}, {"status": "writing manifest"},
            {"status": "success"}]
    if not req.stream:
        return {"status": "success"}
    return Response(b"".join(_line(d) for d in done), media_type=NDJSON)


async def copy_route(request: Request) -> dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaCopyRequest, lenient=registry.config.lenient_fields)
    destination = names.canonical(req.destination)
    source = req.source if req.source in registry.entries else names.canonical(req.source)
    if source not in registry.entries:
        raise APIError(404, f"model '{req.source}' not found", param="source", code="model_not_found")
    given = registry.profiles.get(source) or names.lookup(source)
    named = Named(destination, given.base if given is not None else source,
                  system=given.system if given else None, parameters=dict(given.parameters) if given else {},
                  messages=given.messages if given else (), template=given.template if given else None,
                  origin="copy")
    _serve(registry, destination, source, named)
    if not named.adds_nothing():
        registry.profiles[destination] = named
    names.save(named)
    return {}


async def delete_route(request: Request) -> dict[str, Any]:
    """A name made here goes (and a pulled model's files with it); a model the server was started
    with stays, a name nobody knows is a 404."""
    registry = models_of(request)
    req = parse_body(await request.body(), OllamaDeleteRequest, lenient=registry.config.lenient_fields)
    given = _name_of(req)
    name = given if given in registry.entries else names.canonical(given)
    if name in registry.entries and name not in registry.added:
        raise bad_request(f"'{given}' is a model this server was started with; it is not deleted here",
                          param="model")
    served = name in registry.added
    if served:
        registry.remove_name(name)
        registry.profiles.pop(name, None)
    named = names.remove(name)
    pulled = named.base if named is not None and named.origin == "pull" else given if named is None else None
    files = stores.candidates(pulled, list(stores.scan_hf_cache())) if pulled is not None else []
    if named is None and not served and not files:
        raise APIError(404, f"model '{given}' not found", param="model", code="model_not_found")
    for model in files:
        await asyncio.to_thread(stores.remove, model)
    return {}


# ---- blobs ------------------------------------------------------------------------------------------
def _blob(digest: str) -> Path:
    if not stores.DIGEST.fullmatch(digest):
        raise bad_request(f"a blob is named sha256:<64 hex digits>, got {digest!r}", param="digest")
    return blob_dir() / digest.replace(":", "-")


async def blob_exists(digest: str) -> Response:
    return Response(status_code=200 if _blob(digest).is_file() else 404)


async def blob_upload(request: Request, digest: str) -> Response:
    """A file's bytes, streamed to disk while hashed; kept only when they are `digest`'s."""
    path = _blob(digest)
    if path.is_file():
        return Response(status_code=200)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(request)}.part")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            async for chunk in request.stream():
                h.update(chunk)
                await asyncio.to_thread(f.write, chunk)
        if f"sha256:{h.hexdigest()}" != digest:
            raise bad_request(f"the bytes sent have sha256:{h.hexdigest()}, not {digest}", param="digest")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return Response(status_code=201)
