import time, sys
from scratchllm.llm import LLM
from scratchllm.formats.refs import resolve_model
from scratchllm.formats.gguf import GGUFFile
import scratchllm.tokenizer.loaders
from scratchllm.tokenizer import gguf_vocab as gv, pretokenize as pt, Tokenizer
from scratchllm.tokenizer.bpe import BPE
p=resolve_model("default")
T=[]
def lap(n): T.append((n, time.perf_counter()))
lap("start")
meta=GGUFFile(p).metadata; lap("parse")
tokens = gv._strings(meta, "tokenizer.ggml.tokens", p); lap("tokens check")
types = meta["tokenizer.ggml.token_type"]; ok = all(type(t) is int for t in types); lap("types check")
M = gv._strings(meta, "tokenizer.ggml.merges", p); lap("merges check")
v = dict(zip(tokens, range(len(tokens)))); lap("vocab")
r = gv.merge_ranks(M, p); lap("merge_ranks")
added = {tokens[i]: i for i, t in enumerate(types) if t == 3 or t == 4}; special = frozenset(i for i, t in enumerate(types) if t == 3); lap("added")
pre = pt.from_gguf_name("smollm", p); lap("pre")
spec = gv.from_gguf(p, meta); lap("from_gguf (again)")
tok = Tokenizer(spec); lap("Tokenizer()")
print(" ".join(f"{b[0]} {1e3*(b[1]-a[1]):.1f}" for a, b in zip(T, T[1:])))
