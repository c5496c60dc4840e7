// The decoder's kernels for NVIDIA GPUs, compiled once at start by NVRTC for the device's
// architecture (src/backend/cuda/mod.rs). Each mirrors a CPU kernel of
// src/backend/cpu/kernels.rs, src/backend/cpu/attention.rs or src/backend/cpu/adamw.rs, which is
// the reference `ndtrain gpu-check` compares
// against; the comments name it. fp32 throughout except the bf16 conversions: bf16 is stored
// as `unsigned short` (its bit pattern), so no CUDA header is needed.
//
// Layouts are the CPU's: row-major, token-major activations [N = B·S, D], head-major
// attention tensors q [B, H, Sq, hd], k, v [B, KV, Sk, hd]. Reductions over a row run in one
// block (block_sum / block_max), whose order differs from the CPU's lanes: results agree to
// rounding, not bit for bit.

#define WARP 32
#define FULL 0xffffffffu
// NVRTC has no <math.h>, hence no INFINITY.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float s) {
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
    return s;
}

__device__ __forceinline__ float warp_max(float s) {
    for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(FULL, s, o));
    return s;
}

// The sum of `s` over the block, returned to every thread. `scratch` holds 32 floats.
__device__ float block_sum(float s, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    s = warp_sum(s);
    __syncthreads();
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    s = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(s);
}

__device__ double block_sum_d(double s, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    s = lane < warps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
    return s;
}

__device__ float block_max(float s, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    s = warp_max(s);
    __syncthreads();
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    s = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(s);
}

// ---- RMSNorm (cpu::kernels::rmsnorm_fwd / rmsnorm_bwd) ---------------------------------

// One block per row: y = w · x · rstd, rstd = 1 / sqrt(mean(x²) + eps).
extern "C" __global__ void rmsnorm_fwd(float* y, float* rstd, const float* x, const float* w, int n, int d, float eps) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (size_t)row * d;
    float* yr = y + (size_t)row * d;
    float s = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) s += xr[j] * xr[j];
    float r = 1.0f / sqrtf(block_sum(s, scratch) / (float)d + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (int j = threadIdx.x; j < d; j += blockDim.x) yr[j] = w[j] * (xr[j] * r);
}

// One block per row: dx (= or +=) r·w·dy − r³/D · x · Σ w·dy·x.
extern "C" __global__ void rmsnorm_bwd_dx(float* dx, const float* dy, const float* x, const float* w, const float* rstd,
                                          int n, int d, int accumulate) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (size_t)row * d;
    const float* dyr = dy + (size_t)row * d;
    float* dxr = dx + (size_t)row * d;
    float s = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) s += w[j] * dyr[j] * xr[j];
    float r = rstd[row];
    float c = r * r * r / (float)d * block_sum(s, scratch);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float g = r * w[j] * dyr[j] - c * xr[j];
        dxr[j] = accumulate ? dxr[j] + g : g;
    }
}

// dw += Σ_n dy·x·rstd in two passes, deterministic: the rows are cut into tiles of `tile`
// rows (blockIdx.y), each block sums its tile's rows in order for a run of columns into
// partial[tile][d]; the second kernel adds the tiles in order. A column's rows are so spread over
// many blocks instead of one thread walking all of them.
extern "C" __global__ void rmsnorm_bwd_dw_partial(float* partial, const float* dy, const float* x, const float* rstd, int n, int d,
                                                  int tile) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    int first = blockIdx.y * tile, last = min(n, first + tile);
    float s = 0.0f;
    for (int row = first; row < last; row++) s += dy[(size_t)row * d + j] * x[(size_t)row * d + j] * rstd[row];
    partial[(size_t)blockIdx.y * d + j] = s;
}

extern "C" __global__ void rmsnorm_bwd_dw_sum(float* dw, const float* partial, int tiles, int d) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float s = 0.0f;
    for (int t = 0; t < tiles; t++) s += partial[(size_t)t * d + j];
    dw[j] += s;
}

// ---- RoPE and the head transposes (cpu::kernels::to_heads_rope / from_heads_rope) ------

