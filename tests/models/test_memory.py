"""What a loaded model keeps resident besides its weights, measured in fresh processes (a test
process's malloc and mappings have been shaped by every test before):
- a large step's buffers leave malloc as they found it: freeing them does not make later
  allocations come from (and stay in) the heap (glibc's own counters, mallinfo2);
- the model's forward does not read the weights' file again (its norms are copied at load)."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scratchllm.models.workspace import StepBuffers
from tests.engine.tiny import tiny_llama

CHILD = r"""
import ctypes, json, sys
import numpy as np
from scratchllm.models.config import ModelConfig
from scratchllm.models.workspace import StepBuffers

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def heap_growth_of_1mib_arrays():  # bytes the heap grows by while 8 arrays of 1 MiB are alive
    before = libc.mallinfo2().arena
    held = [np.ones(1 << 18, np.float32) for _ in range(8)]
    grown = libc.mallinfo2().arena - before
    del held
    return grown

# the default model's shapes; 500 rows: a prefill too large for the model's cached buffers
cfg = ModelConfig(family="llama", model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, intermediate_size=1536, norm_eps=1e-5, max_position_embeddings=8192)
if sys.argv[1] == "step":
    buf = StepBuffers.allocate(cfg, 500)
    buf.gate_up[:] = 1.0  # written, as a step writes it
    del buf
else:  # the control: a plain NumPy array of the size of the step's largest buffer
    big = np.ones((500, 2 * cfg.intermediate_size), np.float32)
    del big
print(json.dumps(heap_growth_of_1mib_arrays()))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc counters")
def test_freeing_a_large_step_leaves_mallocs_threshold_alone():
    def heap_growth(first: str) -> int:
        done = subprocess.run([sys.executable, "-c", CHILD, first], capture_output=True, text=True, timeout=60,
                              check=True, cwd=Path(__file__).parents[2])
        return json.loads(done.stdout)

    # the control: a freed 6 MB NumPy array raises the threshold, and the 8 MiB land in the heap
    assert heap_growth("numpy") >= 4 << 20
    grown = heap_growth("step")
    assert grown < 1 << 20, f"the heap grew by {grown / 2**20:.1f} MiB after a large step's buffers were freed"


def test_carved_buffers_are_aligned_and_do_not_overlap():
    cfg = tiny_llama().config
    buf = StepBuffers.allocate(cfg, 70)
    own = [buf.h, buf.qkv, buf.attn, buf.delta, buf.gate_up, buf.act]
    for i, a in enumerate(own):
        assert a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % 64 == 0
        for b in own[i + 1 :]:
            assert not np.shares_memory(a, b)


FILE_RSS_CHILD = r"""
import sys
import numpy as np
from scratchllm.engine.paged_attention import PagedSequence
from scratchllm.models import load_model

model = load_model(sys.argv[1])
model.forward(np.arange(100, 164), np.arange(64), PagedSequence(model.config, 64), logits_rows=[63])
kib, here = 0, False
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            here = head[-1] == sys.argv[1]
        elif head[0] == "Rss:" and here:
            kib += int(head[1])
print(kib)
"""


def test_the_forward_does_not_fault_the_file_back_in(default_gguf):
    """Every matrix lives in panels after a quantized load; norms read through views of the file
    faulted 64 KiB around each of them back in (4 MB of the default model's file)."""
    done = subprocess.run([sys.executable, "-c", FILE_RSS_CHILD, str(default_gguf.resolve())], capture_output=True,
                          text=True, timeout=120, check=True, cwd=Path(__file__).parents[2])
    assert int(done.stdout) < 512, f"{done.stdout.strip()} KiB of the model file resident after a forward"
