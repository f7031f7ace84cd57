/*
 * tm_dlpack.h -- our own declarations of the DLPack C ABI (v1.3), the part a consumer needs:
 * devices, dtypes, DLTensor, the legacy and versioned managed tensors, their flags, and the C
 * exchange table torch puts on its tensor type (`__dlpack_c_exchange_api__`).
 *
 * Written from the field tables of docs/dlpack.md (sections 1.2 to 1.4 and 4.1), not
 * copied from dmlc/dlpack's header: the ABI is the contract, and the asserts at the bottom lock
 * every size and offset we rely on (48/64/80/16/56 bytes on LP64), so a wrong declaration fails
 * the build instead of corrupting memory. Only the bindings (csrc/python/) include this file.
 */
#ifndef TM_DLPACK_H
#define TM_DLPACK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Highest DLPack version this consumer understands (passed as max_version). */
#define TM_DLPACK_MAJOR 1
#define TM_DLPACK_MINOR 3

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3, /* pinned host memory (cudaMallocHost) */
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13,
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17,
    kDLTrn = 18
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6,
    kDLFloat8_e3m4 = 7,
    kDLFloat8_e4m3 = 8,
    kDLFloat8_e4m3b11fnuz = 9,
    kDLFloat8_e4m3fn = 10,
    kDLFloat8_e4m3fnuz = 11,
    kDLFloat8_e5m2 = 12,
    kDLFloat8_e5m2fnuz = 13,
    kDLFloat8_e8m0fnu = 14,
    kDLFloat6_e2m3fn = 15,
    kDLFloat6_e3m2fn = 16,
    kDLFloat4_e2m1fn = 17
} DLDataTypeCode;

typedef struct {
    uint8_t code; /* a DLDataTypeCode */
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

/* strides are in elements; NULL means compact row-major (allowed by producers before 1.2).
 * The first element is (char *)data + byte_offset. */
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

/* Legacy capsule payload ("dltensor"). deleter may be NULL. */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1)
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (UINT64_C(1) << 2)

/* Versioned capsule payload ("dltensor_versioned"). Only version..deleter may be read when the
 * major version differs from ours (the layout after them may have changed). */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* ---------------------------------------------------------- C exchange API ---- */

/* Every function returns 0 on success, -1 with a Python exception set; call with the GIL held. */
typedef int (*DLPackManagedTensorAllocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                            void *error_ctx,
                                            void (*set_error)(void *error_ctx, const char *kind,
                                                              const char *message));
typedef int (*DLPackManagedTensorFromPyObjectNoSync)(void *py_object,
                                                     DLManagedTensorVersioned **out);
typedef int (*DLPackManagedTensorToPyObjectNoSync)(DLManagedTensorVersioned *tensor,
                                                   void **out_py_object);
typedef int (*DLPackDLTensorFromPyObjectNoSync)(void *py_object, DLTensor *out);
typedef int (*DLPackCurrentWorkStream)(DLDeviceType device_type, int32_t device_id,
                                       void **out_current_stream);

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api; /* an older table, or NULL */
} DLPackExchangeAPIHeader;

typedef struct {
    DLPackExchangeAPIHeader header;
    DLPackManagedTensorAllocator managed_tensor_allocator;
    DLPackManagedTensorFromPyObjectNoSync managed_tensor_from_py_object_no_sync; /* owning */
    DLPackManagedTensorToPyObjectNoSync managed_tensor_to_py_object_no_sync;
    DLPackDLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync; /* non-owning; may be NULL */
    DLPackCurrentWorkStream current_work_stream;
} DLPackExchangeAPI;

/* ---------------------------------------------------------- ABI locks ---- */

#ifndef __cplusplus
#define TM_DLPACK_ASSERT(cond, what) _Static_assert(cond, what)
#else
#define TM_DLPACK_ASSERT(cond, what) static_assert(cond, what)
#endif

TM_DLPACK_ASSERT(sizeof(DLDeviceType) == 4, "DLDeviceType is a 32-bit enum");
TM_DLPACK_ASSERT(sizeof(DLPackVersion) == 8, "DLPackVersion layout");
TM_DLPACK_ASSERT(sizeof(DLDevice) == 8, "DLDevice layout");
TM_DLPACK_ASSERT(sizeof(DLDataType) == 4, "DLDataType layout");

#if UINTPTR_MAX == UINT64_MAX /* LP64: the offsets of the reference tables */
TM_DLPACK_ASSERT(sizeof(DLTensor) == 48, "DLTensor is 48 bytes");
TM_DLPACK_ASSERT(offsetof(DLTensor, device) == 8, "DLTensor.device");
TM_DLPACK_ASSERT(offsetof(DLTensor, ndim) == 16, "DLTensor.ndim");
TM_DLPACK_ASSERT(offsetof(DLTensor, dtype) == 20, "DLTensor.dtype");
TM_DLPACK_ASSERT(offsetof(DLTensor, shape) == 24, "DLTensor.shape");
TM_DLPACK_ASSERT(offsetof(DLTensor, strides) == 32, "DLTensor.strides");
TM_DLPACK_ASSERT(offsetof(DLTensor, byte_offset) == 40, "DLTensor.byte_offset");
TM_DLPACK_ASSERT(sizeof(DLManagedTensor) == 64, "DLManagedTensor is 64 bytes");
TM_DLPACK_ASSERT(offsetof(DLManagedTensor, manager_ctx) == 48, "DLManagedTensor.manager_ctx");
TM_DLPACK_ASSERT(offsetof(DLManagedTensor, deleter) == 56, "DLManagedTensor.deleter");
TM_DLPACK_ASSERT(sizeof(DLManagedTensorVersioned) == 80, "DLManagedTensorVersioned is 80 bytes");
TM_DLPACK_ASSERT(offsetof(DLManagedTensorVersioned, manager_ctx) == 8, "versioned manager_ctx");
TM_DLPACK_ASSERT(offsetof(DLManagedTensorVersioned, deleter) == 16, "versioned deleter");
TM_DLPACK_ASSERT(offsetof(DLManagedTensorVersioned, flags) == 24, "versioned flags");
TM_DLPACK_ASSERT(offsetof(DLManagedTensorVersioned, dl_tensor) == 32, "versioned dl_tensor");
TM_DLPACK_ASSERT(sizeof(DLPackExchangeAPIHeader) == 16, "DLPackExchangeAPIHeader is 16 bytes");
TM_DLPACK_ASSERT(sizeof(DLPackExchangeAPI) == 56, "DLPackExchangeAPI is 56 bytes");
TM_DLPACK_ASSERT(offsetof(DLPackExchangeAPI, managed_tensor_allocator) == 16, "api allocator");
TM_DLPACK_ASSERT(offsetof(DLPackExchangeAPI, managed_tensor_from_py_object_no_sync) == 24,
                 "api managed_tensor_from_py_object_no_sync");
TM_DLPACK_ASSERT(offsetof(DLPackExchangeAPI, managed_tensor_to_py_object_no_sync) == 32,
                 "api managed_tensor_to_py_object_no_sync");
TM_DLPACK_ASSERT(offsetof(DLPackExchangeAPI, dltensor_from_py_object_no_sync) == 40,
                 "api dltensor_from_py_object_no_sync");
TM_DLPACK_ASSERT(offsetof(DLPackExchangeAPI, current_work_stream) == 48, "api current_work_stream");
#endif

#ifdef __cplusplus
}
#endif

#endif /* TM_DLPACK_H */
