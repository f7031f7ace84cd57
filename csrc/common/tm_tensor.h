/*
 * tm_tensor.h -- checks on tm_tensor and tm_tensor_list that every op's validation is made of,
 * each recording a message that names the tensor the way the user knows it ("exp_avg[3]",
 * "lr"), as torch's own argument checks do.
 *
 * A label is a list name plus an index; index TM_NO_INDEX labels a lone tensor ("lr").
 */
#ifndef TM_TENSOR_H
#define TM_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "titanmac.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TM_NO_INDEX (-1)

/* "cuda:1" is 6 characters plus up to 11 for the id; room to spare. */
#define TM_DEVICE_TEXT 24

/* Room for the longest label: a name plus "[2147483647]". */
#define TM_LABEL_TEXT 80

/* "float32", "float16", "bfloat16", "float64", or "unknown" for a value outside the enum. */
const char *tm_dtype_name(tm_dtype dtype);

/* Bytes per element; 0 for a value outside the enum. */
size_t tm_dtype_size(tm_dtype dtype);

/* "cpu" or "cuda:<id>" into buf[TM_DEVICE_TEXT]. Returns buf. */
const char *tm_device_text(const tm_tensor *t, char *buf);

/* "name[index]", or "name" for TM_NO_INDEX, into buf[TM_LABEL_TEXT]. Returns buf. */
const char *tm_label(const char *name, int32_t index, char *buf);

/* "[4, 3, 2]" (the first 8 values, then ", ...") into buf[cap]. */
void tm_dims_text(char *buf, size_t cap, const int64_t *v, int32_t n);

/* Room for a layout: two dims texts and words. */
#define TM_LAYOUT_TEXT 200

/* "contiguous", or "shape [2, 3], strides [1, 2]" of a tensor dense in another order, into
 * buf[TM_LAYOUT_TEXT]. Returns buf. */
const char *tm_layout_text(const tm_tensor *t, char *buf);

/* a and b lay their elements out in the same order: both C-contiguous, or both dense in another
 * order with the same sizes and strides over the dimensions longer than 1 (element k of each in
 * memory is then the same index). */
int tm_same_order(const tm_tensor *a, const tm_tensor *b);

/* a and b have the same shape (ndim and every size), or one of them has none given (shape NULL:
 * the caller knows only its numel). */
int tm_same_shape(const tm_tensor *a, const tm_tensor *b);

/* Room for a shape text: 8 sizes of up to 20 characters and the separators. */
#define TM_SHAPE_TEXT 200

/* "[4, 6]" (the first 8 sizes, then ", ..."), "[]" for a 0-d tensor, "(not given)" without a
 * shape, into buf[TM_SHAPE_TEXT]. Returns buf. */
const char *tm_shape_text(const tm_tensor *t, char *buf);

/* Same device type, and for CUDA the same ordinal (every CPU tensor is on the one host). */
int tm_same_device(const tm_tensor *a, const tm_tensor *b);

/* An optional tensor counts as given unless it is {data NULL, numel 0}. */
int tm_tensor_given(const tm_tensor *t);

/* count >= 0 and tensors != NULL when count > 0 (TM_ERR_INTERNAL otherwise: the binding built
 * the list). */
tm_status tm_check_list(const tm_tensor_list *list);

/* list->count == expected, else "grads: 3 tensors, params has 4" (TM_ERR_VALUE). */
tm_status tm_check_count(const tm_tensor_list *list, int32_t expected, const char *lead_name);

/* What any usable tensor satisfies: numel >= 0, data != NULL when numel > 0, a known dtype and
 * device type, a shape wherever strides are given (TM_ERR_BUFFER). */
tm_status tm_check_usable(const tm_tensor *t, const char *name, int32_t index);

/* On the device of ref, else "exp_avg[5]: on cuda:1, but params[0] is on cpu" (TM_ERR_VALUE). */
tm_status tm_check_device(const tm_tensor *t, const char *name, int32_t index, const tm_tensor *ref,
                          const char *ref_label);

/* Not flagged TM_TENSOR_READ_ONLY, else "params[0]: read-only, cannot be updated". */
tm_status tm_check_writable(const tm_tensor *t, const char *name, int32_t index);

/* float32 with exactly numel elements, else
 * "lr: expected float32 with 3 elements, got float32 with 1" (TM_ERR_VALUE). */
tm_status tm_check_f32_numel(const tm_tensor *t, const char *name, int32_t index, int64_t numel);

/* The same for the scalars whose precision follows the tensors' (norms, clip coefficients, learning
 * rates): float32 or float64 with exactly numel elements. */
tm_status tm_check_real_numel(const tm_tensor *t, const char *name, int32_t index, int64_t numel);

#ifdef __cplusplus
}
#endif

#endif /* TM_TENSOR_H */
