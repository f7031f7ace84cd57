/*
 * multi_tensor.cuh -- tensor-list metadata passed by value in the kernel parameters, and the one
 * launcher every op uses to cover a list in as few launches as the metadata allows.
 *
 * Work unit: a chunk of TM_CHUNK consecutive elements of one tensor, one thread block per chunk,
 * as in PyTorch's MultiTensorApply.cuh and TE's multi_tensor_apply.cuh. Those keep a
 * block -> (tensor, chunk) table, which caps a launch at a few hundred blocks whatever the tensor
 * sizes. Here a launch records per tensor the running count of chunks up to and including it
 * (chunk_end, an inclusive prefix sum) and block b finds its tensor by binary search: at most
 * log2(capacity) + 1 = 11 uniform loads from the constant bank, against 65,536 elements of work.
 * A launch then holds as many chunks as gridDim.x allows, and the launch count depends only on
 * the tensor count: ceil(tensors / capacity), capacity ~500-1,300 with 32 KB of parameters
 * (each op static_asserts its table against TM_KERNEL_PARAM_BYTES).
 *
 * The table is a __grid_constant__ kernel parameter: device code reads it in place through
 * references (no 32 KB copy to local memory).
 *
 * Indexing: a chunk's first element is chunk * TM_CHUNK in int64, so tensors may exceed 2^31
 * elements; offsets inside a chunk fit in int32. Chunks per launch fit in uint32 (<= 2^31 - 1).
 *
 * A tensor with numel 0 contributes no chunk. An op may still keep it in the table (AdamW, whose
 * step counts must advance): its chunk_end equals its predecessor's, and the search, which looks
 * for the first chunk_end greater than b, never lands on it.
 */
#ifndef TM_MULTI_TENSOR_CUH
#define TM_MULTI_TENSOR_CUH

#include "cuda_common.cuh"

/* The part of every op's metadata that the launcher fills and locate_chunk reads. */
template <int CAP> struct tensor_table {
    int64_t numel[CAP];
    uint32_t chunk_end[CAP]; /* chunks of tensors 0..i of this launch */
    int32_t count;           /* tensors in this launch */
    uint32_t num_chunks;     /* chunk_end[count - 1]: this launch's gridDim.x */
};

/* Tensors per launch when each also costs extra_per_tensor bytes of op arrays, and fixed bytes
 * of other parameters share the space; 64 bytes are left for alignment padding. Each op checks
 * the result with static_assert(sizeof(meta) + sizeof(args) <= TM_KERNEL_PARAM_BYTES). */
constexpr int
cuda_meta_capacity(size_t extra_per_tensor, size_t fixed)
{
    return (int)((TM_KERNEL_PARAM_BYTES - fixed - 64) /
                 (extra_per_tensor + sizeof(int64_t) + sizeof(uint32_t)));
}

static inline int64_t
cuda_chunks_of(int64_t numel)
{
    return (numel + TM_CHUNK - 1) / TM_CHUNK;
}

/* Chunks of a whole list: the size of any per-chunk scratch. */
static inline int64_t
cuda_list_chunks(const tm_tensor_list *list)
{
    int64_t chunks = 0;
    for (int32_t i = 0; list != NULL && i < list->count; i++) {
        chunks += cuda_chunks_of(list->tensors[i].numel);
    }
    return chunks;
}

/*
 * Walks tensors 0..count-1 in list order and launches each time the table is full, and once at
 * the end. The walk object supplies the op (duck-typed, all const):
 *   static constexpr bool keep_empty;             keep numel-0 tensors in the table
 *   bool      include(int32_t i);                 tensor i belongs to this walk
 *   int64_t   numel(int32_t i);
 *   bool      fits(const Meta &, int32_t i);      room in the op's own per-launch tables
 *   void      fill(Meta &, int32_t slot, int32_t i);  the op's per-tensor fields
 *   void      clear(Meta &);                      empty the op's per-launch tables
 *   tm_status launch(const Meta &, int64_t chunk_base);  chunk_base: chunks of earlier launches
 * Chunks are numbered across launches in list order, so (tensor, chunk) -> chunk_base + blockIdx.x
 * is the same on every call with the same list, however the launches fall.
 */
template <typename Meta, typename Walk>
static tm_status
multi_tensor_apply(const Walk &walk, int32_t count)
{
    Meta meta; /* ~32 KB on the host stack; only the first t.count entries are read */
    int64_t chunks = 0;
    int64_t chunk_base = 0;
    auto flush = [&]() -> tm_status {
        meta.t.num_chunks = (uint32_t)chunks;
        TM_TRY(walk.launch(meta, chunk_base));
        chunk_base += chunks;
        chunks = 0;
        meta.t.count = 0;
        walk.clear(meta);
        return TM_OK;
    };
    meta.t.count = 0;
    walk.clear(meta);
    for (int32_t i = 0; i < count; i++) {
        const int64_t nch = cuda_chunks_of(walk.numel(i));
        if (!walk.include(i) || (nch == 0 && !Walk::keep_empty)) {
            continue;
        }
        TM_CHECK(nch <= TM_MAX_GRID_X, TM_ERR_INTERNAL, "tensor %d: %lld chunks exceed a grid",
                 (int)i, (long long)nch);
        if (meta.t.count > 0 && (meta.t.count == Meta::capacity ||
                                 chunks + nch > TM_MAX_GRID_X || !walk.fits(meta, i))) {
            TM_TRY(flush());
        }
        const int32_t slot = meta.t.count++;
        walk.fill(meta, slot, i);
        chunks += nch;
        meta.t.numel[slot] = walk.numel(i);
        meta.t.chunk_end[slot] = (uint32_t)chunks;
    }
    return meta.t.count > 0 ? flush() : TM_OK;
}

/* Block b (< t.num_chunks) -> its tensor i, the chunk's first element and its length (1..CHUNK).
 * Every thread of the block computes the same answer from the same uniform loads. */
template <int CAP>
static __device__ __forceinline__ void
locate_chunk(const tensor_table<CAP> &t, uint32_t b, int32_t *i, int64_t *start, int32_t *len)
{
    int32_t lo = 0;
    int32_t hi = t.count - 1;
    while (lo < hi) { /* first tensor whose chunk_end exceeds b */
        const int32_t mid = (lo + hi) >> 1;
        if (t.chunk_end[mid] > b) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    const uint32_t first = lo > 0 ? t.chunk_end[lo - 1] : 0u;
    const int64_t begin = (int64_t)(b - first) * TM_CHUNK;
    const int64_t rest = t.numel[lo] - begin;
    *i = lo;
    *start = begin;
    *len = (int32_t)(rest < TM_CHUNK ? rest : TM_CHUNK);
}

#endif /* TM_MULTI_TENSOR_CUH */
