/*
 * tm_half.h -- bfloat16 and IEEE float16 <-> float32 on the CPU, by bit manipulation.
 *
 * Why not F16C or _Float16: the same loops are compiled for a baseline x86-64 (no F16C) and for
 * other architectures, and every instruction set must give the same bits. Each function is
 * branch-free integer work plus at most one exact or correctly rounded float operation, so GCC
 * vectorizes the loops that call it and the result never depends on the ISA.
 *
 * Narrowing rounds to nearest, ties to even, as torch does (c10/util/BFloat16.h
 * round_to_nearest_even, c10/util/Half.h fp16_ieee_from_fp32_value); overflow gives +-inf;
 * NaN stays NaN with its sign and the top payload bits, made quiet. Widening is exact.
 * Adapted from Eigen's float_to_half_rtne / half_to_float (Half.h) and FP16 by M. Dukhan.
 */
#ifndef TM_HALF_H
#define TM_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t
tm_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float
tm_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bfloat16 is the top half of a float32. */
static inline float
tm_bf16_to_f32(uint16_t h)
{
    return tm_bits_f32((uint32_t)h << 16);
}

/* All ones when cond holds, else zero. Selecting with masks instead of ?: keeps every value
 * computed unconditionally, so GCC never turns a select back into a branch (it will not
 * speculate a float operation out of one arm under -ftrapping-math), and loops stay vectorized. */
static inline uint32_t
tm_mask_if(int cond)
{
    return (uint32_t)0 - (uint32_t)(cond != 0);
}

static inline uint32_t
tm_select(uint32_t mask, uint32_t if_set, uint32_t if_clear)
{
    return (if_set & mask) | (if_clear & ~mask);
}

static inline uint16_t
tm_f32_to_bf16(float f)
{
    uint32_t u = tm_f32_bits(f);
    /* Adding 0x7fff plus the lowest kept bit carries into the kept bits exactly when the
     * dropped half is above the tie, or at the tie with an odd kept part. */
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)tm_select(tm_mask_if((u & 0x7fffffffu) > 0x7f800000u), nan, rounded);
}

static inline float
tm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    /* Normal: move the fields into place and rebias the exponent from 15 to 127; inf and NaN
     * (exponent 31) get 112 more, which makes the float exponent all ones and keeps the payload. */
    uint32_t normal = (em << 13) + (112u << 23) + (tm_mask_if(em >= 0x7c00u) & (112u << 23));
    /* Zero and subnormals: em units of 2^-24, exact in float. */
    uint32_t subnormal = tm_f32_bits((float)(int32_t)em * 0x1p-24f);
    return tm_bits_f32(sign | tm_select(tm_mask_if(em < 0x0400u), subnormal, normal));
}

static inline uint16_t
tm_f32_to_f16(float f)
{
    uint32_t u = tm_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    /* |f| >= 2^-14: rebias, then round the 13 dropped bits as in tm_f32_to_bf16; the carry may
     * step the exponent, up to 0x7c00 (inf) for |f| >= 65520. Unused (and wrapped) below 2^-14. */
    uint32_t normal = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    /* |f| < 2^-14: adding 0.5f makes the FPU round |f| to a multiple of 2^-24 (the half
     * subnormal step, which is the ulp of 0.5f); the low bits are then the half's bits. */
    uint32_t subnormal = tm_f32_bits(tm_bits_f32(a) + 0.5f) - 0x3f000000u;
    uint32_t mag = tm_select(tm_mask_if(a >= 0x38800000u), normal, subnormal);
    mag = tm_select(tm_mask_if(a >= 0x47800000u), 0x7c00u, mag);
    mag = tm_select(tm_mask_if(a > 0x7f800000u), nan, mag);
    return (uint16_t)(sign | mag);
}

#endif /* TM_HALF_H */
