/*
 * cms_surrogate.cu -- tm_cms_surrogate on CUDA: Phase 1 of the CMS step (spec
 * deep_nested_optimizer.md 7.2, loss 7.4), the DirectUpdateMLP's surrogate training gradient
 * over the chosen tensors: the CPU's algorithm (cpu/cpu_cms_surrogate.c) with its blocks, lanes
 * and sums, the element math and loss of tm_cms_surrogate.h, so both backends give the same bits.
 * Passes per batch of tensors (a table of multi_tensor.cuh), in stream order, then one for the
 * call; no value visits the host, nothing is allocated, nothing is atomic:
 *
 *   gsq    per block      sum g^2                                   -> record[GG], 0 in the others
 *   flags  per tensor     sum of its records' g^2: ||g|| > 1e-8 (normed), its record range
 *   norms  per block      normed tensors only: o = MLP(g, m), sums o^2, o g, (o - prev)^2
 *   coefs  per tensor     normed: the loss; every tensor: d loss / d o's coefficients
 *   grads  per block      the forward kept, d loss / d o, o into outputs, sums o^2 and
 *                         (o - prev)^2, the backward into the block's gradient record
 *   finish per call       the weights' gradient: each entry summed over every block in order;
 *                         the losses of the tensors that are not normed
 *
 * Blocks are the CPU's: TM_SUR_BLOCK elements from a tensor's start, SUR_SPLIT of them per chunk
 * of TM_CHUNK (grid = chunks x SUR_SPLIT; block (b, y) takes slice y of chunk b, empty past a
 * short chunk's end). Record r = (chunk_base + b) * SUR_SPLIT + y holds that slice's
 * TM_SUR_NORM_PARTS sums, then its gradient partials; a tensor's blocks are records first..first
 * + blocks - 1, in order (sur_rec). Every record read is written earlier in the same call, so the
 * scratch needs no zeroing. Scratch: double records [chunks * SUR_SPLIT][TM_SUR_NORM_PARTS +
 * tm_sur_grad_entries(L)], then sur_rec [count].
 *
 * Lanes: element e of a block adds into lane e % 8 of each sum, lanes in element order, each sum
 * owned by one thread (the loss sums in double; the gradient in float, one FMA an element, in
 * registers), lanes joined pairwise in double by tm_sur_join: the CPU's order. The per-tensor and
 * per-call sums add records in block order from 0, one thread each, as the CPU's cpu_sum_blocks.
 *
 * Grads pass, thread -> data: SUR_THREADS threads walk the block's elements in tiles of SUR_TILE;
 * a tile's features, every hidden layer's SiLU output and derivative (the derivative overwritten
 * by the backward's d), d loss / d o and a row of ones live in shared memory as rows of SUR_TILE
 * floats (row stride SUR_STRIDE: the gradient's loads are free of bank conflicts). Forward and
 * backward: warp w computes units w, w + 10 of every element (lane = element), layer by layer;
 * the output unit and d loss / d o: warp 0. Gradient: thread t owns lane t % 8 of entries
 * t / 8 + SUR_SLOTS r (r < SUR_CHAINS) of a chain group: group 0 the input layer, the first hidden
 * layer and the output layer (at most 541 entries), group g > 0 hidden layer g + 1 (420); a
 * network of L > 2 layers runs the block's tiles once per group (L - 1 times), the outputs written
 * by the last run (each run reads the previous output first).
 */
#include "cms.cuh"
#include "cuda_ops.h"
#include "tm_cms_surrogate.h"
#include "tm_nvtx.cuh"

#define SUR_SPLIT (TM_CHUNK / TM_SUR_BLOCK) /* blocks of a chunk: 16 */
#define SUR_THREADS 320                    /* grads pass: 10 warps, 2 units each of 20 */
#define SUR_SUM_THREADS 256                /* gsq and norms passes */
#define SUR_TILE 32                        /* elements of a tile: one per lane */
#define SUR_STRIDE (SUR_TILE + 8)          /* the 4 entries a warp's gradient loads read lie in
                                              rows k..k+3: offsets 8 banks apart */
#define SUR_SLOTS (SUR_THREADS / TM_SUR_LANES) /* entries per round of the gradient's threads */
#define SUR_CHAINS 14                      /* rounds: ceil(541 / 40) */
#define SUR_TENSOR_THREADS 128             /* flags, coefs, finish: one thread per tensor/entry */