// Token-major [B, S, nh·hd] → head-major [B, nh, S, hd], rotating the halves (a, b) to
// (a·cos − b·sin, b·cos + a·sin) when `rotate`; cos, sin [S, hd/2]. One thread per output.
extern "C" __global__ void to_heads_rope(float* dst, const float* src, const float* cos_t, const float* sin_t, int b, int s,
                                         int nh, int hd, int rotate) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)b * nh * s * hd;
    if (e >= total) return;
    int c = (int)(e % hd), t = (int)((e / hd) % s), h = (int)((e / ((long long)hd * s)) % nh);
    int bi = (int)(e / ((long long)hd * s * nh));
    const float* row = src + ((size_t)bi * s + t) * nh * hd + (size_t)h * hd;
    if (!rotate) { dst[e] = row[c]; return; }
    int half = hd / 2, i = c % half;
    float a = row[i], bb = row[i + half], co = cos_t[t * half + i], si = sin_t[t * half + i];
    dst[e] = c < half ? a * co - bb * si : bb * co + a * si;
}

// The backward: head-major gradient → token-major, rotating by the transposed rotation.
// One thread per output element of [B, S, nh·hd].
extern "C" __global__ void from_heads_rope(float* dst, const float* src, const float* cos_t, const float* sin_t, int b, int s,
                                           int nh, int hd, int rotate) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)b * s * nh * hd;
    if (e >= total) return;
    int c = (int)(e % hd), h = (int)((e / hd) % nh), t = (int)((e / ((long long)hd * nh)) % s);
    int bi = (int)(e / ((long long)hd * nh * s));
    const float* g = src + (((size_t)bi * nh + h) * s + t) * hd;
    if (!rotate) { dst[e] = g[c]; return; }
    int half = hd / 2, i = c % half;
    float ga = g[i], gb = g[i + half], co = cos_t[t * half + i], si = sin_t[t * half + i];
    dst[e] = c < half ? ga * co + gb * si : gb * co - ga * si;
}

// ---- SwiGLU (cpu::kernels::swiglu_fwd / swiglu_bwd) -------------------------------------

extern "C" __global__ void swiglu_fwd(float* h, const float* gate, const float* up, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float g = gate[i]; h[i] = g / (1.0f + expf(-g)) * up[i]; }
}

extern "C" __global__ void swiglu_bwd(float* dgate, float* dup, const float* dh, const float* gate, const float* up, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i], sig = 1.0f / (1.0f + expf(-g));
        dup[i] = dh[i] * g * sig;
        dgate[i] = dh[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
    }
}

// dst += src (the residual adds).
extern "C" __global__ void add_assign(float* dst, const float* src, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] += src[i];
}

// ---- Cross entropy over a (vocabulary-parallel) row of logits ----------------------------
// (cpu::kernels::row_max, row_sum_exp, target_logit, cross_entropy_bwd_inplace)

// One block per row of logits [N, v]: the maximum over the first `valid` columns.
extern "C" __global__ void ce_row_max(float* m, const float* logits, int n, int v, int valid) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = logits + (size_t)row * v;
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, x[j]);
    mx = block_max(mx, scratch);
    if (threadIdx.x == 0) m[row] = mx;
}

// One block per row: Σ exp(x − m[row]) over the first `valid` columns (m may be the maximum
// over the whole vocabulary, reduced across tensor-parallel ranks).
extern "C" __global__ void ce_row_sum_exp(float* sum_exp, const float* logits, const float* m, int n, int v, int valid) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = logits + (size_t)row * v;
    float mx = m[row], s = 0.0f;
    for (int j = threadIdx.x; j < valid; j += blockDim.x) s += expf(x[j] - mx);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) sum_exp[row] = s;
}

// One thread per row: the target's logit where this rank holds the target's row, else 0.
extern "C" __global__ void ce_target_logit(float* t_logit, const float* logits, const unsigned int* targets, int n, int v, int offset,
                                           int valid) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n) return;
    unsigned int local = targets[row] - (unsigned int)offset;
    t_logit[row] = local < (unsigned int)valid ? logits[(size_t)row * v + local] : 0.0f;
}

// In place: the row sums of exponentials become log-sum-exps, lse = m + log(Σ exp).
extern "C" __global__ void ce_finish(float* lse, const float* m, int n) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < n) lse[row] = m[row] + logf(lse[row]);
}

