# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Every transformer block of a Llama forward in one C call: no Python between the kernels.

Why: a decode step of the default model is 30 blocks of nine kernel calls each. Called from
Python (models/llama.blocks_into), each call parses its arguments and acquires its buffers while
the thread pool's helper spins idle: 1.1 ms of CPU per step on one thread (16.5 -> 15.5 ms,
scripts/decode_workspace_ab.py). Here the block loop is C, the GIL is released once for all of
it (a server's event loop runs meanwhile), and each kernel is entered through its C entry point
(the .pxd files beside this one).

What it computes is blocks_into's, operation for operation: the same kernels in the same order on
the same buffers, so the same bits (tests/models/test_llama_blocks.py). It covers the llama
family's variations: QK-norm (Qwen3, Gemma 3), the sublayers' output norms and GeGLU (Gemma 2/3),
Gemma 3's second rope base on its sliding-window layers, and, from the engine's paged attention,
per-layer sliding windows in a pool of their own, the softmax scale and the scores' soft-cap.
Float32 or quantized matrices, with or without q|k|v and o biases (Qwen2, Llama's
attention_bias): the packer (models/llama_pack.check_fused_coverage) decides from the model's
config and dtype whether these blocks run it, before it binds them; a model with bfloat16
matrices keeps the Python loop. Handed layers it does not cover, `LlamaBlocks` raises ValueError:
the caller's bug, never a fallback.

Each call also measures where its time went (matmuls, attention, the other kernels), with a
monotonic clock read around each kernel: 9 kernels x 30 blocks, tens of nanoseconds each.
"""

from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

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
    const float *mlp_norm  # [C], the MLP's input norm
    const float *q_norm  # [D] QK-norm of each query head, or NULL (none)
    const float *k_norm  # [D]
    const float *attn_out_norm  # [C] the norm of the attention's output, or NULL (Gemma's post-norms)
    const float *mlp_out_norm  # [C] the norm of the MLP's output, or NULL
    const float *qkv_bias  # [(H + 2 KVH) D] added to q|k|v's rows, or NULL (none; Qwen2 has one)
    const float *o_bias  # [C] added to the attention's output projection, or NULL
    bint local_rope  # rotates by the second rope's angles (Gemma 3's sliding-window layers)
    GemmWeight qkv  # [C, (H + 2 KVH) D]
    GemmWeight o  # [H D, C]
    GemmWeight gate_up  # [C, 2 I]
    GemmWeight down  # [I, C]


cdef class LlamaBlocks:
    """The blocks of one model, bound once: `run` then takes only the step's arrays."""
    cdef Block *blocks
    cdef readonly Py_ssize_t num_layers, C, I, H, KVH, D
    cdef readonly bint gelu  # the MLP's gate: GeGLU (gelu_tanh), else SwiGLU
    cdef float eps
    cdef object keep  # the arrays the pointers above point into
    cdef readonly long long matmul_ns, attention_ns, other_ns  # of the last `run`

    def __cinit__(self):
        self.blocks = NULL

    def __init__(self, layers, cfg, local_rope=()):
        """`layers`: the per-block params (models/llama_params.LayerParams); `cfg`: its ModelConfig;
        `local_rope`: per layer, whether it rotates by the second rope (run's cos_local, sin_local)."""
        cdef Py_ssize_t i
        cdef const float[::1] norm
        self.num_layers, self.C, self.I = len(layers), cfg.hidden_size, cfg.intermediate_size
        self.H, self.KVH, self.D, self.eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
        if cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
            raise ValueError("query heads must group evenly over kv heads, and a head's size must be even")
        if cfg.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"the gate {cfg.hidden_act!r} is not one these blocks run")
        self.gelu = cfg.hidden_act == "gelu_tanh"
        local = list(local_rope) or [False] * self.num_layers
        if len(local) != self.num_layers:
            raise ValueError(f"local_rope has {len(local)} entries for {self.num_layers} layers")
        self.blocks = <Block *> malloc(max(1, self.num_layers) * sizeof(Block))
        if self.blocks == NULL:
            raise MemoryError()
        keep = []
        shapes = {"qkv": (self.C, (self.H + 2 * self.KVH) * self.D), "o": (self.H * self.D, self.C),
                  "gate_up": (self.C, 2 * self.I), "down": (self.I, self.C)}
        for i, p in enumerate(layers):
            for name, matrix in p.matrices().items():
                shape = shapes[name]
                if tuple(getattr(matrix, "shape", ())) != shape or not hasattr(matrix, "panels"):
                    raise ValueError(f"block {i}: {name} is not a packed [{shape[0]}, {shape[1]}] matrix")
                if matrix.dtype == "bfloat16":
                    raise ValueError(f"block {i}: {name} is bfloat16, not these blocks' to run (models/llama.blocks_into)")
            packed_gemm.bind_weight(p.qkv, shapes["qkv"][1], &self.blocks[i].qkv)
            packed_gemm.bind_weight(p.o, self.C, &self.blocks[i].o)
            packed_gemm.bind_weight(p.gate_up, 2 * self.I, &self.blocks[i].gate_up)
            packed_gemm.bind_weight(p.down, self.C, &self.blocks[i].down)
            self.blocks[i].input_norm = _norm(p.attn_norm, "attn_norm", self.C, i, False)
            self.blocks[i].mlp_norm = _norm(p.mlp_norm, "mlp_norm", self.C, i, False)
            self.blocks[i].q_norm = _norm(p.q_norm, "q_norm", self.D, i, True)
            self.blocks[i].k_norm = _norm(p.k_norm, "k_norm", self.D, i, True)
            if (self.blocks[i].q_norm == NULL) != (self.blocks[i].k_norm == NULL):
                raise ValueError(f"block {i}: a q_norm without a k_norm, or the reverse")
            self.blocks[i].attn_out_norm = _norm(p.attn_out_norm, "attn_out_norm", self.C, i, True)
            self.blocks[i].mlp_out_norm = _norm(p.mlp_out_norm, "mlp_out_norm", self.C, i, True)
            self.blocks[i].qkv_bias = _norm(p.qkv_bias, "qkv_bias", shapes["qkv"][1], i, True)
            self.blocks[i].o_bias = _norm(p.o_bias, "o_bias", self.C, i, True)
            self.blocks[i].local_rope = bool(local[i])
            keep.append(p)
        self.keep = keep

    def __dealloc__(self):
        free(self.blocks)

    def run(self, float[:, ::1] x, buf, const float[:, ::1] cos, const float[:, ::1] sin,
            k_cache, v_cache, const int[:, ::1] block_tables,
            const int[::1] token_seq, const int[::1] token_pos, Py_ssize_t max_ctx, float scale,
            int num_threads=0, *, const float[:, ::1] cos_local=None, const float[:, ::1] sin_local=None,
            k_window=None, v_window=None, const int[:, ::1] window_tables=None,
            const int[:, ::1] layer_slots=None, float softcap=0.0, k_scale=None, v_scale=None,
            k_window_scale=None, v_window_scale=None, const int[::1] out_rows=None):
        """x [N, C], the residual stream, through every block in place; `buf`: the step's
        StepBuffers (models/workspace.py) of N rows. The attention is the engine's paged one
        (engine/paged_attention.PagedAttention): its pools [L, blocks, ...] of any KV-cache element
        kind (with an int8 pool's scales, k_scale and v_scale) and the step's layout, which must
        have passed layout_context (max_ctx is what it returned).

        With sliding windows the attention keeps a second pool for the windowed layers
        (k_window, v_window and their scales, read through window_tables); `layer_slots` [L, 3]
        says, per layer, its pool (0 or 1), its index in that pool and its window in tokens (0:
        none). Without it, layer i is index i of the first pool, with no window. `softcap`: of the
        scores (0: off). cos_local, sin_local: the angles of the layers that rotate by the second
        rope.

        `out_rows` (strictly increasing row indices, or None: all): the rows whose output is used
        (those that get logits). The last block then runs its attention's output projection and
        its MLP on those rows only, moved to the front of x: x[:len(out_rows)] is what x[out_rows]
        would have been, bit for bit (every kernel computes a row alone); the other rows of x are
        left undefined. Every row's K and V are written as before."""
        cdef Py_ssize_t N = x.shape[0], C = self.C, I = self.I, H = self.H, KVH = self.KVH, D = self.D
        cdef Py_ssize_t W = (H + 2 * KVH) * D, layer
        cdef KVCache kvs[2]
        paged_attention.kv_cache(k_cache, v_cache, k_scale, v_scale, &kvs[0])
        kvs[1] = kvs[0]
        if (k_window is None) != (v_window is None):
            raise ValueError("the windowed pool needs both its keys and its values")
        if k_window is not None:
            paged_attention.kv_cache(k_window, v_window, k_window_scale, v_window_scale, &kvs[1])
        cdef float[:, ::1] h = buf.h, qkv = buf.qkv_rows, attn = buf.attn_rows, delta = buf.delta
        cdef float[:, ::1] gate_up = buf.gate_up, act = buf.act
        if (h.shape[0] != N or qkv.shape[0] != N or attn.shape[0] != N or delta.shape[0] != N
                or gate_up.shape[0] != N or act.shape[0] != N or x.shape[1] != C or h.shape[1] != C
                or qkv.shape[1] != W or attn.shape[1] != H * D or delta.shape[1] != C or gate_up.shape[1] != 2 * I
                or act.shape[1] != I):
            raise ValueError(f"buffers of {N} rows do not fit x {tuple(x.shape)[:2]} and this model")
        if cos.shape[0] != N or sin.shape[0] != N or cos.shape[1] != D // 2 or sin.shape[1] != D // 2:
            raise ValueError(f"rotary angles must be [{N}, {D // 2}]")
        cdef bint any_local = False
        for layer in range(self.num_layers):
            any_local = any_local or self.blocks[layer].local_rope
        if any_local and (cos_local is None or sin_local is None or cos_local.shape[0] != N
                          or sin_local.shape[0] != N or cos_local.shape[1] != D // 2 or sin_local.shape[1] != D // 2):
            raise ValueError(f"the second rope's rotary angles must be [{N}, {D // 2}]")
        # each layer's (pool, index in it, window); each pool's layers must be exactly those slotted to it
        cdef const int *rows = NULL  # out_rows' first, or NULL
        cdef Py_ssize_t i
        cdef int *slots = <int *> malloc(max(1, 3 * self.num_layers) * sizeof(int))
        if slots == NULL:
            raise MemoryError()
        try:
            _read_slots(layer_slots, self.num_layers, kvs, 1 if k_window is None else 2, KVH, D, slots)
            if token_seq.shape[0] != N or token_pos.shape[0] != N:
                raise ValueError(f"the layout has {token_pos.shape[0]} tokens, the step {N}")
            if k_window is not None and (window_tables is None or window_tables.shape[0] != block_tables.shape[0]):
                raise ValueError("a windowed pool needs window_tables, a row per sequence")
            if softcap < 0:
                raise ValueError(f"softcap must be >= 0, got {softcap}")
            if out_rows is not None and out_rows.shape[0]:
                rows = &out_rows[0]
            if out_rows is not None:
                for i in range(out_rows.shape[0]):
                    if not (out_rows[i] < N and (out_rows[i] >= 0 if i == 0 else out_rows[i] > out_rows[i - 1])):
                        raise ValueError(f"out_rows must be strictly increasing rows of the {N}")
            self._run(x, h, qkv, attn, delta, gate_up, act, cos, sin, cos_local if any_local else cos,
                      sin_local if any_local else sin, kvs, block_tables, window_tables if k_window is not None
                      else None, token_seq, token_pos, max_ctx, scale, softcap, num_threads, slots, rows,
                      -1 if out_rows is None else out_rows.shape[0])
        finally:
            free(slots)

    cdef void _run(self, float[:, ::1] x, float[:, ::1] h, float[:, ::1] qkv, float[:, ::1] attn,
                   float[:, ::1] delta, float[:, ::1] gate_up, float[:, ::1] act, const float[:, ::1] cos,
                   const float[:, ::1] sin, const float[:, ::1] cos_local, const float[:, ::1] sin_local,
                   const KVCache *kvs, const int[:, ::1] block_tables, const int[:, ::1] window_tables,
                   const int[::1] token_seq, const int[::1] token_pos, Py_ssize_t max_ctx, float scale,
                   float softcap, int num_threads, const int *slots, const int *out_rows, Py_ssize_t nout) except *:
        cdef Py_ssize_t N = x.shape[0], C = self.C, I = self.I, H = self.H, KVH = self.KVH, D = self.D
        cdef Py_ssize_t W = (H + 2 * KVH) * D, layer
        self.matmul_ns = self.attention_ns = self.other_ns = 0
        if N == 0:
            return
        cdef PagedLayout layouts[2]
        layouts[0].block_tables, layouts[0].token_seq, layouts[0].token_pos = &block_tables[0, 0], &token_seq[0], &token_pos[0]
        layouts[0].N, layouts[0].MB, layouts[0].max_ctx = N, block_tables.shape[1], max_ctx
        layouts[1] = layouts[0]
        if window_tables is not None:  # the windowed layers' pool (kvs[1]) through their own tables
            layouts[1].block_tables, layouts[1].MB = &window_tables[0, 0], window_tables.shape[1]
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
        cdef const float *cp
        cdef const float *sp
        cdef Py_ssize_t ldc, lds
        cdef const Block *b
        cdef long long t0, t1, mm = 0, at = 0, other = 0
        cdef Py_ssize_t i, j, pool_index
        cdef int group
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
                if b.qkv_bias != NULL:  # linear_into's `out += b`: one float32 add per element
                    _add_bias(qkvp, ldq, b.qkv_bias, N, W)
                if b.q_norm != NULL:  # QK-norm: each head of q and of k a row of its own (llama.head_norm_)
                    for i in range(N):
                        pointwise.rms_norm_rows(qkvp + i * ldq, D, b.q_norm, self.eps, qkvp + i * ldq, D, H, D)
                        pointwise.rms_norm_rows(qkvp + i * ldq + H * D, D, b.k_norm, self.eps, qkvp + i * ldq + H * D,
                                                D, KVH, D)
                if b.local_rope:
                    cp, sp, ldc, lds = &cos_local[0, 0], &sin_local[0, 0], cos_local.strides[0] // 4, sin_local.strides[0] // 4
                else:
                    cp, sp, ldc, lds = &cos[0, 0], &sin[0, 0], cos.strides[0] // 4, sin.strides[0] // 4
                pointwise.rope_rows(qkvp, ldq, D, N, H + KVH, D, cp, ldc, sp, lds)
                t1 = _now_ns(); other += t1 - t0; t0 = t1
                group, pool_index = slots[3 * layer], slots[3 * layer + 1]
                paged_attention.attend_layer(qkvp, ldq, D, 1, qkvp + H * D, ldq, D, 1, qkvp + (H + KVH) * D, ldq,
                                             D, 1, &kvs[group], pool_index, &layouts[group], slots[3 * layer + 2],
                                             softcap, H, scale, attnp, num_threads)
                t1 = _now_ns(); at += t1 - t0; t0 = t1
                if nout >= 0 and layer == self.num_layers - 1:  # the rest of the last block: the used rows only
                    for i in range(nout):
                        if out_rows[i] != i:
                            memcpy(attnp + i * lda_attn, attnp + out_rows[i] * lda_attn, H * D * sizeof(float))
                            memcpy(xp + i * ldx, xp + out_rows[i] * ldx, C * sizeof(float))
                    N = nout
                packed_gemm.gemm(&b.o, attnp, N, dp)
                t1 = _now_ns(); mm += t1 - t0; t0 = t1
                if b.o_bias != NULL:
                    _add_bias(dp, ldd, b.o_bias, N, C)
                if b.attn_out_norm != NULL:
                    pointwise.rms_norm_rows(dp, ldd, b.attn_out_norm, self.eps, dp, ldd, N, C)
                pointwise.add_rms_norm_rows(xp, ldx, dp, ldd, b.mlp_norm, self.eps, hp, ldh, N, C)
                t1 = _now_ns(); other += t1 - t0; t0 = t1
                packed_gemm.gemm(&b.gate_up, hp, N, gup)
                t1 = _now_ns(); mm += t1 - t0; t0 = t1
                if self.gelu:
                    pointwise.gelu_tanh_mul_rows(gup, ldg, actp, lda, N, I)
                else:
                    pointwise.silu_mul_rows(gup, ldg, actp, lda, N, I)
                t1 = _now_ns(); other += t1 - t0; t0 = t1
                packed_gemm.gemm(&b.down, actp, N, dp)
                t1 = _now_ns(); mm += t1 - t0; t0 = t1
                if b.mlp_out_norm != NULL:
                    pointwise.rms_norm_rows(dp, ldd, b.mlp_out_norm, self.eps, dp, ldd, N, C)
                    t1 = _now_ns(); other += t1 - t0; t0 = t1
            if self.num_layers:  # the last block's MLP output
                for i in range(N):
                    for j in range(C):
                        xp[i * ldx + j] = xp[i * ldx + j] + dp[i * ldd + j]
            other += _now_ns() - t0
        self.matmul_ns, self.attention_ns, self.other_ns = mm, at, other


cdef inline void _add_bias(float *y, Py_ssize_t ld, const float *bias, Py_ssize_t N, Py_ssize_t W) noexcept nogil:
    cdef Py_ssize_t i, j
    for i in range(N):
        for j in range(W):
            y[i * ld + j] = y[i * ld + j] + bias[j]


cdef const float *_norm(norm, str name, Py_ssize_t size, Py_ssize_t i, bint optional) except? NULL:
    """The pointer to block i's norm weight (or bias) `norm` (its role `name`) of `size` floats; NULL
    for an optional one it lacks."""
    cdef const float[::1] w
    if norm is None:
        if optional:
            return NULL
        raise ValueError(f"block {i} lacks {name}")
    if norm.shape != (size,):
        raise ValueError(f"block {i}: {name} has shape {norm.shape}, expected ({size},)")
    w = norm
    return &w[0]


cdef int _read_slots(const int[:, ::1] layer_slots, Py_ssize_t L, const KVCache *kvs, int pools, Py_ssize_t KVH,
                     Py_ssize_t D, int *slots) except -1:
    """slots[3 layer ..]: (pool, index in it, window) of each layer, checked against the pools."""
    cdef Py_ssize_t layer, g
    cdef Py_ssize_t count[2]
    count[0] = count[1] = 0
    if layer_slots is None:
        for layer in range(L):
            slots[3 * layer], slots[3 * layer + 1], slots[3 * layer + 2] = 0, layer, 0
    elif layer_slots.shape[0] != L or layer_slots.shape[1] != 3:
        raise ValueError(f"layer_slots must be [{L}, 3]")
    else:
        for layer in range(L):
            slots[3 * layer], slots[3 * layer + 1], slots[3 * layer + 2] = (
                layer_slots[layer, 0], layer_slots[layer, 1], layer_slots[layer, 2])
    for layer in range(L):
        if not 0 <= slots[3 * layer] < pools or slots[3 * layer + 2] < 0:
            raise ValueError(f"layer {layer}: pool {slots[3 * layer]} of {pools}, window {slots[3 * layer + 2]}")
        count[slots[3 * layer]] += 1
    for g in range(pools):
        if (kvs[g].num_layers != count[g] or kvs[g].KVH != KVH or kvs[g].D != D or kvs[g].BS != kvs[0].BS
                or kvs[g].kind != kvs[0].kind):
            raise ValueError("the KV pools do not fit this model")
    for layer in range(L):
        if not 0 <= slots[3 * layer + 1] < count[slots[3 * layer]]:
            raise ValueError(f"layer {layer}: index {slots[3 * layer + 1]} outside its pool")
    return 0