static_assert(TM_CHUNK % TM_SUR_BLOCK == 0, "whole blocks per chunk");
static_assert(SUR_TILE == 32 && SUR_TILE % TM_SUR_LANES == 0, "a tile is a warp of elements");
static_assert(SUR_THREADS % 32 == 0 && TM_CMS_DIRECT_MAX_HIDDEN % (SUR_THREADS / 32) == 0,
              "every warp computes the same number of units");
static_assert(SUR_SUM_THREADS % TM_SUR_LANES == 0 && TM_SUR_BLOCK % SUR_SUM_THREADS == 0,
              "pieces of a block keep each element's lane");
static_assert(SUR_CHAINS * SUR_SLOTS >= TM_SUR_FIRST_ENTRIES + TM_SUR_HIDDEN_ENTRIES +
                                            TM_CMS_DIRECT_MAX_HIDDEN + 1,
              "group 0 fits the threads' chains");
static_assert(SUR_SLOTS % 4 == 0, "a warp's 4 entries lie in one aligned group of 4");

/* Per tensor, written by the flags and coefs passes. */
struct sur_rec {
    tm_sur_coefs c;  /* d loss / d o's coefficients (coefs pass) */
    int32_t normed;  /* ||g|| > 1e-8 (flags pass) */
    int32_t has_prev;
    int64_t numel;
    int64_t first;   /* its first record */
    int64_t blocks;  /* its records: ceil(numel / TM_SUR_BLOCK) */
};

/* Everything of a call that is not per tensor; by value (__grid_constant__). */
struct sur_params {
    const float *w[2 * TM_CMS_MAX_LAYERS + 2];
    float *wg[2 * TM_CMS_MAX_LAYERS + 2];
    const float *scale; /* [1], or NULL (= 1) */
    float *losses;      /* [count] */
    double *parts;      /* records */
    sur_rec *rec;       /* [count] */
    int64_t stride;     /* doubles per record */
    int64_t chunk_base; /* chunks of the earlier launches of this call */
    int64_t entries;    /* of the gradient */
    float divisor;
    int32_t count, hidden, layers;
};

struct sur_meta {
    static constexpr int capacity =
        cuda_meta_capacity(3 * sizeof(void *) + sizeof(int32_t) + 2, sizeof(sur_params));
    const void *target[capacity];
    const float *m[capacity];
    float *out[capacity];
    int32_t index[capacity]; /* the tensor's position in the call's lists */
    uint8_t dtype[capacity]; /* the target's */
    uint8_t has_prev[capacity];
    tensor_table<capacity> t;
};
static_assert(sizeof(sur_meta) + sizeof(sur_params) <= TM_KERNEL_PARAM_BYTES, "params");

/* This block's slice: tensor slot *s, first element *start, *len elements (0 past a short
 * chunk's end), its record *record. */
static __device__ __forceinline__ bool
sur_locate(const sur_meta &meta, const sur_params &p, int32_t *s, int64_t *start, int32_t *len,
           int64_t *record)
{
    int64_t chunk_start;
    int32_t chunk_len;
    locate_chunk(meta.t, blockIdx.x, s, &chunk_start, &chunk_len);
    const int32_t off = (int32_t)blockIdx.y * TM_SUR_BLOCK;
    *start = chunk_start + off;
    *len = chunk_len > off ? min(chunk_len - off, TM_SUR_BLOCK) : 0;
    *record = (p.chunk_base + blockIdx.x) * SUR_SPLIT + blockIdx.y;
    return *len > 0;
}

static __device__ __forceinline__ float
sur_scale(const sur_params &p)
{
    return p.scale != NULL ? p.scale[0] : 1.0f;
}

/* Lanes l0..l0+7 of this warp hold the 8 lanes of one sum: their join (valid in every lane). */
static __device__ __forceinline__ double
sur_join_lanes(double v)
{
    const int l0 = (threadIdx.x & 31) & ~(TM_SUR_LANES - 1);
    double lane[TM_SUR_LANES];
#pragma unroll
    for (int j = 0; j < TM_SUR_LANES; j++) {
        lane[j] = __shfl_sync(0xffffffffu, v, l0 + j);
    }
    return tm_sur_join(lane);
}

