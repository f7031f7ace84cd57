/*
 * tm_roles.c -- the tensor checks shared by every op (see tm_roles.h), in the order the messages
 * are specified: each check runs over all tensors of the call before the next one starts, so a
 * call with several faults always reports the same one.
 */
#include "tm_roles.h"

#include <stdint.h>
#include <stdlib.h>

#include "../common/tm_status.h"

tm_role
tm_list_role(const tm_tensor_list *list, const char *default_name, unsigned flags)
{
    tm_role r = {{default_name, NULL, 0}, flags};
    if (list != NULL) {
        r.list = *list;
        r.list.name = list->name != NULL ? list->name : default_name;
    }
    return r;
}

tm_role
tm_lone_role(const tm_tensor *t, const char *name, unsigned flags)
{
    tm_role r = {{name, t, 1}, flags | TM_ROLE_LONE};
    return r;
}

/* Lone tensors that were not given are left to the op's shape checks, which name them. */
static int
present(const tm_role *r, int32_t i)
{
    return !(r->flags & TM_ROLE_LONE) || tm_tensor_given(&r->list.tensors[i]);
}

static int32_t
index_of(const tm_role *r, int32_t i)
{
    return (r->flags & TM_ROLE_LONE) ? TM_NO_INDEX : i;
}

tm_status
tm_roles_structure(const tm_role *roles, int n)
{
    for (int k = 0; k < n; k++) {
        TM_TRY(tm_check_list(&roles[k].list));
    }
    return TM_OK;
}

/* A tensor dense in another order than C's is taken only where the op reads it element-wise. */
static tm_status
check_order(const tm_role *r, int32_t i)
{
    const tm_tensor *t = &r->list.tensors[i];
    char label[TM_LABEL_TEXT], layout[TM_LAYOUT_TEXT];
    TM_CHECK(t->strides == NULL || (r->flags & (TM_ROLE_ANY_ORDER | TM_ROLE_PAIRED)), TM_ERR_BUFFER,
             "%s: not contiguous (%s)", tm_label(r->list.name, index_of(r, i), label),
             tm_layout_text(t, layout));
    return TM_OK;
}

/* Element-wise ops pair element k of one tensor with element k of the other; torch's ops pair
 * them by index, which is the same only where the shapes agree: a state made for a (4, 6)
 * parameter stepped with the parameter reshaped to (6, 4) (`p.data = p.data.reshape(6, 4)`, a
 * checkpoint of another model) has the numel but not the meaning of its state, and torch's
 * foreach ops refuse it. */
static tm_status
check_same_shape(const tm_tensor_list *l, const tm_tensor_list *lead, int32_t i)
{
    const tm_tensor *a = &l->tensors[i], *b = &lead->tensors[i];
    char sa[TM_SHAPE_TEXT], sb[TM_SHAPE_TEXT];
    TM_CHECK(tm_same_shape(a, b), TM_ERR_VALUE, "%s[%d]: shape %s does not match %s[%d] shape %s",
             l->name, (int)i, tm_shape_text(a, sa), lead->name, (int)i, tm_shape_text(b, sb));
    return TM_OK;
}

/* Element-wise ops pair elements by their place in memory, torch's by index: the same where the
 * two tensors lie in one order. */
static tm_status
check_same_order(const tm_tensor_list *l, const tm_tensor_list *lead, int32_t i)
{
    const tm_tensor *a = &l->tensors[i], *b = &lead->tensors[i];
    char la[TM_LAYOUT_TEXT], lb[TM_LAYOUT_TEXT];
    TM_CHECK(tm_same_order(a, b), TM_ERR_BUFFER,
             "%s[%d]: laid out as %s, %s[%d] as %s (tensors paired element by element need one "
             "memory order)", l->name, (int)i, tm_layout_text(a, la), lead->name, (int)i,
             tm_layout_text(b, lb));
    return TM_OK;
}

static tm_status
check_usable(const tm_role *roles, int n, tm_device_ref *ref)
{
    ref->tensor = NULL;
    ref->label[0] = '\0';
    for (int k = 0; k < n; k++) {
        const tm_role *r = &roles[k];
        for (int32_t i = 0; i < r->list.count; i++) {
            if (!present(r, i)) {
                continue;
            }
            TM_TRY(tm_check_usable(&r->list.tensors[i], r->list.name, index_of(r, i)));
            if (r->list.tensors[i].strides != NULL) { /* else C-contiguous: nothing to check */
                TM_TRY(check_order(r, i));
            }
            if (ref->tensor == NULL) {
                ref->tensor = &r->list.tensors[i];
                tm_label(r->list.name, index_of(r, i), ref->label);
            }
        }
    }
    return TM_OK;
}

static tm_status
check_devices(const tm_role *roles, int n, const tm_device_ref *ref)
{
    for (int k = 0; k < n; k++) {
        const tm_role *r = &roles[k];
        for (int32_t i = 0; i < r->list.count; i++) {
            if (present(r, i)) {
                TM_TRY(tm_check_device(&r->list.tensors[i], r->list.name, index_of(r, i),
                                       ref->tensor, ref->label));
            }
        }
    }
    return TM_OK;
}

