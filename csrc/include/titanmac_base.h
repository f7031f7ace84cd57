/*
 * titanmac_base.h -- what every op of the C API shares: status codes and the last error, tensors,
 * tensor lists and tm_exec. titanmac.h includes it and states the contract that goes with these
 * types; titanmac_cms.h includes it too, so each public header compiles on its own.
 */
#ifndef TITANMAC_BASE_H
#define TITANMAC_BASE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status ---- */

typedef enum {
    TM_OK = 0,
    /* the Python binding raises the exception after the arrow (Error: titanmac_c.Error) */
    TM_ERR_VALUE = 1,       /* bad hyperparameter, count or size mismatch       -> ValueError  */
    TM_ERR_TYPE = 2,        /* an argument of the wrong kind                     -> TypeError   */
    TM_ERR_BUFFER = 3,      /* unusable tensor (dtype/device/layout/read-only)   -> BufferError */
    TM_ERR_UNSUPPORTED = 4, /* valid, but this build cannot run it (no CUDA)     -> Error */
    TM_ERR_CUDA = 5,        /* CUDA runtime failure                              -> Error */
    TM_ERR_INTERNAL = 6     /* a bug in titanmac_c                               -> Error */
} tm_status;

/* Message of the last failing call on this thread ("" when none). Valid until the next call. */
const char *tm_last_error(void);

/* ---------------------------------------------------------------- tensors ---- */

/* TM_FLOAT64 is taken by the norms, clipping and AdamW (computed in double, as torch computes
 * float64 tensors) and as params and grads of the CMS ops (float32 math and state, as the
 * reference's; the accumulate and the parameter step in double); the DeepNestedOptimizer's
 * control op refuses it. */
typedef enum { TM_FLOAT32 = 0, TM_FLOAT16 = 1, TM_BFLOAT16 = 2, TM_FLOAT64 = 3 } tm_dtype;
#define TM_DTYPE_COUNT 4

/* Values match DLPack's DLDeviceType so the importer needs no table. */
typedef enum { TM_DEVICE_CPU = 1, TM_DEVICE_CUDA = 2 } tm_device_type;

#define TM_TENSOR_READ_ONLY 1u /* the producer forbids writes (DLPack READ_ONLY flag) */

/* numel elements that fill the memory from data on (DLPack data + byte_offset; NULL only if
 * numel == 0). shape: the ndim sizes of the tensor (ndim 0: a 0-d tensor), or NULL when the
 * caller does not give them; tensors whose elements a call pairs one to one (a parameter, its
 * gradient and its state) must then have equal shapes where both are given (the roles'
 * TM_ROLE_PAIRED check: a state made for a (4, 6) parameter is not the state of a (6, 4) one,
 * though their numels agree), and only their numels are compared where one is not.
 * strides == NULL: C-contiguous. Else the tensor is dense in another order of its dimensions
 * (channels_last, transposed; all strides of dimensions longer than 1 positive; shape is then
 * required), and strides (ndim of them, in elements) say which: element-wise ops read it as numel
 * elements in memory order, which pairs its elements with another tensor's only when that one
 * lies in the same order (TM_ROLE_PAIRED again). The arrays are borrowed for the call. */
typedef struct {
    void *data;
    int64_t numel;
    tm_dtype dtype;
    tm_device_type device_type;
    int32_t device_id;
    uint32_t flags; /* TM_TENSOR_* */
    int32_t ndim;
    const int64_t *shape;
    const int64_t *strides;
} tm_tensor;

/* A list of tensors playing one role. name ("params", "grads", ...) is used in messages. */
typedef struct {
    const char *name;
    const tm_tensor *tensors;
    int32_t count;
} tm_tensor_list;

/* Where and how to run. One device per call: the device of the tensors. */
typedef struct {
    void *stream;         /* cudaStream_t for CUDA tensors (NULL = legacy default); unused on CPU */
    int32_t num_threads;  /* CPU worker threads; <= 0 means one */
    void *scratch;        /* on the tensors' device (CPU: host); NULL if *_scratch_bytes() is 0 */
    size_t scratch_bytes; /* at least what the op's *_scratch_bytes() asked for */
} tm_exec;

#ifdef __cplusplus
}
#endif

#endif /* TITANMAC_BASE_H */