/* ---------------------------------------------------------------- gsq and norms ---- */

/* Threads 0..8n-1 of the block: sum q = t / 8, lane t % 8, over terms[q][k] of a piece of cnt
 * elements (k = lane, lane + 8, ...: the elements of that lane, in order). */
template <int N>
static __device__ __forceinline__ void
sur_add_piece(double (&terms)[N][SUR_SUM_THREADS], int32_t cnt, double *sum)
{
    if (threadIdx.x < N * TM_SUR_LANES) {
        const int q = threadIdx.x / TM_SUR_LANES;
        for (int32_t k = threadIdx.x % TM_SUR_LANES; k < cnt; k += TM_SUR_LANES) {
            *sum = tm_dadd(*sum, terms[q][k]);
        }
    }
}

__global__ void __launch_bounds__(SUR_SUM_THREADS)
sur_gsq_kernel(const __grid_constant__ sur_meta meta, const __grid_constant__ sur_params p)
{
    __shared__ double s_terms[1][SUR_SUM_THREADS];
    int32_t s, len;
    int64_t start, record;
    if (!sur_locate(meta, p, &s, &start, &len, &record)) {
        return;
    }
    const float scale = sur_scale(p);
    const int dt = meta.dtype[s];
    double sum = 0.0;
    for (int32_t base = 0; base < len; base += SUR_SUM_THREADS) {
        const int32_t k = base + (int32_t)threadIdx.x;
        const double g = k < len ? tm_sur_g(cms_load(meta.target[s], start + k, dt), scale,
                                            p.divisor)
                                 : 0.0;
        s_terms[0][threadIdx.x] = tm_dmul(g, g);
        __syncthreads();
        sur_add_piece(s_terms, min(SUR_SUM_THREADS, len - base), &sum);
        __syncthreads();
    }
    if (threadIdx.x < 32) {
        const double total = sur_join_lanes(sum);
        double *rec = p.parts + record * p.stride;
        if (threadIdx.x == 0) {
            rec[TM_SUR_GG] = total;
            rec[TM_SUR_OO] = rec[TM_SUR_OG] = rec[TM_SUR_TT] = 0.0;
        }
    }
}

__global__ void __launch_bounds__(SUR_SUM_THREADS)
sur_norms_kernel(const __grid_constant__ sur_meta meta, const __grid_constant__ sur_params p)
{
    __shared__ tm_cms_direct_net s_net;
    __shared__ double s_terms[3][SUR_SUM_THREADS]; /* o^2, o g, (o - prev)^2 */
    int32_t s, len;
    int64_t start, record;
    if (!sur_locate(meta, p, &s, &start, &len, &record) || !p.rec[meta.index[s]].normed) {
        return; /* uniform across the block */
    }
    tm_cms_direct_fill(&s_net, p.w, p.hidden, p.layers, threadIdx.x, blockDim.x);
    __syncthreads();
    const float scale = sur_scale(p);
    const int dt = meta.dtype[s];
    const bool has_prev = meta.has_prev[s] != 0;
    const float *m = meta.m[s] + start;
    const float *out = meta.out[s] + start;
    double sum = 0.0;
    for (int32_t base = 0; base < len; base += SUR_SUM_THREADS) {
        const int32_t k = base + (int32_t)threadIdx.x;
        double oo = 0.0, og = 0.0, tt = 0.0;
        if (k < len) {
            const float g = tm_sur_g(cms_load(meta.target[s], start + k, dt), scale, p.divisor);
            const float o = tm_cms_direct_delta(&s_net, g, m[k]);
            const double d = tm_fadd(o, -(has_prev ? out[k] : 0.0f));
            oo = tm_dmul(o, o);
            og = tm_dmul(o, g);
            tt = tm_dmul(d, d);
        }
        s_terms[0][threadIdx.x] = oo;
        s_terms[1][threadIdx.x] = og;
        s_terms[2][threadIdx.x] = tt;
        __syncthreads();
        sur_add_piece(s_terms, min(SUR_SUM_THREADS, len - base), &sum);
        __syncthreads();
    }
    if (threadIdx.x < 32) {
        const double total = sur_join_lanes(sum);
        double *rec = p.parts + record * p.stride;
        const int q = threadIdx.x / TM_SUR_LANES;
        if (threadIdx.x % TM_SUR_LANES == 0 && q < 3) { /* parts[GG] stays the gsq pass's */
            rec[q == 0 ? TM_SUR_OO : (q == 1 ? TM_SUR_OG : TM_SUR_TT)] = total;
        }
    }
}

