# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Paged attention over block tables: packed tokens of many sequences, K/V in fixed-size blocks.

One call per layer does two things, in this order:
  1. write this step's k, v of every token into its slot of the paged pool
     (slot of position p of sequence s: block block_tables[s, p // BS], offset p % BS);
  2. for every token i (sequence s, position p) and every query head, attend causally over
     the keys at positions 0..p of sequence s (a layer with a sliding window of w tokens: the
     keys at p - w + 1..p), reading them through the block table where they lie: no gather
     into a contiguous copy, ever. A windowed layer reads only the table entries of its window,
     so the engine may drop (and mark -1) the entries before it.
Writing first makes causality inside a prefill chunk free: token i sees the chunk's earlier
tokens because they are already in the pool.

Layouts (per layer), chosen for the two inner loops:
  K: [num_blocks, KVH, D, BS] - a block's keys transposed, so the 16 scores of a block are
     16 SIMD lanes: s[0:BS] += q[d] * K[blk, g, d, 0:BS]. A dot product per key would end in
     a horizontal sum per key and head, which on this CPU cost more than the multiplies.
  V: [num_blocks, BS, KVH, D] - out[h, 0:D] += p[t] * V[blk, t, g, 0:D], D lanes.

Element kinds (the KV-cache dtype): float32, float16, bfloat16 or int8, read in place: each key
or value vector is widened to float32 in registers as the loops load it (paged_attention.h), so a
16-bit cache reads half the bytes of a float32 one and an int8 cache a quarter. float16 and
bfloat16 hold k and v rounded to nearest even. int8 holds round(x / scale), with one float32
scale per (block, kv head) for K and one for V (arrays [num_blocks, KVH] per layer): the scale is
max |x| / 127 over the slots written so far. Slots are written in position order, so a block
starts at its slot 0 (scale reset) and grows; a token whose |x| exceeds the block's range raises
the scale and the slots already there are requantized to it (round(q * old / new)). The values a
block holds thus depend only on its own sequence's tokens, in order: a request's logits are the
same alone or in any batch. The scores of a block are scaled once (s = scale_k * sum q k8) and
its probabilities once (p' = p * scale_v) rather than each element.

Work split: one work item = one (token, kv head) pair, and it computes the G query heads that
share that kv head together. So every key and value vector is loaded once for G heads (GQA: G
independent FMA chains per load instead of G passes over the block), and a decode step of 16
sequences is 48 items, enough to keep two threads busy. Items are the tasks of our thread pool
(scratchllm/kernels/pool.pyx), taken one at a time: a long prefill's late tokens cost more than
its early ones, and a thread the OS has paused does not hold back items the other thread could
take, nor make the call wait for it at a barrier.

Per item: queries pre-scaled (by the model's softmax scale, 1/sqrt(D) unless it says otherwise);
the scores of the G heads over the context (or the window's blocks; the keys of the first block
before the window's start get a score whose exp is exactly 0); tanh soft-capping if the layer
has it (Gemma 2, after the scale and before the softmax); their max, exp (our own 16-lane
polynomial) and sum; then the weighted sum of values, written
straight into `out` (the G heads of a kv head are adjacent there) and divided by the sum once.

Long contexts, split (flash-decoding): a query whose keys span more than one chunk of
SPLIT_TOKENS positions (256; chunks in whole blocks counted from position 0, so a chunk's bounds
are a function of positions only) is attended chunk by chunk: each chunk's max m_c, sum of exp
s_c and unnormalized weighted values o_c, then, in chunk order, M = max m_c and
out = sum exp(m_c - M) o_c / sum exp(m_c - M) s_c. A query within one chunk is the single pass
above, bit for bit. Where there are few (token, kv head) items for the threads (a decode of one
or two sequences) every chunk is a pool task and the combination a second pass; otherwise each
item does its chunks in turn. Either way the partials and the sums are the same operations in
the same order, so a token's output depends on its own context only: the same request alone or
in any batch, chunked or split or not, gets the same bits.
"""

from libc.math cimport expf, fabsf
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from scratchllm.kernels cimport pool


cdef extern from "paged_attention.h":
    const Py_ssize_t* kv_itemsize "scratchllm_kv_itemsize"
    void block_scores16 "scratchllm_block_scores16"(const float* q, Py_ssize_t G, const void* kt, float* s,
                                                    Py_ssize_t ss, Py_ssize_t D, int kind) noexcept nogil
    void block_values16 "scratchllm_block_values16"(const float* p, Py_ssize_t ps, Py_ssize_t G, const void* v,
                                                    Py_ssize_t vs, Py_ssize_t m, float* acc, Py_ssize_t D,
                                                    int kind) noexcept nogil
    float kv_get "scratchllm_kv_get"(const void* base, Py_ssize_t i, int kind) noexcept nogil
    void kv_put "scratchllm_kv_put"(void* base, Py_ssize_t i, float x, int kind, float inv_scale) noexcept nogil
    float exp_rows_max "scratchllm_exp_rows_max"(float* s, Py_ssize_t n, float* m) noexcept nogil
    void softcap_rows "scratchllm_softcap_rows"(float* s, Py_ssize_t n, float cap) noexcept nogil
    void mask_rows "scratchllm_mask_rows"(float* s, Py_ssize_t n) noexcept nogil
    int KV_F32 "SCRATCHLLM_KV_F32"
    int KV_I8 "SCRATCHLLM_KV_I8"


# A context longer than this many positions is attended in chunks of it (whole blocks, counted from
# position 0), combined in order: a fixed split, so a token's bits depend only on its own context
# (module doc). Chunks also make tasks: a decode step of one sequence at 4,096 positions is 3 kv
# heads x 16 chunks, not 3 tasks for 2 threads.
cdef enum:
    SPLIT_TOKENS = 256
    SPLIT_MIN_TASKS = 4  # per thread: fewer (token, kv head) items than this, and chunks are tasks

# the NumPy dtype of each kind's elements (bfloat16 has none: its bits are kept as uint16)
KINDS = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3}
_KIND_OF_ARRAY = {"float32": 0, "float16": 1, "uint16": 2, "int8": 3}


cdef char* _address(object array, Py_ssize_t nbytes, str name) except NULL:
    """The first byte of a writable C-contiguous array of nbytes (a byte view: any element type)."""
    cdef unsigned char[::1] raw = memoryview(array).cast("B")
    if raw.shape[0] != nbytes or nbytes == 0:
        raise ValueError(f"{name} holds {raw.shape[0]} bytes, expected {nbytes}")
    return <char*> &raw[0]


cdef int kv_cache(object k_cache, object v_cache, object k_scale, object v_scale, KVCache *out) except -1:
    ks, vs = tuple(k_cache.shape), tuple(v_cache.shape)
    if len(ks) == 4:  # one layer
        ks, vs = (1,) + ks, (1,) + vs
    if len(ks) != 5 or len(vs) != 5:
        raise ValueError(f"KV pools must be [L, blocks, KVH, D, BS] and [L, blocks, BS, KVH, D], got {ks} and {vs}")
    L, NB, KVH, D, BS = ks
    if vs != (L, NB, BS, KVH, D):
        raise ValueError(f"the V pool {vs} does not match the K pool {ks}")
    kind = _KIND_OF_ARRAY.get(k_cache.dtype.name, -1)
    if kind < 0 or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"KV pools of {k_cache.dtype} and {v_cache.dtype}: both float32, float16, uint16 "
                        "(bfloat16 bits) or int8")
    cdef Py_ssize_t nbytes = L * NB * KVH * D * BS * kv_itemsize[kind]
    out.k = _address(k_cache, nbytes, "the K pool")
    out.v = _address(v_cache, nbytes, "the V pool")
    out.k_scale = out.v_scale = NULL
    if kind == KV_I8:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 KV cache needs its K and V scales")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s.dtype.name != "float32" or s.size != L * NB * KVH:
                raise ValueError(f"{name} must be float32 [{L}, {NB}, {KVH}], got {s.dtype} {tuple(s.shape)}")
        out.k_scale = <float*> _address(k_scale, L * NB * KVH * 4, "k_scale")
        out.v_scale = <float*> _address(v_scale, L * NB * KVH * 4, "v_scale")
    out.num_layers, out.num_blocks, out.KVH, out.D, out.BS = L, NB, KVH, D, BS
    out.itemsize, out.kind = kv_itemsize[kind], kind
    return 0


cdef inline void block_scores(const float* q, Py_ssize_t G, const char* kt, int kind, float* s, Py_ssize_t ss,
                              Py_ssize_t D, Py_ssize_t BS) noexcept nogil:
    """s[j * ss + 0:BS] = K_block[0:BS] . q_j for G heads: kt is the block's [D, BS] transposed keys."""
    cdef Py_ssize_t j, d, o
    cdef float qd
    if BS == 16:
        block_scores16(q, G, kt, s, ss, D, kind)
        return
    for j in range(G):  # other block sizes: the plain loop
        for o in range(BS):
            s[j * ss + o] = 0.0
        for d in range(D):
            qd = q[j * D + d]
            for o in range(BS):
                s[j * ss + o] += qd * kv_get(kt, d * BS + o, kind)


cdef inline void block_values(const float* p, Py_ssize_t ps, Py_ssize_t G, const char* v, int kind, Py_ssize_t vs,
                              Py_ssize_t m, float* acc, Py_ssize_t D) noexcept nogil:
    """acc[j * D + 0:D] += sum over t < m of p[j * ps + t] * v[t * vs + 0:D], for G heads."""
    cdef Py_ssize_t j, t, d
    cdef float w
    if D % 16 == 0:
        block_values16(p, ps, G, v, vs, m, acc, D, kind)
        return
    for t in range(m):  # other head sizes: the plain loop
        for j in range(G):
            w = p[j * ps + t]
            for d in range(D):
                acc[j * D + d] += w * kv_get(v, t * vs + d, kind)


def layout_context(const int[:, ::1] block_tables, const int[::1] token_seq, const int[::1] token_pos,
                   Py_ssize_t block_size, Py_ssize_t num_blocks):
    """Check a step's layout against the pool once per step (not once per layer); returns the
    longest context of the step (max position + 1), which sizes the kernel's score buffers."""
    cdef Py_ssize_t i, p, blk, max_ctx = 0, N = token_pos.shape[0]
    assert token_seq.shape[0] == N
    for i in range(N):
        p = token_pos[i]
        assert 0 <= token_seq[i] < block_tables.shape[0], "sequence beyond the block table"
        assert 0 <= p < block_tables.shape[1] * block_size, "position beyond the block table"
        blk = block_tables[token_seq[i], p // block_size]
        assert 0 <= blk < num_blocks, "block id out of the pool"
        if p + 1 > max_ctx:
            max_ctx = p + 1
    return max_ctx


cdef struct AttentionJob:
    const float* q  # [N, H, D] at element strides qs0, qs1, qs2
    Py_ssize_t qs0, qs1, qs2
    const char* k_cache  # [num_blocks, KVH, D, BS] elements of `kind`
    const char* v_cache  # [num_blocks, BS, KVH, D]
    const float* k_scale  # [num_blocks, KVH] (int8), else NULL
    const float* v_scale
    int kind
    Py_ssize_t itemsize
    float* out  # [N, H, D]
    const int* block_tables  # [S, MB]
    const int* token_seq
    const int* token_pos
    Py_ssize_t MB, H, KVH, G, D, BS, ctx_pad
    Py_ssize_t window  # 0: the whole context; w: the keys at p - w + 1..p
    float scale
    float softcap  # 0: off
    # the split of long contexts (see the module doc): tasks of (token, kv head, chunk) and where
    # each (token, kv head)'s chunk partials go; NULL when the step runs one task per (token, kv head)
    Py_ssize_t chunk_tokens  # positions per chunk: SPLIT_TOKENS in whole blocks
    const Py_ssize_t* task_start  # [N + 1]: token i's first task (its tasks: KVH x its chunks)
    const Py_ssize_t* part_start  # [N]: token i's first partial, in units of a partial's floats
    float* parts


cdef inline Py_ssize_t first_key(const AttentionJob* j, Py_ssize_t p) noexcept nogil:
    """The first position the query at p reads: p - window + 1, or 0."""
    return p - j.window + 1 if j.window and p >= j.window else 0


cdef inline Py_ssize_t num_chunks(const AttentionJob* j, Py_ssize_t p) noexcept nogil:
    """The chunks (of chunk_tokens positions from position 0) the query at p reads."""
    return p // j.chunk_tokens - first_key(j, p) // j.chunk_tokens + 1


cdef inline Py_ssize_t chunk_span(const AttentionJob* j) noexcept nogil:
    """A chunk's scores row: its positions rounded up to 16 (whole vectors for the softmax)."""
    return (j.chunk_tokens + 15) // 16 * 16


cdef void attend_range(const AttentionJob* j, Py_ssize_t i, Py_ssize_t g, Py_ssize_t c0, Py_ssize_t c,
                       float* scores, Py_ssize_t ss, float* o, float* m_out, float* sum_out) noexcept nogil:
    """Token i, kv head g, over chunk c (counted from the first chunk c0 it reads; c0 < 0: its whole
    context in one pass): the G heads' unnormalized o[h * D + 0:D] = sum of exp(s - m) v over the
    chunk's keys, m_out[h] = m (their max score) and sum_out[h] = sum of exp(s - m).
    scores: G rows of ss floats, ss >= the keys of the range rounded up to 16."""
    cdef Py_ssize_t G = j.G, D = j.D, BS = j.BS, H = j.H, KVH = j.KVH
    cdef Py_ssize_t p = j.token_pos[i], lo = first_key(j, p)
    cdef Py_ssize_t b0 = lo // BS, b_end = p // BS + 1, b, blk, h, d, t, m, n, first
    cdef Py_ssize_t chunk_blocks = j.chunk_tokens // BS
    if c0 >= 0:  # absolute chunk c0 + c: its blocks, within the query's
        b0, b_end = max(b0, (c0 + c) * chunk_blocks), min(b_end, (c0 + c + 1) * chunk_blocks)
    first = b0 * BS
    n = min(p + 1, b_end * BS) - first  # keys first..; those before lo (its window) are masked
    cdef Py_ssize_t kblock = KVH * D * BS * j.itemsize, vrow = KVH * D
    cdef const int* table = j.block_tables + j.token_seq[i] * j.MB
    cdef float sc
    cdef float* qs = scores + G * ss
    for h in range(G):  # queries pre-scaled: G x D multiplies, not G x ctx
        for d in range(D):
            qs[h * D + d] = j.q[i * j.qs0 + (g * G + h) * j.qs1 + d * j.qs2] * j.scale
            o[h * D + d] = 0.0
    for b in range(b0, b_end):  # one table lookup per block
        blk = table[b]
        block_scores(qs, G, j.k_cache + blk * kblock + g * D * BS * j.itemsize, j.kind, &scores[(b - b0) * BS], ss,
                     D, BS)
        if j.k_scale != NULL:  # int8: the block's scores in units of its scale
            sc = j.k_scale[blk * KVH + g]
            for h in range(G):
                for t in range(BS):
                    scores[h * ss + (b - b0) * BS + t] *= sc
    for h in range(G):
        if j.softcap != 0.0:
            softcap_rows(&scores[h * ss], n, j.softcap)
        if lo > first:  # the window starts inside the range's first block
            mask_rows(&scores[h * ss], lo - first)
        # softmax numerators; the division by their sum comes last
        sum_out[h] = exp_rows_max(&scores[h * ss], n, &m_out[h])
    for b in range(b0, b_end):
        blk = table[b]
        m = min(BS, n - (b - b0) * BS)
        if j.v_scale != NULL:  # int8: the block's probabilities times its scale
            sc = j.v_scale[blk * KVH + g]
            for h in range(G):
                for t in range(m):
                    scores[h * ss + (b - b0) * BS + t] *= sc
        block_values(&scores[(b - b0) * BS], ss, G, j.v_cache + (blk * BS * vrow + g * D) * j.itemsize, j.kind,
                     vrow, m, o, D)


cdef inline float* out_row(const AttentionJob* j, Py_ssize_t i, Py_ssize_t g) noexcept nogil:
    return j.out + (i * j.H + g * j.G) * j.D  # the G heads of kv head g: adjacent rows of out


cdef void combine(const AttentionJob* j, Py_ssize_t i, Py_ssize_t g, const float* parts, Py_ssize_t nc) noexcept nogil:
    """out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) sum_c over token i's chunks in order (M: the
    largest m_c): the softmax over the whole context from its chunks' (partial layout: chunk c's
    G heads' [o (D), m, sum], c = 0..nc-1)."""
    cdef Py_ssize_t G = j.G, D = j.D, h, d, c, stride = G * (D + 2)
    cdef float* o = out_row(j, i, g)
    cdef float big, w, den
    cdef const float* part
    for h in range(G):
        big = -3.0e38
        for c in range(nc):
            big = max(big, parts[c * stride + h * (D + 2) + D])
        for d in range(D):
            o[h * D + d] = 0.0
        den = 0.0
        for c in range(nc):
            part = parts + c * stride + h * (D + 2)
            w = expf(part[D] - big)
            den = den + w * part[D + 1]
            for d in range(D):
                o[h * D + d] = o[h * D + d] + w * part[d]
        w = 1.0 / den
        for d in range(D):
            o[h * D + d] = o[h * D + d] * w


cdef inline void chunk_into(const AttentionJob* j, Py_ssize_t i, Py_ssize_t g, Py_ssize_t c, float* scores,
                            float* part) noexcept nogil:
    """Chunk c of token i, kv head g, into its partial: G heads' [o (D), m, sum]."""
    cdef Py_ssize_t G = j.G, D = j.D, h, d, ss = chunk_span(j)
    cdef float* o = scores + G * ss + G * D  # after the scores and the queries
    cdef float* m = o + G * D
    cdef float* sums = m + G
    attend_range(j, i, g, first_key(j, j.token_pos[i]) // j.chunk_tokens, c, scores, ss, o, m, sums)
    for h in range(G):
        for d in range(D):
            part[h * (D + 2) + d] = o[h * D + d]
        part[h * (D + 2) + D] = m[h]
        part[h * (D + 2) + D + 1] = sums[h]


cdef void attend_item(void* ctx, long w) noexcept nogil:
    """Task w = token w // KVH, kv head w % KVH: its G query heads over the token's context; a
    context longer than one chunk, chunk by chunk (the same partials as the split tasks), combined."""
    cdef AttentionJob* j = <AttentionJob*> ctx
    cdef Py_ssize_t G = j.G, D = j.D, KVH = j.KVH
    cdef Py_ssize_t i = w // KVH, g = w % KVH, c, nc = num_chunks(j, j.token_pos[i])
    cdef Py_ssize_t chunk_ss = chunk_span(j), stride = G * (D + 2)
    cdef float* scores
    cdef float* parts
    cdef float* inv
    cdef Py_ssize_t h, d
    if nc == 1:  # the whole context in one pass, normalized in place
        scores = <float*> malloc((G * j.ctx_pad + G * D + 2 * G) * sizeof(float))
        if scores == NULL:
            return  # out of memory in a worker: the row stays as np.empty left it (cannot raise here)
        inv = scores + G * j.ctx_pad + G * D
        attend_range(j, i, g, -1, 0, scores, j.ctx_pad, out_row(j, i, g), inv + G, inv)
        for h in range(G):
            inv[h] = 1.0 / inv[h]
            for d in range(D):
                out_row(j, i, g)[h * D + d] = out_row(j, i, g)[h * D + d] * inv[h]
        free(scores)
        return
    scores = <float*> malloc((G * chunk_ss + 2 * G * D + 2 * G + nc * stride) * sizeof(float))
    if scores == NULL:
        return
    parts = scores + G * chunk_ss + 2 * G * D + 2 * G
    for c in range(nc):
        chunk_into(j, i, g, c, scores, parts + c * stride)
    combine(j, i, g, parts, nc)
    free(scores)


cdef void chunk_task(void* ctx, long w) noexcept nogil:
    """Split mode, task w: (token i, kv head g, chunk c) into its partial in j.parts."""
    cdef AttentionJob* j = <AttentionJob*> ctx
    cdef Py_ssize_t G = j.G, D = j.D, i = 0, local, nc, g, c
    while j.task_start[i + 1] <= w:  # the token: split mode has few tokens, a scan is enough
        i += 1
    local = w - j.task_start[i]
    nc = num_chunks(j, j.token_pos[i])
    g, c = local % j.KVH, local // j.KVH  # a token's tasks: chunk by chunk, every kv head of each
    cdef float* scores = <float*> malloc((G * chunk_span(j) + 2 * G * D + 2 * G) * sizeof(float))
    if scores == NULL:
        return
    chunk_into(j, i, g, c, scores, j.parts + (j.part_start[i] + g * nc + c) * G * (D + 2))
    free(scores)


cdef void combine_task(void* ctx, long w) noexcept nogil:
    """Split mode: (token w // KVH, kv head w % KVH)'s chunks combined into out."""
    cdef AttentionJob* j = <AttentionJob*> ctx
    cdef Py_ssize_t i = w // j.KVH, g = w % j.KVH, nc = num_chunks(j, j.token_pos[i])
    combine(j, i, g, j.parts + (j.part_start[i] + g * nc) * j.G * (j.D + 2), nc)


def paged_attention(
    const float[:, :, :] q,  # [N, H, D] any strides: views into the model's fused qkv output
    const float[:, :, :] k,  # [N, KVH, D]
    const float[:, :, :] v,  # [N, KVH, D]
    k_cache,  # [num_blocks, KVH, D, BS]  (keys transposed per block): float32, float16, uint16 (bfloat16), int8
    v_cache,  # [num_blocks, BS, KVH, D], the same kind
    const int[:, ::1] block_tables,  # [S, max_blocks]
    const int[::1] token_seq,  # [N] which row of block_tables
    const int[::1] token_pos,  # [N] position in its sequence
    float scale,
    float[:, :, ::1] out,  # [N, H, D]
    Py_ssize_t max_ctx,  # layout_context(block_tables, token_seq, token_pos, ...) of this layout
    int num_threads=0,
    Py_ssize_t window=0,  # the layer's sliding window in tokens; 0: the whole context
    float softcap=0.0,  # tanh soft-capping of the scores; 0: off
    k_scale=None,  # int8: [num_blocks, KVH] float32 scales of K, and of V
    v_scale=None,
):
    """The layout must have passed layout_context against a pool of this shape: the kernel
    trusts its block ids and positions (checking them is per step, this call is per layer)."""
    cdef KVCache kv
    kv_cache(k_cache, v_cache, k_scale, v_scale, &kv)
    cdef Py_ssize_t N = q.shape[0], H = q.shape[1], D = q.shape[2]
    cdef Py_ssize_t KVH = k.shape[1]
    cdef Py_ssize_t G = H // KVH

    assert H == KVH * G, "query heads must group evenly over kv heads"
    assert k.shape[0] == N and v.shape[0] == N and out.shape[0] == N and token_pos.shape[0] == N
    assert token_seq.shape[0] == N and out.shape[1] == H and out.shape[2] == D
    assert k.shape[2] == D and v.shape[1] == KVH and v.shape[2] == D
    assert kv.KVH == KVH and kv.D == D, "the pool's heads and head size are the step's"
    assert window >= 0 and softcap >= 0.0, "a window and a soft-cap are >= 0"
    if N == 0:
        return
    cdef PagedLayout layout
    layout.block_tables, layout.token_seq, layout.token_pos = &block_tables[0, 0], &token_seq[0], &token_pos[0]
    layout.N, layout.MB, layout.max_ctx = N, block_tables.shape[1], max_ctx
    with nogil:
        attend_layer(&q[0, 0, 0], q.strides[0] // 4, q.strides[1] // 4, q.strides[2] // 4,
                     &k[0, 0, 0], k.strides[0] // 4, k.strides[1] // 4, k.strides[2] // 4,
                     &v[0, 0, 0], v.strides[0] // 4, v.strides[1] // 4, v.strides[2] // 4,
                     &kv, 0, &layout, window, softcap, H, scale, &out[0, 0, 0], num_threads)


cdef inline void write_slot(char* base, int kind, Py_ssize_t start, Py_ssize_t slot_stride, Py_ssize_t elem_stride,
                            Py_ssize_t off, float* scale, const float* x, Py_ssize_t xs, Py_ssize_t D) noexcept nogil:
    """Slot `off` of one (block, kv head): its D elements x[d * xs] go to base[start + off * slot_stride
    + d * elem_stride] (indices in elements of `kind`). int8 (`scale`: the block and head's): slot 0
    starts the block afresh; a slot whose max |x| exceeds the range of the scale raises the scale to
    max |x| / 127 and requantizes the slots before it."""
    cdef Py_ssize_t d, t, i
    cdef float m = 0.0, a, old, inv
    cdef const signed char* q8 = <const signed char*> base
    if kind != KV_I8:
        for d in range(D):
            kv_put(base, start + off * slot_stride + d * elem_stride, x[d * xs], kind, 1.0)
        return
    old = 0.0 if off == 0 else scale[0]
    for d in range(D):
        a = fabsf(x[d * xs])
        if a > m:
            m = a
    if m > old * 127.0:
        inv = 127.0 / m
        if old > 0.0:  # slots 0..off-1 of this head, to the new scale: round(q * old / new)
            for t in range(off):
                for d in range(D):
                    i = start + t * slot_stride + d * elem_stride
                    kv_put(base, i, <float> q8[i] * old, KV_I8, inv)
        scale[0] = m / 127.0
    else:
        scale[0] = old
        inv = 1.0 / old if old > 0.0 else 0.0
    for d in range(D):
        kv_put(base, start + off * slot_stride + d * elem_stride, x[d * xs], KV_I8, inv)


cdef void attend_layer(const float *q, Py_ssize_t qs0, Py_ssize_t qs1, Py_ssize_t qs2,
                       const float *k, Py_ssize_t ks0, Py_ssize_t ks1, Py_ssize_t ks2,
                       const float *v, Py_ssize_t vs0, Py_ssize_t vs1, Py_ssize_t vs2,
                       const KVCache *kv, Py_ssize_t layer, const PagedLayout *layout, Py_ssize_t window,
                       float softcap, Py_ssize_t H, float scale, float *out, int num_threads) noexcept nogil:
    cdef Py_ssize_t N = layout.N, KVH = kv.KVH, D = kv.D, BS = kv.BS, i, g, p, blk, off, ctx_pad
    cdef Py_ssize_t layer_elems = kv.num_blocks * KVH * D * BS, layer_scales = kv.num_blocks * KVH
    cdef char* k_cache = kv.k + layer * layer_elems * kv.itemsize
    cdef char* v_cache = kv.v + layer * layer_elems * kv.itemsize
    cdef float* k_scale = kv.k_scale + layer * layer_scales if kv.k_scale != NULL else NULL
    cdef float* v_scale = kv.v_scale + layer * layer_scales if kv.v_scale != NULL else NULL
    # 1. this step's keys and values into their slots, in token order (int8: a block's slots in
    # position order, which its scale relies on)
    for i in range(N):
        p = layout.token_pos[i]
        blk = layout.block_tables[layout.token_seq[i] * layout.MB + p // BS]
        off = p % BS
        for g in range(KVH):
            write_slot(k_cache, kv.kind, (blk * KVH + g) * D * BS, 1, BS, off,
                       &k_scale[blk * KVH + g] if k_scale != NULL else NULL, k + i * ks0 + g * ks1, ks2, D)
            write_slot(v_cache, kv.kind, blk * BS * KVH * D + g * D, KVH * D, 1, off,
                       &v_scale[blk * KVH + g] if v_scale != NULL else NULL, v + i * vs0 + g * vs1, vs2, D)
    # whole blocks (the last one is scored in full) and whole 16-lane vectors for the softmax
    ctx_pad = (layout.max_ctx + BS - 1) // BS * BS
    if window:  # w keys span at most this many blocks
        ctx_pad = min(ctx_pad, ((window - 1 + BS - 1) // BS + 1) * BS)
    ctx_pad = (ctx_pad + 15) // 16 * 16
    # 2. attention, one (token, kv head) per pool task
    cdef AttentionJob job
    job.q, job.qs0, job.qs1, job.qs2 = q, qs0, qs1, qs2
    job.k_cache, job.v_cache, job.k_scale, job.v_scale = k_cache, v_cache, k_scale, v_scale
    job.kind, job.itemsize, job.out = kv.kind, kv.itemsize, out
    job.block_tables, job.token_seq, job.token_pos = layout.block_tables, layout.token_seq, layout.token_pos
    job.MB, job.H, job.KVH, job.G, job.D, job.BS = layout.MB, H, KVH, H // KVH, D, BS
    job.ctx_pad, job.scale, job.window, job.softcap = ctx_pad, scale, window, softcap
    job.chunk_tokens = max(1, <Py_ssize_t> SPLIT_TOKENS // BS) * BS
    job.task_start, job.part_start, job.parts = NULL, NULL, NULL
    cdef int threads = num_threads if num_threads > 0 else pool.num_threads()
    cdef Py_ssize_t most = 1, tasks = 0, partials = 0
    for i in range(N):
        most = max(most, num_chunks(&job, layout.token_pos[i]))
    if most == 1 or N * KVH >= SPLIT_MIN_TASKS * threads:
        # enough (token, kv head) items to keep the threads busy: each does its chunks in turn
        pool.run(attend_item, &job, N * KVH, threads)
        return
    # few items and long contexts (a decode of one or two sequences): every chunk is a task, then
    # each (token, kv head) combines its chunks, with the same partials and the same sums
    cdef Py_ssize_t* starts = <Py_ssize_t*> malloc((2 * N + 1) * sizeof(Py_ssize_t))
    if starts == NULL:
        pool.run(attend_item, &job, N * KVH, threads)  # no room to split: the same bits, unsplit tasks
        return
    for i in range(N):
        starts[i] = tasks
        starts[N + 1 + i] = partials
        tasks += KVH * num_chunks(&job, layout.token_pos[i])
        partials += KVH * num_chunks(&job, layout.token_pos[i])
    starts[N] = tasks
    job.parts = <float*> malloc(partials * (H // KVH) * (D + 2) * sizeof(float))
    if job.parts == NULL:
        free(starts)
        pool.run(attend_item, &job, N * KVH, threads)
        return
    job.task_start, job.part_start = starts, starts + N + 1
    pool.run(chunk_task, &job, tasks, threads)
    pool.run(combine_task, &job, N * KVH, threads)
    free(job.parts)
    free(starts)


def copy_blocks(cache, const long[:, ::1] pairs):
    """cache[dst] = cache[src] for each (src, dst) row: the copy of copy-on-write (any element type,
    any layout whose first axis is the block: a layer's K or V pool, or its int8 scales)."""
    cdef unsigned char[::1] raw = memoryview(cache).cast("B")
    cdef Py_ssize_t r, n = raw.shape[0] // cache.shape[0], nb = cache.shape[0]
    for r in range(pairs.shape[0]):
        assert 0 <= pairs[r, 0] < nb and 0 <= pairs[r, 1] < nb, "block id out of the pool"
        memcpy(&raw[pairs[r, 1] * n], &raw[pairs[r, 0] * n], n)
