"""How far a quantized model's logits land from its dequantized float32 model's, for each way we
multiply its matrices and for llama.cpp on the same file and prompts, measured here, now.

The reference is our float32 model (every matrix dequantized once; its logits equal transformers'
on the dequantized weights, tests/models/test_smollm2.py). On each prompt it decodes --steps
greedy tokens; each side then
  - reads the prompt followed by those tokens (teacher forcing: every side sees the same
    sequence) and gives its logits at each of the steps' positions: the largest |difference|
    from the reference's (also over the largest |logit|), and the share of positions whose
    argmax is the reference's;
  - decodes --steps greedy tokens on its own from the prompt: how many steps it agrees with the
    reference's tokens before the first difference (--steps when it never differs).
Sides: our dtypes (--dtypes: "quantized" is the exact path, equal to float32 bit for bit; "int8"
and "int16" round x to integers) in this process, and llama.cpp (llama-cpp-python, `make peers`)
in a child process of its own, where it is installed. Its logits are read from its context with
logits for every position (`logits_all`), on the same token ids (no BOS added).

The issue's rule for the default dtype: no further from float32 than llama.cpp is, on both
counts (`bench peers` prints these rows beside its speed rows).
"""

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.bench.common import LoadedModel, machine_facts

PEER = "llama.cpp"
DEFAULT_DTYPES = ("auto", "int8", "quantized")
# What the prompts are: a chat question (the model's template), a plain text continuation, code.
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ("The history of the printing press begins", "def fibonacci(n):\n    ")

Ids = list[int]
F32 = npt.NDArray[np.float32]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="a GGUF file (default: SmolLM2-135M-Instruct's)")
    parser.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                        help="our dtypes to measure, comma-separated (default: auto, int8, quantized)")
    parser.add_argument("--steps", type=int, default=128, help="greedy steps per prompt (default 128)")
    parser.add_argument("--threads", type=int, default=None, help="matmul threads (default: as set)")
    parser.add_argument("--no-peer", action="store_true", help="measure our dtypes only")


def prompts(path: str) -> list[Ids]:
    """The prompts' token ids, by the model's own tokenizer (both sides read these ids)."""
    from scratchllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(path)
    out = [tok.encode(text) for text in TEXTS]
    if tok.chat_template is not None:
        out.insert(0, tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False))
    return out


def load_decoder(path: str, dtype: str) -> LoadedModel:
    from scratchllm.errors import ConfigError
    from scratchllm.models import load_model
    from scratchllm.models.bert import BertModel

    model = load_model(path, dtype=dtype)
    if isinstance(model, BertModel) or not model.config.is_decoder:
        raise ConfigError(f"{path} is an encoder: its logits are not a language model's")
    return model


def _all_logits(model: LoadedModel, ids: Ids) -> F32:
    """Logits at every position of ids, one forward pass (the engine's paged attention)."""
    from scratchllm.engine.paged_attention import PagedSequence

    cache = PagedSequence(model.config, len(ids) + 1)
    return model.forward(np.asarray(ids), np.arange(len(ids)), cache)


def _greedy(model: LoadedModel, prompt: Ids, steps: int) -> Ids:
    from scratchllm.engine.paged_attention import PagedSequence

    cache = PagedSequence(model.config, len(prompt) + steps + 1)
    logits = model.forward(np.asarray(prompt), np.arange(len(prompt)), cache, logits_rows=[len(prompt) - 1])
    out: Ids = []
    for _ in range(steps):
        out.append(int(np.argmax(logits[-1])))
        logits = model.forward(np.array(out[-1:]), np.array([cache.length]), cache)
    return out[:steps]


def agreement(prefix: Ids, reference: Ids) -> int:
    """Steps the two greedy runs agree before their first difference."""
    for i, (a, b) in enumerate(zip(prefix, reference, strict=False)):
        if a != b:
            return i
    return min(len(prefix), len(reference))


def compare(rows: Sequence[F32], reference: Sequence[F32], greedy: Sequence[Ids], ref_greedy: Sequence[Ids]
            ) -> dict[str, Any]:
    """One side's figures over the prompts: rows[i] and reference[i] are the logits at the
    steps' positions of prompt i (teacher forcing), greedy[i] the side's own greedy ids."""
    diff = max(float(np.abs(a - b).max()) for a, b in zip(rows, reference, strict=True))
    scale = max(float(np.abs(b).max()) for b in reference)
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(rows, reference, strict=True))
    total = sum(len(b) for b in reference)
    agree = [agreement(g, r) for g, r in zip(greedy, ref_greedy, strict=True)]
    return {"max_abs_diff": diff, "max_abs_diff_over_max_logit": diff / scale, "argmax_agree": same / total,
            "greedy_agree_steps": agree, "greedy_agree_min": min(agree)}


def _our_side(model: LoadedModel, sequences: Sequence[Ids], prompt_ids: Sequence[Ids], steps: int
              ) -> tuple[list[F32], list[Ids]]:
    rows = [_all_logits(model, seq)[len(p) - 1:len(seq) - 1] for seq, p in zip(sequences, prompt_ids, strict=True)]
    return rows, [_greedy(model, p, steps) for p in prompt_ids]