/* ---------------------------------------------------------------- per tensor ---- */

/* s = the tensor's sums over its records, in order. */
static __device__ void
sur_tensor_sums(const sur_params &p, const sur_rec &r, double *s)
{
    for (int q = 0; q < TM_SUR_NORM_PARTS; q++) {
        s[q] = 0.0;
    }
    for (int64_t b = r.first; b < r.first + r.blocks; b++) {
        for (int q = 0; q < TM_SUR_NORM_PARTS; q++) {
            s[q] = tm_dadd(s[q], p.parts[b * p.stride + q]);
        }
    }
}

/* stage 0 (flags): the tensor's record range and whether ||g|| > 1e-8; stage 1 (coefs): a
 * normed tensor's loss, every tensor's coefficients. One thread per tensor of the batch. */
__global__ void __launch_bounds__(SUR_TENSOR_THREADS)
sur_tensor_kernel(const __grid_constant__ sur_meta meta, const __grid_constant__ sur_params p,
                  int stage)
{
    const int32_t s = (int32_t)(blockIdx.x * SUR_TENSOR_THREADS + threadIdx.x);
    if (s >= meta.t.count) {
        return;
    }
    sur_rec *r = &p.rec[meta.index[s]];
    double sums[TM_SUR_NORM_PARTS];
    if (stage == 0) {
        r->numel = meta.t.numel[s];
        r->first = (p.chunk_base + (s > 0 ? meta.t.chunk_end[s - 1] : 0u)) * SUR_SPLIT;
        r->blocks = (r->numel + TM_SUR_BLOCK - 1) / TM_SUR_BLOCK;
        r->has_prev = meta.has_prev[s];
        sur_tensor_sums(p, *r, sums);
        r->normed = sqrt(sums[TM_SUR_GG]) > TM_SUR_EPS;
        return;
    }
    sur_tensor_sums(p, *r, sums);
    if (!r->normed) { /* the coefficients need only sum g^2; the loss comes in the finish */
        sums[TM_SUR_OO] = sums[TM_SUR_OG] = sums[TM_SUR_TT] = 0.0;
    }
    tm_sur_coefs c;
    const float loss = tm_sur_loss(sums, r->numel, r->has_prev, p.count, &c);
    r->c = c;
    if (r->normed) {
        p.losses[meta.index[s]] = loss;
    }
}

/* ---------------------------------------------------------------- grads ---- */

/* Rows of the grads pass's tile: the 4 features, act[l][j] (SiLU outputs), d[l][j] (their
 * derivatives, then the backward's d), d loss / d o, ones. */
static __device__ __forceinline__ int
sur_act_row(int l, int j)
{
    return TM_CMS_DIRECT_IN + l * TM_CMS_DIRECT_MAX_HIDDEN + j;
}

static __device__ __forceinline__ int
sur_d_row(int layers, int l, int j)
{
    return TM_CMS_DIRECT_IN + (layers + l) * TM_CMS_DIRECT_MAX_HIDDEN + j;
}

static __device__ __forceinline__ int
sur_dout_row(int layers)
{
    return TM_CMS_DIRECT_IN + 2 * layers * TM_CMS_DIRECT_MAX_HIDDEN;
}

static __host__ __device__ __forceinline__ int
sur_rows(int layers)
{
    return TM_CMS_DIRECT_IN + 2 * layers * TM_CMS_DIRECT_MAX_HIDDEN + 2;
}

/* The padded net first, then the tile (16-byte aligned). */
constexpr size_t SUR_NET_BYTES = (sizeof(tm_cms_direct_net) + 15) / 16 * 16;

static size_t
sur_grads_smem(int layers)
{
    return SUR_NET_BYTES + (size_t)sur_rows(layers) * SUR_STRIDE * sizeof(float);
}

static __host__ __device__ __forceinline__ int
sur_groups(int layers)
{
    return layers >= 3 ? layers - 1 : 1;
}

