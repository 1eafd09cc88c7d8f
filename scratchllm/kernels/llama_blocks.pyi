from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from scratchllm.models.config import ModelConfig
from scratchllm.models.workspace import StepBuffers

if TYPE_CHECKING:
    from scratchllm.models.llama_params import LayerParams

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

class LlamaBlocks:
    num_layers: int
    C: int
    I: int
    H: int
    KVH: int
    D: int
    gelu: bool
    matmul_ns: int
    attention_ns: int
    other_ns: int
    def __init__(self, layers: Sequence[LayerParams], cfg: ModelConfig,
                 local_rope: Sequence[bool] = ()) -> None: ...
    def run(self, x: F32, buf: StepBuffers, cos: F32, sin: F32, k_cache: npt.NDArray[np.generic],
            v_cache: npt.NDArray[np.generic], block_tables: I32, token_seq: I32, token_pos: I32, max_ctx: int,
            scale: float, num_threads: int = 0, *, cos_local: F32 | None = None, sin_local: F32 | None = None,
            k_window: npt.NDArray[np.generic] | None = None, v_window: npt.NDArray[np.generic] | None = None,
            window_tables: I32 | None = None, layer_slots: I32 | None = None, softcap: float = 0.0,
            k_scale: F32 | None = None, v_scale: F32 | None = None, k_window_scale: F32 | None = None,
            v_window_scale: F32 | None = None, out_rows: I32 | None = None) -> None: ...