// In place: logits become scale · (softmax − onehot), lse [N] over the whole vocabulary;
// padding columns 0. One block per row.
extern "C" __global__ void ce_bwd_inplace(float* logits, const float* lse, const unsigned int* targets, int n, int v, int offset,
                                          int valid, float scale) {
    int row = blockIdx.x;
    if (row >= n) return;
    float* x = logits + (size_t)row * v;
    float l = lse[row];
    unsigned int local = targets[row] - (unsigned int)offset;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float g = j < valid ? expf(x[j] - l) * scale : 0.0f;
        if ((unsigned int)j == local && j < valid) g -= scale;
        x[j] = g;
    }
}

// ---- Causal grouped-query attention (cpu::attention) -----------------------------------
// The products QKᵀ, PV and their backward are cuBLAS batched GEMMs over (batch, kv head)
// groups, the `rep = H / KV` query heads of a group stacked as rows (src/backend/cuda/attention.rs); these
// kernels do the rest, one block per row of scores [rows, sk]. Row `row0 + r` is query
// `(row0 + r) % sq` of its head. Causality is by global position (k_pos[j] > q_pos[i] is
// masked), as on the CPU, so a context-parallel rank's zigzag pieces work unchanged.

// Scores become, in place, softmax(scale · s) over the keys the query sees (0 elsewhere);
// lse = the log-sum-exp of the scaled visible scores, −∞ (and a zero row) when it sees none.
extern "C" __global__ void attn_softmax(float* s, float* lse, const int* q_pos, const int* k_pos, int sq, int sk, long long row0,
                                        float scale) {
    __shared__ float scratch[32];
    long long r = blockIdx.x;
    float* x = s + r * sk;
    int qp = q_pos[(row0 + r) % sq];
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < sk; j += blockDim.x) if (k_pos[j] <= qp) mx = fmaxf(mx, x[j] * scale);
    mx = block_max(mx, scratch);
    if (mx == NEG_INF) {
        for (int j = threadIdx.x; j < sk; j += blockDim.x) x[j] = 0.0f;
        if (threadIdx.x == 0) lse[row0 + r] = NEG_INF;
        return;
    }
    float sum = 0.0f;
    for (int j = threadIdx.x; j < sk; j += blockDim.x) if (k_pos[j] <= qp) sum += expf(x[j] * scale - mx);
    float l = mx + logf(block_sum(sum, scratch));
    for (int j = threadIdx.x; j < sk; j += blockDim.x) x[j] = k_pos[j] <= qp ? expf(x[j] * scale - l) : 0.0f;
    if (threadIdx.x == 0) lse[row0 + r] = l;
}

// The backward's probabilities again, in place, from the scores and the saved lse.
extern "C" __global__ void attn_probs(float* s, const float* lse, const int* q_pos, const int* k_pos, int sq, int sk, long long row0,
                                      float scale) {
    long long r = blockIdx.x;
    float* x = s + r * sk;
    int qp = q_pos[(row0 + r) % sq];
    float l = lse[row0 + r];
    for (int j = threadIdx.x; j < sk; j += blockDim.x) x[j] = (l != NEG_INF && k_pos[j] <= qp) ? expf(x[j] * scale - l) : 0.0f;
}

// In place dP → dS = scale · P ∘ (dP − D), D = rowsum(dO ∘ O) of the row (the gradient of the
// unscaled scores QKᵀ).
extern "C" __global__ void attn_dscores(float* dp, const float* p, const float* dd, int sk, long long row0, float scale) {
    long long r = blockIdx.x;
    float di = dd[row0 + r];
    for (int j = threadIdx.x; j < sk; j += blockDim.x) {
        long long e = r * sk + j;
        dp[e] = scale * p[e] * (dp[e] - di);
    }
}

// D [rows] = rowsum(dO ∘ O): one warp per row.
extern "C" __global__ void attn_bwd_rowdot(float* dd, const float* d_o, const float* o, long long rows, int hd) {
    int lane = threadIdx.x & 31;
    long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= rows) return;
    float s = 0.0f;
    for (int e = lane; e < hd; e += WARP) s += d_o[row * hd + e] * o[row * hd + e];
    s = warp_sum(s);
    if (lane == 0) dd[row] = s;
}

