/*
 * tm_status.c -- the message behind tm_last_error(): one buffer per thread (C11 _Thread_local),
 * so concurrent calls from different Python threads (the bindings release the GIL) never see
 * each other's failures.
 *
 * Users see the plain message ("grads[3]: data is NULL"); the "file:line: " prefix of
 * TransformerEngine's NVTE_CHECK is added only when TITANMAC_DEBUG=1, because a source location
 * helps whoever debugs titanmac_c but is noise in a user's ValueError.
 */
#include "tm_status.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Long enough for two labels, two devices or dtypes and a few numbers; longer text is cut. */
#define TM_ERROR_CAPACITY 512

static _Thread_local char tm_error_text[TM_ERROR_CAPACITY];

/* -1 until the environment has been read; then 0 or 1. Atomic because the first failing calls
 * may come from several threads at once; they all compute the same value. */
static atomic_int tm_debug_state = -1;

static int
debug_enabled(void)
{
    int state = atomic_load_explicit(&tm_debug_state, memory_order_relaxed);
    if (state < 0) {
        const char *env = getenv("TITANMAC_DEBUG");
        state = (env != NULL && strcmp(env, "1") == 0) ? 1 : 0;
        atomic_store_explicit(&tm_debug_state, state, memory_order_relaxed);
    }
    return state;
}

/* Keep the path short: the basename is enough to find the line. */
static const char *
basename_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash != NULL ? slash + 1 : path;
}

tm_status
tm_set_error(tm_status status, const char *file, int line, const char *fmt, ...)
{
    size_t used = 0;
    if (debug_enabled() && file != NULL) {
        int n = snprintf(tm_error_text, sizeof tm_error_text, "%s:%d: ", basename_of(file), line);
        used = (n > 0 && (size_t)n < sizeof tm_error_text) ? (size_t)n : 0;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tm_error_text + used, sizeof tm_error_text - used, fmt, ap);
    va_end(ap);
    return status;
}

void
tm_clear_error(void)
{
    tm_error_text[0] = '\0';
}

const char *
tm_last_error(void)
{
    return tm_error_text;
}
