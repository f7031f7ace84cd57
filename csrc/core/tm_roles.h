/*
 * tm_roles.h -- the checks every op runs on its tensors, described once as a table of roles
 * (params, grads, lr, ...) instead of being written out per op: each role says whether it is a
 * list or a lone tensor, whether it is written, and whether its numel and dtype must match the
 * lead list (roles[0]) index by index.
 */
#ifndef TM_ROLES_H
#define TM_ROLES_H

#include "../common/tm_tensor.h"
#include "titanmac.h"

enum {
    TM_ROLE_LONE = 1u,    /* one tensor, named without an index; skipped while not given */
    TM_ROLE_WRITTEN = 2u, /* must be writable and share memory with no other tensor of the call */
    TM_ROLE_MATCH = 4u,   /* numel and dtype equal to the lead list's at the same index */
    TM_ROLE_MATCH_NUMEL = 8u, /* numel only (float32 state of params of any dtype) */
    TM_ROLE_STORED = 16u, /* written by this call (no other tensor may share its memory), its
                             writability checked by the op with its own message */
    TM_ROLE_ANY_ORDER = 32u, /* may be dense in another order than C's (element-wise roles); the
                                others must be C-contiguous */
    TM_ROLE_PAIRED = 64u /* element k pairs with element k of the lead's tensor at the same
                            index: the lead's shape where both are given (tm_same_shape), any
                            order (implies TM_ROLE_ANY_ORDER), but the lead's (tm_same_order) */
};

/* The tensor whose device a call runs on, and its name for messages ("params[0]"). */
typedef struct {
    const tm_tensor *tensor;
    char label[TM_LABEL_TEXT];
} tm_device_ref;

typedef struct {
    tm_tensor_list list; /* a lone tensor is a list of one */
    unsigned flags;
} tm_role;

/* A list role; the list's own name wins over default_name. list may be NULL (an empty list). */
tm_role tm_list_role(const tm_tensor_list *list, const char *default_name, unsigned flags);

/* A lone-tensor role (t must not be NULL). */
tm_role tm_lone_role(const tm_tensor *t, const char *name, unsigned flags);

/* TM_ERR_INTERNAL for a list with a negative count or no array. */
tm_status tm_roles_structure(const tm_role *roles, int n);

/* Per tensor, then across tensors: usable (C-contiguous unless TM_ROLE_ANY_ORDER or
 * TM_ROLE_PAIRED), one device (sets *ref), numel (and shape and memory order where
 * TM_ROLE_PAIRED) and dtype against the lead list, writable, and no tensor the call writes
 * sharing memory with any other tensor of the call (other lists, other indices, lone inputs;
 * tensors only read may share). */
tm_status tm_roles_check(const tm_role *roles, int n, tm_device_ref *ref);

/* exec->scratch holds at least need bytes, 8-byte aligned (CPU partials are doubles), sharing
 * memory with no tensor of roles[0, n) (the call writes it). */
tm_status tm_check_scratch(const tm_exec *exec, size_t need, const tm_role *roles, int n);

#endif /* TM_ROLES_H */
