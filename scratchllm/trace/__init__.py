"""Token-level tracing: a memory-mapped ring of fixed-size records that outlives its writer.

This package is what the engine and the server write, below both: format (the file layout and
record dtypes), writer (TraceWriter: what the engine, scratchllm/engine/tracing.py, and the
server call), reader (RingReader: the read side of the writer's protocol, from another process,
live or after a crash) and otlp (one OpenTelemetry span per finished request, for the server).
What reads a ring afterwards sits above the engine, in trace/views/ (analysis, diagnosis,
heatmap, perfetto), and nothing here imports it (tests/test_structure.py checks the layers).
See docs/tracing.md.
"""

from scratchllm.trace.format import DEFAULT_RING_BYTES, Kind, Phase, StepFlag, TokenFlag, request_key
from scratchllm.trace.reader import ReadResult, RingReader
from scratchllm.trace.writer import TraceWriter

__all__ = ["DEFAULT_RING_BYTES", "Kind", "Phase", "StepFlag", "TokenFlag", "request_key", "ReadResult",
           "RingReader", "TraceWriter"]