/* Counts were checked by the op, so every matched list has the lead's count. */
static tm_status
check_match(const tm_role *roles, int n, int dtype)
{
    const tm_tensor_list *lead = &roles[0].list;
    for (int k = 1; k < n; k++) {
        const tm_tensor_list *l = &roles[k].list;
        unsigned want = dtype ? TM_ROLE_MATCH : (TM_ROLE_MATCH | TM_ROLE_MATCH_NUMEL);
        for (int32_t i = 0; (roles[k].flags & want) && i < l->count; i++) {
            const tm_tensor *a = &l->tensors[i];
            const tm_tensor *b = &lead->tensors[i];
            TM_CHECK(dtype || a->numel == b->numel, TM_ERR_VALUE,
                     "%s[%d]: numel %lld does not match %s[%d] numel %lld", l->name, (int)i,
                     (long long)a->numel, lead->name, (int)i, (long long)b->numel);
            if (!dtype && (roles[k].flags & TM_ROLE_PAIRED)) {
                TM_TRY(check_same_shape(l, lead, i));
                if (a->strides != NULL || b->strides != NULL) {
                    TM_TRY(check_same_order(l, lead, i));
                }
            }
            TM_CHECK(!dtype || a->dtype == b->dtype, TM_ERR_VALUE,
                     "%s[%d]: dtype %s does not match %s[%d] dtype %s", l->name, (int)i,
                     tm_dtype_name(a->dtype), lead->name, (int)i, tm_dtype_name(b->dtype));
        }
    }
    return TM_OK;
}

static tm_status
check_writable(const tm_role *roles, int n)
{
    for (int k = 0; k < n; k++) {
        const tm_role *r = &roles[k];
        for (int32_t i = 0; (r->flags & TM_ROLE_WRITTEN) && i < r->list.count; i++) {
            if (present(r, i)) {
                TM_TRY(tm_check_writable(&r->list.tensors[i], r->list.name, index_of(r, i)));
            }
        }
    }
    return TM_OK;
}

/* ---------------------------------------------------------------- disjoint memory ---- */

/* A tensor's bytes [lo, hi) (imported tensors are dense), whose role and index name it. */
typedef struct {
    uintptr_t lo, hi;
    int32_t role, index;
    int written;
} tm_span;

/* A span's start address and its place in the spans array: what the sort moves. */
typedef struct {
    uintptr_t lo;
    int64_t at;
} tm_span_key;

enum { TM_RADIX_BITS = 8, TM_RADIX_BUCKETS = 1 << TM_RADIX_BITS };

/* Sorts keys[0, n) by address, tmp[n] its scratch, stably: equal addresses keep the order of the
 * spans array, which lists roles and indices in order, so ties come out by (role, index) as the
 * checks above name faults. A least-significant-digit radix sort over the address bits that
 * differ between spans (a few passes of 8 bits): a model's tensors lie in the heap in no order
 * related to their lists, and a comparison sort then takes n log n unpredictable branches (most
 * of the C core's host time of a step over a thousand tensors). Returns the sorted array. */
static tm_span_key *
sort_spans(tm_span_key *keys, tm_span_key *tmp, int64_t n)
{
    uintptr_t differ = 0;
    for (int64_t i = 1; i < n; i++) {
        differ |= keys[i].lo ^ keys[0].lo;
    }
    for (unsigned shift = 0; shift < sizeof(uintptr_t) * 8 && (differ >> shift) != 0;
         shift += TM_RADIX_BITS) {
        if (((differ >> shift) & (TM_RADIX_BUCKETS - 1)) == 0) {
            continue; /* a digit every span shares (e.g. the low bits of aligned addresses) */
        }
        int64_t start[TM_RADIX_BUCKETS] = {0};
        for (int64_t i = 0; i < n; i++) {
            start[(keys[i].lo >> shift) & (TM_RADIX_BUCKETS - 1)]++;
        }
        int64_t sum = 0;
        for (int b = 0; b < TM_RADIX_BUCKETS; b++) {
            int64_t c = start[b];
            start[b] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++) {
            tmp[start[(keys[i].lo >> shift) & (TM_RADIX_BUCKETS - 1)]++] = keys[i];
        }
        tm_span_key *t = keys;
        keys = tmp;
        tmp = t;
    }
    return keys;
}

/* "later: shares memory with earlier", later and earlier in (role, index) order, as the
 * checks above name the first fault. */
static tm_status
report_overlap(const tm_role *roles, const tm_span *x, const tm_span *y)
{
    if (x->role < y->role || (x->role == y->role && x->index < y->index)) {
        const tm_span *t = x;
        x = y;
        y = t;
    }
    char a[TM_LABEL_TEXT], b[TM_LABEL_TEXT];
    const tm_role *rx = &roles[x->role], *ry = &roles[y->role];
    return tm_set_error(TM_ERR_VALUE, __FILE__, __LINE__, "%s: shares memory with %s",
                        tm_label(rx->list.name, index_of(rx, x->index), a),
                        tm_label(ry->list.name, index_of(ry, y->index), b));
}

