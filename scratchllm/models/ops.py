"""Operations more than one model shares: linear layers, LayerNorm, the two GELUs."""

import math

from scratchllm.models.array import array_module


def linear(x, w, b=None):  # [N, in], [out, in], [out] -> [N, out]   (torch.nn.Linear layout)
    y = x @ w.T
    if b is not None:
        y += b
    return y


def conv1d(x, w, b):  # [N, in], [in, out], [out] -> [N, out]   (GPT-2's "Conv1D" is a transposed Linear)
    y = x @ w
    y += b
    return y


def layer_norm(x, g, b, eps: float):  # [..., C], [C], [C] -> [..., C]
    xp = array_module(x)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc / xp.sqrt(var + eps) * g + b


def gelu_tanh(x):  # [...] -> [...]   GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    xp = array_module(x)
    return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def erf(x):  # [...] -> [...]   float64 in and out
    """Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7): NumPy has no vectorized erf, and the exact
    GELU of BERT needs one. The error is far below float32 resolution of the activations."""
    xp = array_module(x)
    sign = xp.sign(x)
    a = xp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * xp.exp(-a * a))


def gelu_erf(x):  # [...] -> [...]   BERT's GELU: x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
    x64 = x.astype("float64")
    return (0.5 * x64 * (1.0 + erf(x64 * (1.0 / math.sqrt(2.0))))).astype(x.dtype)