/* Entry u of chain group `group` (see the file comment), or -1 past the group's end. */
static __device__ int64_t
sur_group_entry(int group, int32_t u, int32_t layers)
{
    if (group > 0) {
        return u < TM_SUR_HIDDEN_ENTRIES
                   ? TM_SUR_FIRST_ENTRIES + (int64_t)group * TM_SUR_HIDDEN_ENTRIES + u
                   : -1;
    }
    const int32_t head = TM_SUR_FIRST_ENTRIES + (layers >= 2 ? TM_SUR_HIDDEN_ENTRIES : 0);
    if (u < head) {
        return u;
    }
    u -= head; /* the output layer: W_out, then b_out */
    return u <= TM_CMS_DIRECT_MAX_HIDDEN
               ? TM_SUR_FIRST_ENTRIES + (int64_t)(layers - 1) * TM_SUR_HIDDEN_ENTRIES + u
               : -1;
}

/* The rows the FMA of entry q (of group `group`, or -1) reads, as d_row | x_row << 16: its
 * unit's d, its input (the ones row for a bias); -1 for no entry. One register a chain. */
static __device__ int
sur_entry_rows(int64_t q, int layers)
{
    if (q < 0) {
        return -1;
    }
    const tm_sur_entry e = tm_sur_entry_at(q, layers);
    const int ones = sur_dout_row(layers) + 1;
    int d_row, x_row;
    if (e.layer == layers) {
        d_row = sur_dout_row(layers);
        x_row = e.col < 0 ? ones : sur_act_row(layers - 1, e.col);
    } else {
        d_row = sur_d_row(layers, e.layer, e.row);
        x_row = e.col < 0 ? ones : (e.layer == 0 ? e.col : sur_act_row(e.layer - 1, e.col));
    }
    return d_row | x_row << 16;
}

/* One tile's forward and backward, lane = element: the features of g and m (warp 0's, 0 in
 * the padding), every layer's SiLU output and derivative, o (0 in the padding, into *o_out of
 * warp 0) and d loss / d o from warp 0's g and prev, then each layer's d in place of its
 * derivative. */
static __device__ __forceinline__ void
sur_tile_pass(const tm_cms_direct_net *net, float (*tile)[SUR_STRIDE], const tm_sur_coefs &c,
              int layers, float g, float m, float prev, int cnt, float *o_out)
{
    const int mh = TM_CMS_DIRECT_MAX_HIDDEN;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = SUR_THREADS / 32;
    if (warp == 0) {
        tm_cms_preprocess(g, &tile[0][lane], &tile[1][lane]);
        tm_cms_preprocess(m, &tile[2][lane], &tile[3][lane]);
    }
    __syncthreads();
    for (int l = 0; l < layers; l++) {
        for (int j = warp; j < mh; j += warps) {
            const float v = l == 0 ? tm_sur_unit(net->w_in[j], &tile[0][lane], SUR_STRIDE,
                                                 TM_CMS_DIRECT_IN, net->b_in[j])
                                   : tm_sur_unit(net->w_hid[l - 1][j],
                                                 &tile[sur_act_row(l - 1, 0)][lane], SUR_STRIDE,
                                                 mh, net->b_hid[l - 1][j]);
            const float den = tm_cms_silu_den(v);
            tile[sur_act_row(l, j)][lane] = tm_fdiv(v, den);
            tile[sur_d_row(layers, l, j)][lane] = tm_sur_dsilu(v, den);
        }
        __syncthreads();
    }
    if (warp == 0) {
        float o = tm_sur_unit(net->w_out, &tile[sur_act_row(layers - 1, 0)][lane], SUR_STRIDE, mh,
                              net->b_out);
        o = lane < cnt ? o : 0.0f; /* the padding's o is 0, as the CPU's tiles pad */
        tile[sur_dout_row(layers)][lane] = tm_sur_dout(&c, o, g, prev);
        *o_out = o;
    }
    __syncthreads();
    const float dout = tile[sur_dout_row(layers)][lane];
    for (int k = warp; k < mh; k += warps) { /* d of the last hidden layer's outputs */
        float *d = &tile[sur_d_row(layers, layers - 1, k)][lane];
        *d = tm_fmul(tm_fmul(net->w_out[k], dout), *d);
    }
    __syncthreads();
    for (int l = layers - 1; l >= 1; l--) { /* through w_hid[l - 1] to act[l - 1] */
        for (int k = warp; k < mh; k += warps) {
            float *d = &tile[sur_d_row(layers, l - 1, k)][lane];
            const float y = tm_sur_down(&net->w_hid[l - 1][0][0], k,
                                        &tile[sur_d_row(layers, l, 0)][lane], SUR_STRIDE);
            *d = tm_fmul(y, *d);
        }
        __syncthreads();
    }
}

