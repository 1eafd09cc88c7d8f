"""transformers' reading of a GGUF file, the reference the real-model tests compare against: the
file's weights dequantized to float32 by the `gguf` package.

from_pretrained(gguf_file=...) insists on the `accelerate` package only to place weights on
devices; this takes its two documented halves instead: the config from the file, and
load_gguf_checkpoint (the reader from_pretrained calls) for the tensors. The model is built
without initializing its weights (every one is then read from the file; initializing a 0.5B
model's at random took about 10 s on 2 cores)."""

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def file_config(path: Path) -> Any:
    """The transformers config the GGUF file describes."""
    return transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def gguf_model(path: Path, config: Any = None, names: Any = None) -> Any:
    """transformers' model of `config` (the file's own by default) with the file's weights,
    float32, in eval mode; a tied LM head tied. `names`: a model whose parameter names the file's
    tensors are read for (default: the model itself)."""
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = file_config(path) if config is None else config
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names or model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    else:
        assert not missing, missing
    return model.eval()


def steps_before_near_tie(got: list[int], want: Any, near_tie: float) -> int:
    """Our greedy picks `got` against transformers' logits rows `want` (row i: before pick i), up
    to the first row whose top two are within `near_tie` of its largest |logit| (from there either
    pick is right): each pick must be the row's argmax. The steps checked."""
    import numpy as np

    checked = 0
    for step, row in enumerate(want[: len(got)]):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < near_tie * np.abs(row).max():
            break  # a near-tie: from here the two greedy paths may part
        assert got[step] == int(row.argmax()), f"step {step}: we picked {got[step]}, transformers {row.argmax()}"
        checked += 1
    return checked
