# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Every transformer block of a Llama forward in one C call: no Python between the kernels.

Why: a decode step of the default model is 30 blocks of nine kernel calls each. Called from
Python (models/llama.blocks_into), each call parses its arguments and acquires its buffers while
the thread pool's helper spins idle: 1.1 ms of CPU per step on one thread (16.5 -> 15.5 ms,
scripts/decode_workspace_ab.py). Here the block loop is C, the GIL is released once for all of
it (a server's event loop runs meanwhile), and each kernel is entered through its C entry point
(the .pxd files beside this one).

What it computes is blocks_into's, operation for operation: the same kernels in the same order on
the same buffers, so the same bits (tests/models/test_fused_blocks.py). It covers what the
default configuration uses: float32 or quantized matrices, no biases, the engine's paged
attention. A model with biases or bfloat16 matrices keeps the Python loop (`LlamaBlocks` raises
TypeError for it at load time).

Each call also measures where its time went (matmuls, attention, the other kernels), with a
monotonic clock read around each kernel: 9 kernels x 30 blocks, tens of nanoseconds each.
"""

from libc.stdlib cimport free, malloc

from scratchllm.kernels cimport packed_gemm, paged_attention, pointwise
from scratchllm.kernels.packed_gemm cimport GemmWeight
from scratchllm.kernels.paged_attention cimport KVCache, PagedLayout


cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_MONOTONIC


cdef inline long long _now_ns() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return <long long> t.tv_sec * 1000000000 + t.tv_nsec


cdef struct Block:
    const float *input_norm  # [C]
    const float *post_norm  # [C]
    GemmWeight qkv  # [C, (H + 2 KVH) D]
    GemmWeight o  # [H D, C]
    GemmWeight gate_up  # [C, 2 I]
    GemmWeight down  # [I, C]


cdef class LlamaBlocks:
    """The blocks of one model, bound once: `run` then takes only the step's arrays."""
    cdef Block *blocks
    cdef readonly Py_ssize_t num_layers, C, I, H, KVH, D
    cdef float eps
    cdef object keep  # the arrays the pointers above point into
    cdef readonly long long matmul_ns, attention_ns, other_ns  # of the last `run`

    def __cinit__(self):
        self.blocks = NULL

    def __init__(self, layers, cfg):
        """`layers`: models/llama.pack's per-block params; `cfg`: its ModelConfig."""
        cdef Py_ssize_t i
        cdef const float[::1] norm
        self.num_layers, self.C, self.I = len(layers), cfg.hidden_size, cfg.intermediate_size
        self.H, self.KVH, self.D, self.eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
        if cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
            raise ValueError("query heads must group evenly over kv heads, and a head's size must be even")
        for p in layers:
            if p.get("qkv_bias") is not None or p.get("o_bias") is not None:
                raise TypeError("blocks with biases run in Python (models/llama.blocks_into)")
        self.blocks = <Block *> malloc(max(1, self.num_layers) * sizeof(Block))
        if self.blocks == NULL:
            raise MemoryError()
        keep = []
        shapes = {"qkv_proj": (self.C, (self.H + 2 * self.KVH) * self.D), "o_proj": (self.H * self.D, self.C),
                  "gate_up_proj": (self.C, 2 * self.I), "down_proj": (self.I, self.C)}
        for i, p in enumerate(layers):
            for name, shape in shapes.items():
                if tuple(getattr(p[name], "shape", ())) != shape or not hasattr(p[name], "panels"):
                    raise TypeError(f"block {i}: {name} is not a packed [{shape[0]}, {shape[1]}] matrix")
            packed_gemm.bind_weight(p["qkv_proj"].panels, shapes["qkv_proj"][1], &self.blocks[i].qkv)
            packed_gemm.bind_weight(p["o_proj"].panels, self.C, &self.blocks[i].o)
            packed_gemm.bind_weight(p["gate_up_proj"].panels, 2 * self.I, &self.blocks[i].gate_up)
            packed_gemm.bind_weight(p["down_proj"].panels, self.C, &self.blocks[i].down)
            for name in ("input_layernorm", "post_attention_layernorm"):
                if p[name].shape != (self.C,):
                    raise ValueError(f"block {i}: {name} has shape {p[name].shape}, expected ({self.C},)")
            norm = p["input_layernorm"]
            self.blocks[i].input_norm = &norm[0]
            norm = p["post_attention_layernorm"]
            self.blocks[i].post_norm = &norm[0]
            keep.append(p)
        self.keep = keep

    def __dealloc__(self):
        free(self.blocks)

    def run(self, float[:, ::1] x, buf, const float[:, ::1] cos, const float[:, ::1] sin,
            k_cache, v_cache, const int[:, ::1] block_tables,
            const int[::1] token_seq, const int[::1] token_pos, Py_ssize_t max_ctx, float scale,
            int num_threads=0, k_scale=None, v_scale=None):
        """x [N, C], the residual stream, through every block in place; `buf`: the step's
        StepBuffers (models/workspace.py) of N rows. The attention is the engine's paged one
        (engine/paged_attention.PagedAttention): its pools [L, blocks, ...] of any KV-cache
        element kind (with an int8 pool's scales) and the step's layout, which must have passed
        layout_context (max_ctx is what it returned)."""
        cdef Py_ssize_t N = x.shape[0], C = self.C, I = self.I, H = self.H, KVH = self.KVH, D = self.D
        cdef Py_ssize_t W = (H + 2 * KVH) * D, layer
        cdef KVCache kv
        paged_attention.kv_cache(k_cache, v_cache, k_scale, v_scale, &kv)
        cdef float[:, ::1] h = buf.h, qkv = buf.qkv_rows, attn = buf.attn_rows, delta = buf.delta
        cdef float[:, ::1] gate_up = buf.gate_up, act = buf.act
        if (h.shape[0] != N or qkv.shape[0] != N or attn.shape[0] != N or delta.shape[0] != N
                or gate_up.shape[0] != N or act.shape[0] != N or x.shape[1] != C or h.shape[1] != C
                or qkv.shape[1] != W or attn.shape[1] != H * D or delta.shape[1] != C or gate_up.shape[1] != 2 * I
                or act.shape[1] != I):
            raise ValueError(f"buffers of {N} rows do not fit x {tuple(x.shape)[:2]} and this model")
        if cos.shape[0] != N or sin.shape[0] != N or cos.shape[1] != D // 2 or sin.shape[1] != D // 2:
            raise ValueError(f"rotary angles must be [{N}, {D // 2}]")
        if kv.num_layers != self.num_layers or kv.KVH != KVH or kv.D != D:
            raise ValueError("the KV pools do not fit this model")
        if token_seq.shape[0] != N or token_pos.shape[0] != N:
            raise ValueError(f"the layout has {token_pos.shape[0]} tokens, the step {N}")
        self.matmul_ns = self.attention_ns = self.other_ns = 0
        if N == 0:
            return
        cdef PagedLayout layout
        layout.block_tables, layout.token_seq, layout.token_pos = &block_tables[0, 0], &token_seq[0], &token_pos[0]
        layout.N, layout.MB, layout.max_ctx = N, block_tables.shape[1], max_ctx
        cdef float *xp = &x[0, 0]
        cdef float *hp = &h[0, 0]
        cdef float *qkvp = &qkv[0, 0]
        cdef float *attnp = &attn[0, 0]
        cdef float *dp = &delta[0, 0]
        cdef float *gup = &gate_up[0, 0]
        cdef float *actp = &act[0, 0]
        cdef Py_ssize_t ldx = x.strides[0] // 4, ldh = h.strides[0] // 4, ldq = qkv.strides[0] // 4
        cdef Py_ssize_t ldd = delta.strides[0] // 4, ldg = gate_up.strides[0] // 4, lda = act.strides[0] // 4
        cdef Py_ssize_t lda_attn = attn.strides[0] // 4
        cdef const Block *b
        cdef long long t0, t1, mm = 0, at = 0, other = 0
        cdef Py_ssize_t i, j
        # The buffers are the workspace's row views: their rows lie ld apart, and the gemm and
        # attention kernels take rows of exactly their width (checked here, once per step).
        if ldh != C or ldq != W or lda_attn != H * D or ldd != C or ldg != 2 * I or lda != I or ldx != C:
            raise ValueError("x and the step's buffers must be C-contiguous")
        with nogil:
            t0 = _now_ns()
            for layer in range(self.num_layers):
                b = &self.blocks[layer]
                if layer:  # the previous block's MLP output waits in delta (blocks_into's `pending`)
                    pointwise.add_rms_norm_rows(xp, ldx, dp, ldd, b.input_norm, self.eps, hp, ldh, N, C)
                else:
                    pointwise.rms_norm_rows(xp, ldx, b.input_norm, self.eps, hp, ldh, N, C)
                t1 = _now_ns(); other += t1 - t0; t0 = t1
                packed_gemm.gemm(&b.qkv, hp, N, qkvp)
                t1 = _now_ns(); mm += t1 - t0; t0 = t1
                pointwise.rope_rows(qkvp, ldq, D, N, H + KVH, D, &cos[0, 0], cos.strides[0] // 4, &sin[0, 0],
                                    sin.strides[0] // 4)
                t1 = _now_ns(); other += t1 - t0; t0 = t1
                paged_attention.attend_layer(qkvp, ldq, D, 1, qkvp + H * D, ldq, D, 1, qkvp + (H + KVH) * D, ldq,
                                             D, 1, &kv, layer, &layout, 0, 0.0, H, scale, attnp, num_threads)
                t1 = _now_ns(); at += t1 - t0; t0 = t1
                packed_gemm.gemm(&b.o, attnp, N, dp)
                t1 = _now_ns(); mm += t1 - t0; t0 = t1
                pointwise.add_rms_norm_rows(xp, ldx, dp, ldd, b.post_norm, self.eps, hp, ldh, N, C)
                t1 = _now_ns(); other += t1 - t0; t0 = t1
                packed_gemm.gemm(&b.gate_up, hp, N, gup)
                t1 = _now_ns(); mm += t1 - t0; t0 = t1
                pointwise.silu_mul_rows(gup, ldg, actp, lda, N, I)
                t1 = _now_ns(); other += t1 - t0; t0 = t1
                packed_gemm.gemm(&b.down, actp, N, dp)
                t1 = _now_ns(); mm += t1 - t0; t0 = t1
            if self.num_layers:  # the last block's MLP output
                for i in range(N):
                    for j in range(C):
                        xp[i * ldx + j] = xp[i * ldx + j] + dp[i * ldd + j]
            other += _now_ns() - t0
        self.matmul_ns, self.attention_ns, self.other_ns = mm, at, other
