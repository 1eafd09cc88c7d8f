"""What the GGUF tokenizer keeps resident: its tables, built from already parsed metadata (the
metadata's own token strings are not counted: the tokenizer does not keep them), measured by
tracemalloc, which sees every Python object and every PyMem allocation of the C tables.

Measured 3.77 MiB: the vocabulary (one str of the texts, offsets, hashes, index: 1.7 MiB), the
merge table (1.6 MiB), the list the ids' int objects go in as encoding meets them (0.4 MiB).
The same build held 13.65 MiB while the vocabulary was a dict with an int object per id and the
merge table {(left, right): rank} over new half strings, and the tokenizer also kept the 49152
token strings (4.0 MiB more). The bound leaves 20% above the measured figure."""

import gc
import tracemalloc

from scratchllm.formats.gguf import GGUFFile
from scratchllm.tokenizer.gguf_vocab import from_gguf

BOUND_MIB = 4.5
# Below this, the measurement missed the tables (their C arrays alone are 3.3 MiB).
FLOOR_MIB = 3.0


def test_the_default_tokenizer_tables_stay_small(default_gguf):
    meta = GGUFFile(default_gguf).metadata
    gc.collect()
    tracemalloc.start()
    try:
        spec = from_gguf(default_gguf, meta)
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mib = kept / 2**20
    assert FLOOR_MIB < mib < BOUND_MIB, f"the tokenizer keeps {mib:.2f} MiB"
    vocab, table = spec.model.vocab, spec.model.table
    assert len(vocab) == 49152 and vocab.nbytes() < 2 * 2**20
    assert len(table) == 48900 and table.nbytes() < 2 * 2**20


def test_the_tokenizer_keeps_no_token_strings(default_gguf):
    """Once the tokenizer is built, dropping the metadata's token list frees its 4 MiB: nothing
    of the tokenizer holds those strings."""
    tracemalloc.start()
    try:
        meta = GGUFFile(default_gguf).metadata
        spec = from_gguf(default_gguf, meta)
        texts = list(spec.id_to_token[:100])
        assert texts == meta["tokenizer.ggml.tokens"][:100]
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        del meta["tokenizer.ggml.tokens"]
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (before - after) / 2**20 > 3.5
    assert spec.id_to_token[42] == GGUFFile(default_gguf).metadata["tokenizer.ggml.tokens"][42]