/* Two blocks an SM: at most 102 registers a thread (the chains take 28). */
__global__ void __launch_bounds__(SUR_THREADS, 2)
sur_grads_kernel(const __grid_constant__ sur_meta meta, const __grid_constant__ sur_params p)
{
    extern __shared__ float4 s_mem[]; /* float4: 16-byte alignment */
    tm_cms_direct_net *net = (tm_cms_direct_net *)s_mem;
    float (*tile)[SUR_STRIDE] = (float (*)[SUR_STRIDE])((char *)s_mem + SUR_NET_BYTES);
    int32_t s, len;
    int64_t start, record;
    if (!sur_locate(meta, p, &s, &start, &len, &record)) {
        return;
    }
    const int layers = p.layers;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    tm_cms_direct_fill(net, p.w, p.hidden, layers, threadIdx.x, blockDim.x);
    for (int e = threadIdx.x; e < SUR_TILE; e += blockDim.x) {
        tile[sur_dout_row(layers) + 1][e] = 1.0f;
    }
    const sur_rec r = p.rec[meta.index[s]];
    const float scale = sur_scale(p);
    const int dt = meta.dtype[s];
    const bool has_prev = meta.has_prev[s] != 0;
    const float *m = meta.m[s] + start;
    float *out = meta.out[s] + start;
    double *rec = p.parts + record * p.stride;
    const int e8 = threadIdx.x % TM_SUR_LANES; /* this thread's lane of every sum */
    const int groups = sur_groups(layers);
    for (int group = 0; group < groups; group++) {
        const bool last = group == groups - 1;
        const int32_t slot = (int32_t)(threadIdx.x / TM_SUR_LANES);
        int rows[SUR_CHAINS];
        float acc[SUR_CHAINS];
#pragma unroll
        for (int k = 0; k < SUR_CHAINS; k++) {
            rows[k] = sur_entry_rows(sur_group_entry(group, slot + k * SUR_SLOTS, layers), layers);
            acc[k] = 0.0f;
        }
        double oo = 0.0, tt = 0.0; /* warp 0: lanes 0-7 o^2, lanes 8-15 (o - prev)^2 */
        __syncthreads(); /* the net and the ones row (first group), the last tile's reads */
        for (int32_t t0 = 0; t0 < len; t0 += SUR_TILE) {
            const int cnt = min(SUR_TILE, len - t0);
            float g = 0.0f, mv = 0.0f, prev = 0.0f, o = 0.0f;
            if (warp == 0 && lane < cnt) { /* the padding's inputs are 0, as the CPU's */
                g = tm_sur_g(cms_load(meta.target[s], start + t0 + lane, dt), scale, p.divisor);
                mv = m[t0 + lane];
                prev = has_prev ? out[t0 + lane] : 0.0f;
            }
            sur_tile_pass(net, tile, r.c, layers, g, mv, prev, cnt, &o);
            if (warp == 0) {
                if (last && lane < cnt) {
                    out[t0 + lane] = o;
                }
                const float d = tm_fadd(o, -prev);
#pragma unroll
                for (int i = 0; i < SUR_TILE / TM_SUR_LANES; i++) {
                    const float oi = __shfl_sync(0xffffffffu, o, e8 + TM_SUR_LANES * i);
                    const float di = __shfl_sync(0xffffffffu, d, e8 + TM_SUR_LANES * i);
                    if (lane < TM_SUR_LANES) {
                        oo = tm_sur_acc(oo, oi, oi);
                    } else if (lane < 2 * TM_SUR_LANES) {
                        tt = tm_sur_acc(tt, di, di);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < SUR_CHAINS; k++) {
                if (rows[k] >= 0) {
                    const float *dr = &tile[rows[k] & 0xffff][e8];
                    const float *xr = &tile[rows[k] >> 16][e8];
#pragma unroll
                    for (int i = 0; i < SUR_TILE / TM_SUR_LANES; i++) {
                        acc[k] = tm_fma(dr[TM_SUR_LANES * i], xr[TM_SUR_LANES * i], acc[k]);
                    }
                }
            }
            __syncthreads(); /* the next tile overwrites the rows */
        }
#pragma unroll
        for (int k = 0; k < SUR_CHAINS; k++) {
            const double total = sur_join_lanes((double)acc[k]);
            if (e8 == 0 && rows[k] >= 0) {
                rec[TM_SUR_NORM_PARTS + sur_group_entry(group, slot + k * SUR_SLOTS, layers)] =
                    total;
            }
        }
        if (warp == 0 && group == 0) {
            const double total = sur_join_lanes(lane < TM_SUR_LANES ? oo : tt);
            if (lane == 0) {
                rec[TM_SUR_OO] = total;
            } else if (lane == TM_SUR_LANES) {
                rec[TM_SUR_TT] = total;
            }
        }
    }
}

/* ---------------------------------------------------------------- finish ---- */

/* Threads of the first ceil(entries / n) blocks: entry q of the weights' gradient, summed over
 * every tensor's records in order, into its weight (padding entries dropped). The others: the
 * loss of tensor i when it is not normed (its sums complete only after the grads pass). */
__global__ void __launch_bounds__(SUR_TENSOR_THREADS)
sur_finish_kernel(const __grid_constant__ sur_params p, int entry_blocks)
{
    if ((int)blockIdx.x < entry_blocks) {
        const int64_t q = (int64_t)blockIdx.x * SUR_TENSOR_THREADS + threadIdx.x;
        if (q >= p.entries) {
            return;
        }
        double sum = 0.0;
        for (int32_t i = 0; i < p.count; i++) {
            const sur_rec &r = p.rec[i];
            for (int64_t b = r.first; b < r.first + r.blocks; b++) {
                sum = tm_dadd(sum, p.parts[b * p.stride + TM_SUR_NORM_PARTS + q]);
            }
        }
        int32_t k;
        const int64_t at = tm_sur_entry_index(tm_sur_entry_at(q, p.layers), p.hidden, p.layers,
                                              &k);
        if (at >= 0) {
            p.wg[k][at] = (float)sum;
        }
        return;
    }
    const int64_t i = (int64_t)(blockIdx.x - entry_blocks) * SUR_TENSOR_THREADS + threadIdx.x;
    if (i >= p.count || p.rec[i].normed) {
        return;
    }
    double sums[TM_SUR_NORM_PARTS];
    sur_tensor_sums(p, p.rec[i], sums);
    tm_sur_coefs unused;
    p.losses[i] = tm_sur_loss(sums, p.rec[i].numel, p.rec[i].has_prev, p.count, &unused);
}

/* ---------------------------------------------------------------- the walk ---- */

struct sur_walk {
    static constexpr bool keep_empty = true; /* their records (none) and losses */
    const tm_cms_surrogate_tensors *t;
    const tm_cms_surrogate_args *a;
    sur_params params;
    size_t smem;
    cudaStream_t stream;

    bool include(int32_t) const { return true; }
    int64_t numel(int32_t i) const { return t->targets.tensors[i].numel; }
    template <typename Meta> bool fits(const Meta &, int32_t) const { return true; }
    template <typename Meta> void clear(Meta &) const {}

    template <typename Meta>
    void
    fill(Meta &m, int32_t slot, int32_t i) const
    {
        m.target[slot] = t->targets.tensors[i].data;
        m.m[slot] = (const float *)t->momentum.tensors[i].data;
        m.out[slot] = (float *)t->outputs.tensors[i].data;
        m.index[slot] = i;
        m.dtype[slot] = (uint8_t)t->targets.tensors[i].dtype;
        m.has_prev[slot] = a->has_prev != NULL && a->has_prev[i] != 0;
    }

    template <typename Meta>
    tm_status
    launch(const Meta &m, int64_t chunk_base) const
    {
        sur_params p = params;
        p.chunk_base = chunk_base;
        const dim3 slices(m.t.num_chunks, SUR_SPLIT);
        const unsigned int tensors =
            (unsigned int)((m.t.count + SUR_TENSOR_THREADS - 1) / SUR_TENSOR_THREADS);
        const bool chunks = m.t.num_chunks > 0;
        if (chunks) {
            sur_gsq_kernel<<<slices, SUR_SUM_THREADS, 0, stream>>>(m, p);
            TM_CUDA_CHECK(cudaGetLastError());
        }
        sur_tensor_kernel<<<tensors, SUR_TENSOR_THREADS, 0, stream>>>(m, p, 0);
        TM_CUDA_CHECK(cudaGetLastError());
        if (chunks) {
            sur_norms_kernel<<<slices, SUR_SUM_THREADS, 0, stream>>>(m, p);
            TM_CUDA_CHECK(cudaGetLastError());
        }
        sur_tensor_kernel<<<tensors, SUR_TENSOR_THREADS, 0, stream>>>(m, p, 1);
        TM_CUDA_CHECK(cudaGetLastError());
        if (chunks) {
            sur_grads_kernel<<<slices, SUR_THREADS, smem, stream>>>(m, p);
            TM_CUDA_CHECK(cudaGetLastError());
        }
        return TM_OK;
    }
};

/* ---------------------------------------------------------------- entry points ---- */

static int64_t
sur_stride(int32_t layers)
{
    return TM_SUR_NORM_PARTS + tm_sur_grad_entries(layers);
}

size_t
cuda_cms_surrogate_scratch_bytes(const tm_tensor_list *targets, int32_t layers)
{
    if (targets == NULL || targets->count <= 0 || targets->tensors == NULL) {
        return 0;
    }
    const int32_t l = layers < 1 ? 1 : (layers > TM_CMS_MAX_LAYERS ? TM_CMS_MAX_LAYERS : layers);
    const size_t records = (size_t)cuda_list_chunks(targets) * SUR_SPLIT;
    return records * (size_t)sur_stride(l) * sizeof(double) +
           (size_t)targets->count * sizeof(sur_rec);
}

tm_status
cuda_cms_surrogate(const tm_cms_surrogate_tensors *t, const tm_cms_surrogate_args *a,
                   const tm_cms_surrogate_inputs *in, const tm_exec *exec)
{
    TM_NVTX_RANGE("cuda_cms_surrogate");
    cuda_device_guard guard;
    TM_TRY(guard.enter(t->weights.tensors[0].device_id));
    sur_walk walk;
    walk.t = t;
    walk.a = a;
    walk.stream = cuda_stream_of(exec);
    sur_params &p = walk.params;
    for (int32_t k = 0; k < 2 * TM_CMS_MAX_LAYERS + 2; k++) {
        const bool given = k < t->weights.count;
        p.w[k] = given ? (const float *)t->weights.tensors[k].data : NULL;
        p.wg[k] = given ? (float *)t->weight_grads.tensors[k].data : NULL;
    }
    p.scale = (const float *)in->scale.data; /* NULL when not given */
    p.losses = (float *)in->losses.data;
    p.stride = sur_stride(a->layers);
    p.entries = tm_sur_grad_entries(a->layers);
    const int64_t records = cuda_list_chunks(&t->targets) * SUR_SPLIT;
    p.parts = (double *)exec->scratch;
    p.rec = (sur_rec *)(p.parts + records * p.stride);
    p.chunk_base = 0;
    p.divisor = (float)a->divisor;
    p.count = t->targets.count;
    p.hidden = a->hidden;
    p.layers = a->layers;
    walk.smem = sur_grads_smem(a->layers);
    if (walk.smem > 48 * 1024) { /* deep networks: past the default limit (opt-in, host-side) */
        TM_CUDA_CHECK(cudaFuncSetAttribute(sur_grads_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)walk.smem));
    }
    if (t->targets.count > 0) {
        TM_TRY(multi_tensor_apply<sur_meta>(walk, t->targets.count));
    }
    const int entry_blocks = (int)((p.entries + SUR_TENSOR_THREADS - 1) / SUR_TENSOR_THREADS);
    const int tensor_blocks = (p.count + SUR_TENSOR_THREADS - 1) / SUR_TENSOR_THREADS;
    sur_finish_kernel<<<entry_blocks + tensor_blocks, SUR_TENSOR_THREADS, 0, walk.stream>>>(
        p, entry_blocks);
    TM_CUDA_CHECK(cudaGetLastError());
    return TM_OK;
}
