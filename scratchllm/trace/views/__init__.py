"""The views of a trace ring, over what reader.py reads: analysis (per-request tables, live
figures, the latency heatmap's data), diagnosis (what the heatmap shows, in words), heatmap (the
picture) and perfetto (Chrome/Perfetto trace-event JSON). `scratchllm trace watch|heatmap|export`
(cli/trace_cmd.py) and the benchmarks run them; the engine and the server never do.
"""
