import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

KINDS: dict[str, int]

def layout_context(block_tables: I32, token_seq: I32, token_pos: I32, block_size: int, num_blocks: int) -> int: ...
def paged_attention(q: F32, k: F32, v: F32, k_cache: npt.NDArray[np.generic], v_cache: npt.NDArray[np.generic],
                    block_tables: I32, token_seq: I32, token_pos: I32, scale: float, out: F32, max_ctx: int,
                    num_threads: int = 0, window: int = 0, softcap: float = 0.0, k_scale: F32 | None = None,
                    v_scale: F32 | None = None) -> None: ...
def copy_blocks(cache: npt.NDArray[np.generic], pairs: npt.NDArray[np.int64]) -> None: ...