/* One sweep over the spans in address order (order[k] the k-th): a span overlaps an earlier one
 * exactly when it starts before the furthest end reached so far, so a written span is checked
 * against the furthest-reaching span of any kind, a read one against the furthest-reaching
 * written one. Parallel writers (threads, CUDA blocks) would race on shared memory, and a read of
 * memory the call writes would see old or new values by timing. */
static tm_status
sweep_spans(const tm_role *roles, const tm_span *s, const tm_span_key *order, int64_t n)
{
    const tm_span *any = &s[order[0].at];
    const tm_span *written = any->written ? any : NULL;
    for (int64_t k = 1; k < n; k++) {
        const tm_span *x = &s[order[k].at];
        if (x->written && x->lo < any->hi) {
            return report_overlap(roles, x, any);
        }
        if (!x->written && written != NULL && x->lo < written->hi) {
            return report_overlap(roles, x, written);
        }
        any = x->hi > any->hi ? x : any;
        if (x->written && (written == NULL || x->hi > written->hi)) {
            written = x;
        }
    }
    return TM_OK;
}

/* Tensor i of r as its bytes [*lo, *hi) (imported tensors are dense); 0 when it has none
 * (a lone tensor not given, or no elements). */
static int
tensor_bytes(const tm_role *r, int32_t i, uintptr_t *lo, uintptr_t *hi)
{
    const tm_tensor *t = &r->list.tensors[i];
    *lo = (uintptr_t)t->data;
    *hi = *lo + (size_t)t->numel * tm_dtype_size(t->dtype);
    return present(r, i) && *lo < *hi;
}

static tm_status
check_disjoint(const tm_role *roles, int n)
{
    int64_t count = 0, writers = 0;
    for (int k = 0; k < n; k++) {
        count += roles[k].list.count;
        writers += (roles[k].flags & (TM_ROLE_WRITTEN | TM_ROLE_STORED)) ? 1 : 0;
    }
    if (count < 2 || writers == 0) {
        return TM_OK;
    }
    /* the spans, their sort keys and the sort's scratch, in one block */
    tm_span *s = malloc((size_t)count * (sizeof *s + 2 * sizeof(tm_span_key)));
    TM_CHECK(s != NULL, TM_ERR_INTERNAL, "out of host memory (%lld tensors)", (long long)count);
    tm_span_key *keys = (tm_span_key *)(s + count);
    int64_t m = 0;
    for (int k = 0; k < n; k++) {
        const tm_role *r = &roles[k];
        for (int32_t i = 0; i < r->list.count; i++) {
            uintptr_t lo, hi;
            if (tensor_bytes(r, i, &lo, &hi)) {
                keys[m] = (tm_span_key){lo, m};
                s[m++] = (tm_span){lo, hi, k, i,
                                   (r->flags & (TM_ROLE_WRITTEN | TM_ROLE_STORED)) != 0};
            }
        }
    }
    tm_status st = m > 1 ? sweep_spans(roles, s, sort_spans(keys, keys + count, m), m) : TM_OK;
    free(s);
    return st;
}

tm_status
tm_roles_check(const tm_role *roles, int n, tm_device_ref *ref)
{
    TM_TRY(check_usable(roles, n, ref));
    if (ref->tensor != NULL) {
        TM_TRY(check_devices(roles, n, ref));
    }
    TM_TRY(check_match(roles, n, 0));
    TM_TRY(check_match(roles, n, 1));
    TM_TRY(check_writable(roles, n));
    return check_disjoint(roles, n);
}

tm_status
tm_check_scratch(const tm_exec *exec, size_t need, const tm_role *roles, int n)
{
    TM_CHECK(exec->scratch_bytes >= need, TM_ERR_VALUE, "scratch: %zu bytes given, %zu needed",
             exec->scratch_bytes, need);
    TM_CHECK(need == 0 || exec->scratch != NULL, TM_ERR_VALUE, "scratch: NULL, %zu bytes needed",
             need);
    TM_CHECK(need == 0 || (uintptr_t)exec->scratch % sizeof(double) == 0, TM_ERR_VALUE,
             "scratch: address not aligned to %zu bytes", sizeof(double));
    /* the call writes the scratch it uses: like a written tensor, it shares memory with none */
    const uintptr_t lo = (uintptr_t)exec->scratch, hi = lo + need;
    for (int k = 0; need > 0 && k < n; k++) {
        const tm_role *r = &roles[k];
        for (int32_t i = 0; i < r->list.count; i++) {
            uintptr_t a, b;
            if (tensor_bytes(r, i, &a, &b) && a < hi && lo < b) {
                char label[TM_LABEL_TEXT];
                return tm_set_error(TM_ERR_VALUE, __FILE__, __LINE__,
                                    "scratch: shares memory with %s",
                                    tm_label(r->list.name, index_of(r, i), label));
            }
        }
    }
    return TM_OK;
}
