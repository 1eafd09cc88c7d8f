"""What the GGUF tokenizer keeps resident: its tables, built from already parsed metadata (the
token strings belong to the metadata and are not counted), measured by tracemalloc, which sees
every Python object and every PyMem allocation of the C merge table.

Measured 5.40 MiB (the vocabulary dict 1.9 MB, its 49152 id ints 1.5 MB, the merge table
1.7 MB, the id list 0.4 MB); the same build held 13.65 MiB while the merge table was
{(left, right): rank} over new half strings. The bound leaves 20% above the measured figure."""

import gc
import tracemalloc

from scratchllm.formats.gguf import GGUFFile
from scratchllm.tokenizer.gguf_vocab import from_gguf

BOUND_MIB = 6.5
# Below this, the measurement missed the tables (the vocabulary dict and its ids alone are 3.2 MiB).
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
    table = spec.model.table
    assert len(table) == 48900 and table.nbytes() < 2 * 2**20
