"""Token-level tracing: a memory-mapped ring of fixed-size records that outlives its writer.

format (the file layout and record dtypes), writer (TraceWriter: what the engine and server
call), reader (RingReader: another process, live or after a crash), analysis (per-request
tables, live figures, the latency heatmap's data and its diagnosis), heatmap (the picture),
perfetto (Chrome/Perfetto trace-event JSON). The engine writes the ring itself
(scratchllm/engine/tracing.py).
See docs/tracing.md.
"""

from scratchllm.trace.format import DEFAULT_RING_BYTES, Kind, Phase, StepFlag, TokenFlag, request_key
from scratchllm.trace.reader import ReadResult, RingReader
from scratchllm.trace.writer import TraceWriter

__all__ = ["DEFAULT_RING_BYTES", "Kind", "Phase", "StepFlag", "TokenFlag", "request_key", "ReadResult",
           "RingReader", "TraceWriter"]
