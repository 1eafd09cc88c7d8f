"""What is fuzzed: one function per parser, taking the fuzzer's bytes. Each may raise the project's
own errors (scratchllm.errors: FormatError, ConfigError, ...) on bad input; any other exception is
a bug in the parser, and the fuzzer reports it as a crash.

- gguf, safetensors, torch: the bytes as a model file, opened with load_checkpoint (the format
  told by the extension), every tensor read and summed;
- unpickle: the bytes as a torch state-dict pickle, through the restricted unpickler alone;
- tokenizer_json: the bytes as tokenizer.json, loaded, then a sample text encoded and decoded;
- chat_template: the bytes as a chat template (UTF-8), rendered over a few messages with a tight
  time limit.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np

from scratchllm.errors import ScratchLLMError

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # a RAM disk where there is one


@contextlib.contextmanager
def _file(data: bytes, name: str) -> Iterator[str]:
    """`data` as the file `name` in a folder of its own, removed afterwards (libFuzzer's exit runs
    no atexit hook, so nothing may be left for one)."""
    folder = tempfile.mkdtemp(prefix="scratchllm-fuzz-", dir=SHM)
    try:
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(data)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _checkpoint(data: bytes, name: str) -> None:
    from scratchllm import load_checkpoint

    with _file(data, name) as path:
        try:
            ckpt = load_checkpoint(path)
            for key in ckpt:
                np.asarray(ckpt[key]).sum()
        except ScratchLLMError:
            pass


def gguf(data: bytes) -> None:
    _checkpoint(data, "f.gguf")


def safetensors(data: bytes) -> None:
    _checkpoint(data, "f.safetensors")


def torch(data: bytes) -> None:
    _checkpoint(data, "f.bin")


def unpickle(data: bytes) -> None:
    from scratchllm.formats.unpickle import load_state_dict_pickle

    with contextlib.suppress(ScratchLLMError):
        load_state_dict_pickle(data, "data.pkl")


def tokenizer_json(data: bytes) -> None:
    from scratchllm.tokenizer import Tokenizer

    with _file(data, "tokenizer.json") as path, contextlib.suppress(ScratchLLMError):
        tok = Tokenizer.from_pretrained(path)
        tok.decode(tok.encode("Hello, wörld! 12 345  \n\tok"))


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]


def chat_template(data: bytes) -> None:
    from scratchllm.tokenizer.chat import TemplateLimits, compile_template, render_chat

    # every input compiled: once the corpus is short templates, most mutations repeat one of the
    # 16 the cache holds, and a run would measure the cache's lookups rather than the compiler
    compile_template.cache_clear()
    with contextlib.suppress(ScratchLLMError):
        render_chat(data.decode("utf-8", errors="replace"), MESSAGES, special_tokens={"bos_token": "<s>"},
                    limits=TemplateLimits(seconds=0.05, max_chars=1 << 16))


TARGETS = {f.__name__: f for f in (gguf, safetensors, torch, unpickle, tokenizer_json, chat_template)}


def every_target(data: bytes) -> None:
    """All targets in one process (for a short run in the tests): the first byte picks the target
    (its index in TARGETS, modulo their number), the rest is that target's input."""
    if data:
        names = list(TARGETS)
        TARGETS[names[data[0] % len(names)]](data[1:])
