/*
 * tm_tensor.c -- the per-tensor and per-list checks declared in tm_tensor.h, with the exact
 * messages the Python tests match on.
 */
#include "tm_tensor.h"

#include <inttypes.h>
#include <stdio.h>

#include "tm_status.h"

const char *
tm_dtype_name(tm_dtype dtype)
{
    switch (dtype) {
    case TM_FLOAT32:
        return "float32";
    case TM_FLOAT16:
        return "float16";
    case TM_BFLOAT16:
        return "bfloat16";
    case TM_FLOAT64:
        return "float64";
    }
    return "unknown";
}

size_t
tm_dtype_size(tm_dtype dtype)
{
    switch (dtype) {
    case TM_FLOAT32:
        return 4;
    case TM_FLOAT16:
    case TM_BFLOAT16:
        return 2;
    case TM_FLOAT64:
        return 8;
    }
    return 0;
}

const char *
tm_device_text(const tm_tensor *t, char *buf)
{
    if (t->device_type == TM_DEVICE_CUDA) {
        snprintf(buf, TM_DEVICE_TEXT, "cuda:%d", (int)t->device_id);
    } else if (t->device_type == TM_DEVICE_CPU) {
        snprintf(buf, TM_DEVICE_TEXT, "cpu");
    } else {
        snprintf(buf, TM_DEVICE_TEXT, "device type %d", (int)t->device_type);
    }
    return buf;
}

const char *
tm_label(const char *name, int32_t index, char *buf)
{
    if (index == TM_NO_INDEX) {
        snprintf(buf, TM_LABEL_TEXT, "%s", name);
    } else {
        snprintf(buf, TM_LABEL_TEXT, "%s[%d]", name, (int)index);
    }
    return buf;
}

void
tm_dims_text(char *buf, size_t cap, const int64_t *v, int32_t n)
{
    size_t len = (size_t)snprintf(buf, cap, "[");
    for (int32_t d = 0; d < n && len < cap; d++) {
        if (d == 8) {
            len += (size_t)snprintf(buf + len, cap - len, ", ...");
            break;
        }
        len += (size_t)snprintf(buf + len, cap - len, d ? ", %lld" : "%lld", (long long)v[d]);
    }
    if (len < cap) {
        snprintf(buf + len, cap - len, "]");
    }
}

const char *
tm_layout_text(const tm_tensor *t, char *buf)
{
    if (t->strides == NULL) {
        snprintf(buf, TM_LAYOUT_TEXT, "contiguous");
        return buf;
    }
    char shape[TM_LAYOUT_TEXT / 2 - 16], strides[TM_LAYOUT_TEXT / 2 - 16];
    tm_dims_text(shape, sizeof shape, t->shape, t->ndim);
    tm_dims_text(strides, sizeof strides, t->strides, t->ndim);
    snprintf(buf, TM_LAYOUT_TEXT, "shape %s, strides %s", shape, strides);
    return buf;
}

/* The next dimension at or after *d longer than 1 (its index, or ndim when none is left). */
static int32_t
next_long_dim(const tm_tensor *t, int32_t d)
{
    while (d < t->ndim && t->shape[d] == 1) {
        d++;
    }
    return d;
}

int
tm_same_order(const tm_tensor *a, const tm_tensor *b)
{
    if (a->strides == NULL || b->strides == NULL) {
        return a->strides == b->strides;
    }
    int32_t i = next_long_dim(a, 0), j = next_long_dim(b, 0);
    for (; i < a->ndim && j < b->ndim; i = next_long_dim(a, i + 1), j = next_long_dim(b, j + 1)) {
        if (a->shape[i] != b->shape[j] || a->strides[i] != b->strides[j]) {
            return 0;
        }
    }
    return i == a->ndim && j == b->ndim;
}

int
tm_same_shape(const tm_tensor *a, const tm_tensor *b)
{
    if (a->shape == NULL || b->shape == NULL) {
        return 1;
    }
    if (a->ndim != b->ndim) {
        return 0;
    }
    for (int32_t d = 0; d < a->ndim; d++) {
        if (a->shape[d] != b->shape[d]) {
            return 0;
        }
    }
    return 1;
}

const char *
tm_shape_text(const tm_tensor *t, char *buf)
{
    if (t->shape == NULL) {
        snprintf(buf, TM_SHAPE_TEXT, "(not given)");
    } else {
        tm_dims_text(buf, TM_SHAPE_TEXT, t->shape, t->ndim);
    }
    return buf;
}

int
tm_same_device(const tm_tensor *a, const tm_tensor *b)
{
    if (a->device_type != b->device_type) {
        return 0;
    }
    return a->device_type != TM_DEVICE_CUDA || a->device_id == b->device_id;
}

int
tm_tensor_given(const tm_tensor *t)
{
    return t->data != NULL || t->numel != 0;
}

