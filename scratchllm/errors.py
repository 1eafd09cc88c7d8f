"""The errors scratchllm raises on bad input. The CLI prints them as one line and exits 2."""


class ScratchLLMError(Exception):
    """Base of every error that is the user's input, not our bug."""


class FormatError(ScratchLLMError, ValueError):
    """A model file is malformed, truncated, unsafe or of a kind we do not read.

    The message always names the file and the problem, e.g.
    ``model.safetensors: tensor 'wte' ends at byte 912 but the file has 800 bytes``.
    """

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ConfigError(ScratchLLMError, ValueError):
    """An option, flag or config value is out of range or inconsistent."""


class MemoryPlanError(ScratchLLMError):
    """The memory plan does not fit the budget: refused at start, never an OOM mid-traffic."""


class UnsupportedCPUError(ScratchLLMError, ImportError):
    """No build of the kernels runs on this CPU, or SCRATCHLLM_CPU_LEVEL names one that is not
    built or not runnable here (scratchllm/kernels/cpu_features.py). An ImportError too: it is
    raised by `import scratchllm.kernels`, instead of a crash with an illegal instruction."""