def measure(model: str = "default", dtypes: Sequence[str] = ("auto",), steps: int = 128, peer: bool = True,
            peer_threads: int = 2) -> dict[str, Any]:
    """The figures of our `dtypes` and of llama.cpp (`peer`, where installed) on `model`'s file:
    {"inputs", "figures": {dtype or PEER: compare()'s figures}, "machine"}. What `bench peers`
    can call to print the accuracy rows beside its speed rows (render prints them)."""
    from scratchllm.formats.refs import resolve_model

    path = str(resolve_model(model))
    prompt_ids = prompts(path)
    reference = load_decoder(path, "float32")
    ref_greedy = [_greedy(reference, p, steps) for p in prompt_ids]
    sequences = [p + g for p, g in zip(prompt_ids, ref_greedy, strict=True)]
    ref_rows = [_all_logits(reference, s)[len(p) - 1:len(s) - 1] for s, p in zip(sequences, prompt_ids, strict=True)]
    del reference
    sides: dict[str, Any] = {}
    for dtype in dtypes:
        ours = load_decoder(path, dtype)
        rows, greedy = _our_side(ours, sequences, prompt_ids, steps)
        sides[dtype] = {"dtype": ours.dtype, **compare(rows, ref_rows, greedy, ref_greedy)}
        del ours
    theirs: dict[str, Any] = {"installed": peer_installed()}
    if theirs["installed"] and peer:
        got = run_peer(path, sequences, prompt_ids, steps, peer_threads)
        rows = [np.asarray(r, dtype=np.float32) for r in got["rows"]]
        theirs.update(version=got["version"], **compare(rows, ref_rows, got["greedy"], ref_greedy))
    sides[PEER] = theirs
    return {"inputs": {"model": path, "steps": steps, "prompt_tokens": [len(p) for p in prompt_ids]},
            "figures": sides, "machine": machine_facts()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        from scratchllm.models.threads import set_blas_threads

        set_blas_threads(args.threads)
    return measure(args.model, [d for d in args.dtypes.split(",") if d], args.steps, not args.no_peer,
                   args.threads or 2)


def peer_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_peer(path: str, sequences: Sequence[Ids], prompt_ids: Sequence[Ids], steps: int, threads: int
             ) -> dict[str, Any]:
    """llama.cpp's rows and greedy ids (as _our_side gives ours), in a child process of its own."""
    spec = {"path": path, "sequences": list(sequences), "prompts": list(prompt_ids), "steps": steps,
            "threads": threads}
    code = "from scratchllm.bench.accuracy import peer_child; peer_child()"
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True, text=True,
                          timeout=3600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        from scratchllm.errors import ConfigError

        raise ConfigError(f"the {PEER} side failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def peer_child() -> None:
    """The child process of run_peer: the spec as JSON on stdin, one JSON object on stdout."""
    import llama_cpp

    spec = json.loads(sys.stdin.read())
    n_ctx = max(map(len, spec["sequences"])) + 8
    llm = llama_cpp.Llama(model_path=spec["path"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False)
    vocab = llm.n_vocab()
    rows, greedy = [], []
    for seq, prompt in zip(spec["sequences"], spec["prompts"], strict=True):
        llm.reset()
        llm.eval(seq)
        rows.append(np.asarray(llm.scores[len(prompt) - 1:len(seq) - 1], dtype=np.float32).round(6).tolist())
        llm.reset()
        llm.eval(prompt)
        got: Ids = []
        for _ in range(spec["steps"]):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            got.append(int(np.argmax(row)))
            llm.eval(got[-1:])
        greedy.append(got)
    print(json.dumps({"rows": rows, "greedy": greedy, "version": llama_cpp.__version__}))


def render(r: dict[str, Any]) -> str:
    i = r["inputs"]
    lines = [f"logits against the dequantized float32 model: {os.path.basename(i['model'])}, "
             f"{len(i['prompt_tokens'])} prompts ({', '.join(map(str, i['prompt_tokens']))} tokens), "
             f"{i['steps']} greedy steps each",
             f"{'side':<22} {'max |diff|':>11} {'/ max|logit|':>13} {'argmax agree':>13} {'greedy agree, steps':>22}"]
    for name, f in r["figures"].items():
        if "max_abs_diff" not in f:
            lines.append(f"{name:<22} not installed (make peers)" if not f.get("installed") else f"{name:<22} skipped")
            continue
        label = name if name == PEER or f.get("dtype") == name else f"{name} ({f['dtype']})"
        lines.append(f"{label:<22} {f['max_abs_diff']:>11.4g} {f['max_abs_diff_over_max_logit']:>13.3g} "
                     f"{f['argmax_agree']:>13.1%} {' / '.join(map(str, f['greedy_agree_steps'])):>22}")
    return "\n".join(lines)
