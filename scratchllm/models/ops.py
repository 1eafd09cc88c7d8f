"""Operations more than one model shares: linear layers, LayerNorm, the two GELUs."""

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.models.array import array_module

Floats = npt.NDArray[np.floating[Any]]


def linear(x: Floats, w: Floats, b: Floats | None = None) -> Floats:
    # [N, in], [out, in], [out] -> [N, out]   (torch.nn.Linear layout)
    y: Floats = x @ w.T
    if b is not None:
        y += b
    return y


def conv1d(x: Floats, w: Floats, b: Floats) -> Floats:
    # [N, in], [in, out], [out] -> [N, out]   (GPT-2's "Conv1D" is a transposed Linear)
    y: Floats = x @ w
    y += b
    return y


def layer_norm(x: Floats, g: Floats, b: Floats, eps: float) -> Floats:  # [..., C], [C], [C] -> [..., C]
    xp = array_module(x)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    y: Floats = xc / xp.sqrt(var + eps) * g + b
    return y


def gelu_tanh(x: Floats) -> Floats:  # [...] -> [...]
    """GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    xp = array_module(x)
    y: Floats = 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return y


def erf(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:  # [...] -> [...]   float64 in and out
    """Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7): NumPy has no vectorized erf, and the exact
    GELU of BERT needs one. The error is far below float32 resolution of the activations."""
    xp = array_module(x)
    sign = xp.sign(x)
    a = xp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y: npt.NDArray[np.float64] = sign * (1.0 - poly * xp.exp(-a * a))
    return y


def gelu_erf(x: Floats) -> Floats:  # [...] -> [...]   BERT's GELU: x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
    x64 = x.astype("float64")
    y: Floats = (0.5 * x64 * (1.0 + erf(x64 * (1.0 / math.sqrt(2.0))))).astype(x.dtype)
    return y
