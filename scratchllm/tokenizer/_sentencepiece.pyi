import numpy as np
import numpy.typing as npt

from scratchllm.tokenizer._vocabulary import Vocabulary

class PieceMerger:
    def __init__(self, vocab: Vocabulary, order: npt.NDArray[np.int64], byte_ids: list[int], unk_id: int,
                 max_length: int) -> None: ...
    def encode(self, piece: str) -> list[int]: ...
