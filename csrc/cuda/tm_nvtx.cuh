/*
 * tm_nvtx.cuh -- TM_NVTX_RANGE("name"): an NVTX range from here to the end of the enclosing scope,
 * in the NVTX domain "titanmac", so Nsight Systems shows each CUDA entry point (cuda_norms,
 * cuda_adamw_step, ...) by name around the kernels it launches, next to the Python-side ranges
 * ("titanmac/stats", ... from titanmac_c/_profiling.py).
 *
 * NVTX3 is header-only (nvtx3/nvToolsExt.h in the CUDA toolkit's include directory, which nvcc
 * searches by default); it links nothing but dlopen (libdl, already linked for cudart_static).
 * Without a tool attached (NVTX_INJECTION64_PATH unset) the first call finds no tool and every
 * later call is an indirect call to an empty function: a few ns. With nsys/ncu attached the tool
 * records the range.
 *
 * Build with -DTM_NO_NVTX to compile the ranges out entirely (the macro then expands to nothing).
 * Ranges are host-side only, so they are harmless inside CUDA-graph capture (they mark the
 * capture, not the replays).
 */
#ifndef TM_NVTX_CUH
#define TM_NVTX_CUH

#define TM_NVTX_CAT2_(a, b) a##b
#define TM_NVTX_CAT_(a, b) TM_NVTX_CAT2_(a, b)

#ifdef TM_NO_NVTX

#define TM_NVTX_RANGE(name) ((void)0)

#else

#include <nvtx3/nvToolsExt.h>

namespace tm_nvtx
{

/* One domain for the whole library (C++17 inline: one handle per shared object). */
inline nvtxDomainHandle_t
domain()
{
    static const nvtxDomainHandle_t handle = nvtxDomainCreateA("titanmac");
    return handle;
}

/* RAII push/pop; name must outlive the call (string literals do). */
class scoped_range
{
  public:
    explicit scoped_range(const char *name) : domain_(domain())
    {
        nvtxEventAttributes_t attr = {};
        attr.version = NVTX_VERSION;
        attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
        attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
        attr.message.ascii = name;
        nvtxDomainRangePushEx(domain_, &attr);
    }
    ~scoped_range() { nvtxDomainRangePop(domain_); }
    scoped_range(const scoped_range &) = delete;
    scoped_range &operator=(const scoped_range &) = delete;

  private:
    nvtxDomainHandle_t domain_;
};

} // namespace tm_nvtx

#define TM_NVTX_RANGE(name) const tm_nvtx::scoped_range TM_NVTX_CAT_(tm_nvtx_range_, __LINE__)(name)

#endif /* TM_NO_NVTX */

#endif /* TM_NVTX_CUH */