// Online-softmax merge of a partial result over one block of keys into the running (o, lse)
// (cpu::attention::merge_partial): one warp per row of [rows, hd]. A row whose partial saw
// no key (lse_part = −∞) keeps its running result.
extern "C" __global__ void attn_merge(float* o, float* lse, const float* o_part, const float* lse_part, long long rows, int hd) {
    int lane = threadIdx.x & 31;
    long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= rows) return;
    float l = lse[row], lp = lse_part[row];
    if (lp == NEG_INF) return;
    float* orow = o + row * hd;
    const float* prow = o_part + row * hd;
    float a = 0.0f, b = 1.0f, nw = lp;
    if (l != NEG_INF) {
        float mx = fmaxf(l, lp);
        nw = mx + logf(expf(l - mx) + expf(lp - mx));
        a = expf(l - nw);
        b = expf(lp - nw);
    }
    for (int e = lane; e < hd; e += WARP) orow[e] = l == NEG_INF ? prow[e] : orow[e] * a + prow[e] * b;
    // Every lane has read lse[row] before it is overwritten.
    __syncwarp();
    if (lane == 0) lse[row] = nw;
}

// ---- Embedding (a vocabulary-parallel rank's rows) -------------------------------------

// x [n, d] = the table rows `ids − offset` this rank holds, else 0: one thread per element.
extern "C" __global__ void embed_fwd(float* x, const float* table, const unsigned int* ids, long long n, int d, int offset, int valid) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n * d) return;
    long long row = e / d;
    int j = (int)(e % d);
    unsigned int local = ids[row] - (unsigned int)offset;
    x[e] = local < (unsigned int)valid ? table[(size_t)local * d + j] : 0.0f;
}

// dtable[id − offset] += dx of every token with that id, in token order (the CPU's order, so
// the sums agree bit for bit): one block per distinct id, whose tokens are
// order[starts[u] .. starts[u + 1]] (the host sorts the ids once per micro-batch).
extern "C" __global__ void embed_bwd(float* dtable, const float* dx, const unsigned int* uniq, const int* starts, const int* order, int d,
                                     int offset, int valid) {
    int u = blockIdx.x;
    unsigned int local = uniq[u] - (unsigned int)offset;
    if (local >= (unsigned int)valid) return;
    float* g = dtable + (size_t)local * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float acc = g[j];
        for (int t = starts[u]; t < starts[u + 1]; t++) acc += dx[(size_t)order[t] * d + j];
        g[j] = acc;
    }
}

// ---- Buffers and the gradient norm --------------------------------------------------------

extern "C" __global__ void fill_f32(float* x, float v, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

extern "C" __global__ void scale_f32(float* x, float c, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= c;
}

// Σ x² in f64: each block sums a grid-stride share and writes its partial; the host adds the
// partials in block order (a fixed grid, so the result is deterministic).
extern "C" __global__ void sum_sq_partial(double* partials, const float* x, long long n) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        double v = x[i];
        s += v * v;
    }
    s = block_sum_d(s, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// ---- AdamW (optim::AdamW, PyTorch's semantics) --------------------------------------------

extern "C" __global__ void adamw(float* p, float* m, float* v, const float* g, long long n, float decay, float b1, float b2,
                                 float step_size, float bc2_sqrt, float eps) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float gi = g[i];
        p[i] *= decay;
        m[i] = b1 * m[i] + (1.0f - b1) * gi;
        v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
        p[i] -= step_size * m[i] / (sqrtf(v[i]) / bc2_sqrt + eps);
    }
}

// ---- bf16 (mixed precision: bf16 operands, f32 master weights and accumulation) ----------

// f32 → bf16, rounding to nearest even; NaN stays a (quiet) NaN.
extern "C" __global__ void f32_to_bf16(unsigned short* dst, const float* src, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int u = __float_as_uint(src[i]);
    if ((u & 0x7fffffffu) > 0x7f800000u) { dst[i] = (unsigned short)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    dst[i] = (unsigned short)(u >> 16);
}
