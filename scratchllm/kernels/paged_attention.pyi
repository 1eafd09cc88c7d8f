import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

def layout_context(block_tables: I32, token_seq: I32, token_pos: I32, block_size: int, num_blocks: int) -> int: ...
def paged_attention(q: F32, k: F32, v: F32, k_cache: F32, v_cache: F32, block_tables: I32, token_seq: I32,
                    token_pos: I32, scale: float, out: F32, max_ctx: int, num_threads: int = 0, window: int = 0,
                    softcap: float = 0.0) -> None: ...
def copy_blocks(cache: F32, pairs: npt.NDArray[np.int64]) -> None: ...
