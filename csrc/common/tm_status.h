/*
 * tm_status.h -- recording failures: a thread-local message buffer behind tm_last_error() (with a
 * "file:line: " prefix only under TITANMAC_DEBUG=1), and the TM_CHECK macro every validation goes
 * through (after TransformerEngine's NVTE_CHECK, minus the throw: C code returns the status).
 */
#ifndef TM_STATUS_H
#define TM_STATUS_H

#include "titanmac.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Record a printf-style message for tm_last_error() and return status. */
tm_status tm_set_error(tm_status status, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* Forget the last message (called at the start of every public function). */
void tm_clear_error(void);

#ifdef __cplusplus
}
#endif

/* if (!cond) record the message and return status from the enclosing function. */
#define TM_CHECK(cond, status, ...)                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            return tm_set_error((status), __FILE__, __LINE__, __VA_ARGS__);                        \
        }                                                                                          \
    } while (0)

/* Propagate a non-OK status from a call whose message is already recorded. */
#define TM_TRY(expr)                                                                               \
    do {                                                                                           \
        tm_status tm_try_status_ = (expr);                                                         \
        if (tm_try_status_ != TM_OK) {                                                             \
            return tm_try_status_;                                                                 \
        }                                                                                          \
    } while (0)

#endif /* TM_STATUS_H */
