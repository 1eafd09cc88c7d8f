"""The step-time model behind a TPOT target: how long a step of n tokens takes, learned as it runs.

Time per output token is a step's duration: every running decode gets one token per step (decodes
are scheduled first), so a request's TPOT is the mean duration of the steps it decodes in. On a
CPU a step of n tokens (decodes and prefill chunks packed together) costs about

    seconds(n) = fixed + per_token * n

`fixed` is reading the weights once (the same for 1 or 64 rows), `per_token` the rest (each row's
share of the matmuls, attention, sampling). The two are fitted by least squares over the recent
steps, each weighted by decay^age (a half-life of `half_life` steps), so the fit follows a change
of load or of context length without a restart.

With a target T (EngineConfig.target_tpot_s), `max_tokens(T)` is the most tokens a step may hold
for its predicted time to stay within T: the scheduler caps the step's token budget there (never
below the running decodes, which are not starved), and a new sequence is admitted only into what
the budget leaves, so admission stops adding sequences once the decodes fill it. Before
`min_steps` steps, or while the steps seen are all of one size (no slope to fit), it falls back
to seconds proportional to tokens, which overestimates the cost of a larger step: conservative.
"""

from dataclasses import dataclass


@dataclass
class StepTimeModel:
    half_life: float = 64.0  # steps
    min_steps: int = 8
    # exponentially weighted sums over the steps seen: weight, tokens, seconds, tokens^2, tokens * seconds
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    steps: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = 0.5 ** (1.0 / self.half_life)
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + tokens, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + tokens * tokens, self.sxy * d + tokens * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any step."""
        if self.w == 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if self.steps >= self.min_steps and var > 1e-9 * max(mx * mx, 1.0):
            slope = (self.sxy / self.w - mx * my) / var
            fixed = my - slope * mx
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, my / mx  # proportional: no fixed part, the whole cost per token

    def predict(self, tokens: int) -> float | None:
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * tokens

    def max_tokens(self, target_s: float) -> int | None:
        """Most tokens in a step predicted to take <= target_s; None: nothing observed yet (no cap)."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_token = fit
        return max(int((target_s - fixed) / per_token + 1e-6), 0)  # + 1e-6: a fit that lands on the target
