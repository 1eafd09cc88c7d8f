import numpy as np
import numpy.typing as npt

MICRO_TILE: tuple[int, int]

def gemm(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32], mc: int = 192, kc: int = 512, nc: int = 4096,
         threads: int = 1) -> npt.NDArray[np.float32]: ...