tm_status
tm_check_list(const tm_tensor_list *list)
{
    TM_CHECK(list->count >= 0, TM_ERR_INTERNAL, "%s: negative tensor count %d", list->name,
             (int)list->count);
    TM_CHECK(list->tensors != NULL || list->count == 0, TM_ERR_INTERNAL,
             "%s: %d tensors but no tensor array", list->name, (int)list->count);
    return TM_OK;
}

tm_status
tm_check_count(const tm_tensor_list *list, int32_t expected, const char *lead_name)
{
    TM_CHECK(list->count == expected, TM_ERR_VALUE, "%s: %d tensors, %s has %d", list->name,
             (int)list->count, lead_name, (int)expected);
    return TM_OK;
}

tm_status
tm_check_usable(const tm_tensor *t, const char *name, int32_t index)
{
    char label[TM_LABEL_TEXT];
    TM_CHECK(t->numel >= 0, TM_ERR_BUFFER, "%s: negative numel %lld", tm_label(name, index, label),
             (long long)t->numel);
    TM_CHECK(t->data != NULL || t->numel == 0, TM_ERR_BUFFER, "%s: data is NULL",
             tm_label(name, index, label));
    TM_CHECK(tm_dtype_size(t->dtype) != 0, TM_ERR_BUFFER, "%s: unsupported dtype",
             tm_label(name, index, label));
    /* The loops load and store whole elements: a misaligned one is undefined behaviour in C and
     * a fault on CUDA (torch.frombuffer at an odd byte offset makes such a tensor). */
    TM_CHECK((uintptr_t)t->data % tm_dtype_size(t->dtype) == 0, TM_ERR_BUFFER,
             "%s: data address 0x%" PRIxPTR " is not aligned to its %zu-byte elements",
             tm_label(name, index, label), (uintptr_t)t->data, tm_dtype_size(t->dtype));
    TM_CHECK(t->device_type == TM_DEVICE_CPU || t->device_type == TM_DEVICE_CUDA, TM_ERR_BUFFER,
             "%s: unsupported device type %d", tm_label(name, index, label), (int)t->device_type);
    /* the order of a tensor laid out otherwise than C's is read from its sizes and strides */
    TM_CHECK(t->shape != NULL || t->strides == NULL, TM_ERR_BUFFER,
             "%s: strides given without a shape", tm_label(name, index, label));
    if (t->shape != NULL) {
        /* the shape compared between paired tensors must be this tensor's */
        int64_t n = 1;
        int ok = t->ndim >= 0;
        for (int32_t d = 0; ok && d < t->ndim; d++) {
            ok = t->shape[d] >= 0 && (t->shape[d] == 0 || n <= INT64_MAX / t->shape[d]);
            n = ok ? n * t->shape[d] : n;
        }
        char shape[TM_SHAPE_TEXT];
        TM_CHECK(ok && n == t->numel, TM_ERR_BUFFER, "%s: shape %s (ndim %d) does not hold its "
                 "numel %lld", tm_label(name, index, label),
                 t->ndim >= 0 ? tm_shape_text(t, shape) : "?", (int)t->ndim,
                 (long long)t->numel);
    }
    return TM_OK;
}

tm_status
tm_check_device(const tm_tensor *t, const char *name, int32_t index, const tm_tensor *ref,
                const char *ref_label)
{
    char label[TM_LABEL_TEXT];
    char dev[TM_DEVICE_TEXT];
    char ref_dev[TM_DEVICE_TEXT];
    TM_CHECK(tm_same_device(t, ref), TM_ERR_VALUE, "%s: on %s, but %s is on %s",
             tm_label(name, index, label), tm_device_text(t, dev), ref_label,
             tm_device_text(ref, ref_dev));
    return TM_OK;
}

tm_status
tm_check_writable(const tm_tensor *t, const char *name, int32_t index)
{
    char label[TM_LABEL_TEXT];
    TM_CHECK((t->flags & TM_TENSOR_READ_ONLY) == 0, TM_ERR_BUFFER,
             "%s: read-only, cannot be updated", tm_label(name, index, label));
    return TM_OK;
}

/* t is float32 (or float64 where real_ok) with numel elements; the message names what was
 * expected. */
static tm_status
check_scalar_numel(const tm_tensor *t, const char *name, int32_t index, int64_t numel,
                   int real_ok)
{
    char label[TM_LABEL_TEXT];
    int dtype_ok = t->dtype == TM_FLOAT32 || (real_ok && t->dtype == TM_FLOAT64);
    TM_CHECK(dtype_ok && t->numel == numel, TM_ERR_VALUE,
             "%s: expected %s with %lld element%s, got %s with %lld", tm_label(name, index, label),
             real_ok ? "float32 or float64" : "float32", (long long)numel, numel == 1 ? "" : "s",
             tm_dtype_name(t->dtype), (long long)t->numel);
    return TM_OK;
}

tm_status
tm_check_real_numel(const tm_tensor *t, const char *name, int32_t index, int64_t numel)
{
    return check_scalar_numel(t, name, index, numel, 1);
}

tm_status
tm_check_f32_numel(const tm_tensor *t, const char *name, int32_t index, int64_t numel)
{
    return check_scalar_numel(t, name, index, numel, 0);
}
