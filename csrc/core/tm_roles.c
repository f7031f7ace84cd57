/*
 * tm_roles.c -- the tensor checks shared by every op (see tm_roles.h), in the order the messages
 * are specified: each check runs over all tensors of the call before the next one starts, so a
 * call with several faults always reports the same one.
 */
#include "tm_roles.h"

#include <stdint.h>

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

/* Two lists at one index on the same memory would be updated twice or read after an update. */
static tm_status
check_alias_pair(const tm_role *a, const tm_role *b)
{
    unsigned either = a->flags | b->flags;
    if ((either & TM_ROLE_LONE) || !(either & TM_ROLE_WRITTEN)) {
        return TM_OK;
    }
    int32_t count = a->list.count < b->list.count ? a->list.count : b->list.count;
    for (int32_t i = 0; i < count; i++) {
        const tm_tensor *x = &a->list.tensors[i];
        const tm_tensor *y = &b->list.tensors[i];
        TM_CHECK(x->numel == 0 || y->numel == 0 || x->data != y->data, TM_ERR_VALUE,
                 "%s[%d]: shares memory with %s[%d]", b->list.name, (int)i, a->list.name, (int)i);
    }
    return TM_OK;
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
    for (int k = 0; k < n; k++) {
        for (int j = k + 1; j < n; j++) {
            TM_TRY(check_alias_pair(&roles[k], &roles[j]));
        }
    }
    return TM_OK;
}

tm_status
tm_check_scratch(const tm_exec *exec, size_t need)
{
    TM_CHECK(exec->scratch_bytes >= need, TM_ERR_VALUE, "scratch: %zu bytes given, %zu needed",
             exec->scratch_bytes, need);
    TM_CHECK(need == 0 || exec->scratch != NULL, TM_ERR_VALUE, "scratch: NULL, %zu bytes needed",
             need);
    TM_CHECK(need == 0 || (uintptr_t)exec->scratch % sizeof(double) == 0, TM_ERR_VALUE,
             "scratch: address not aligned to %zu bytes", sizeof(double));
    return TM_OK;
}
