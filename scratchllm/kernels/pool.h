/* The kernels' thread pool in C. Included by scratchllm/kernels/pool.pyx, whose
   `cdef extern from "pool.h"` declares what Cython calls. */
#ifndef SCRATCHLLM_POOL_H
#define SCRATCHLLM_POOL_H

#include <stdint.h>
/* The claim word packs (job generation << 32 | tasks left); a claim is a compare-and-swap that
   decrements `left`, and fails if a new job replaced the word. Task index = left - 1 (tasks run
   last to first). A successful claim means the job is not finished, so its fn/ctx are still
   the ones published: the caller publishes the next job only after `done` reaches n.
   Idle helpers spin briefly (the next matmul is usually microseconds away), then sleep on a
   futex on `gen`. Nothing here ever waits for a lock, so a fork()ed child (which has no
   helpers) simply does every task itself. */
#include <pthread.h>
#include <stdatomic.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sched.h>
#define PG_MAX_HELPERS 63

typedef void (*pg_task_fn)(void *ctx, long task);

static struct {
    _Atomic uint64_t claim;
    _Atomic uint32_t gen;
    _Atomic long done;
    _Atomic int sleepers;
    _Atomic int active;    /* helpers 0..active-1 take part in jobs */
    pg_task_fn fn;
    void *ctx;
    int started;           /* helpers created so far (under pg_pool_lock) */
    uint32_t last_gen;
} pg_pool;

static pthread_mutex_t pg_pool_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void pg_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void pg_run_claims(uint32_t g) {
    for (;;) {
        uint64_t c = atomic_load(&pg_pool.claim);
        if ((uint32_t)(c >> 32) != g || (uint32_t)c == 0)
            return;
        if (!atomic_compare_exchange_weak(&pg_pool.claim, &c, c - 1))
            continue;
        pg_pool.fn(pg_pool.ctx, (long)(uint32_t)c - 1);
        atomic_fetch_add(&pg_pool.done, 1);
    }
}

static void *pg_helper(void *arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pg_pool.gen);
    for (;;) {
        uint32_t g = atomic_load(&pg_pool.gen);
        if (g != seen) {
            seen = g;
            if (id < atomic_load(&pg_pool.active))
                pg_run_claims(g);
            continue;
        }
        int spin;
        for (spin = 0; spin < 20000 && atomic_load(&pg_pool.gen) == seen; spin++)
            pg_pause();
        if (atomic_load(&pg_pool.gen) != seen)
            continue;
        atomic_fetch_add(&pg_pool.sleepers, 1);
        syscall(SYS_futex, &pg_pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&pg_pool.sleepers, 1);
    }
    return NULL;
}

/* Run fn(ctx, 0..n-1) on the caller and up to `threads - 1` helpers; returns when all are done. */
static void pg_pool_run(pg_task_fn fn, void *ctx, long n, int threads) {
    if (n <= 0)
        return;
    int helpers = threads - 1 < PG_MAX_HELPERS ? threads - 1 : PG_MAX_HELPERS;
    if (helpers > (int)n - 1)
        helpers = (int)n - 1;
    /* One job at a time owns the helpers. A second thread calling meanwhile (two engines in
       one process) computes alone rather than wait; trylock never blocks, so not even a
       fork()ed child that inherited the lock locked can hang here. */
    if (helpers <= 0 || pthread_mutex_trylock(&pg_pool_lock) != 0) {
        for (long i = 0; i < n; i++)
            fn(ctx, i);
        return;
    }
    while (pg_pool.started < helpers) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, pg_helper, (void *)(intptr_t)pg_pool.started);
        pthread_attr_destroy(&attr);
        if (failed)
            break;  /* fewer helpers; the caller does the rest */
        pg_pool.started++;
    }
    pg_pool.fn = fn;
    pg_pool.ctx = ctx;
    atomic_store(&pg_pool.done, 0);
    atomic_store(&pg_pool.active, helpers);
    uint32_t g = ++pg_pool.last_gen;
    atomic_store(&pg_pool.claim, ((uint64_t)g << 32) | (uint64_t)n);
    atomic_store(&pg_pool.gen, g);
    if (atomic_load(&pg_pool.sleepers) > 0)
        syscall(SYS_futex, &pg_pool.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    pg_run_claims(g);
    for (long spin = 0; atomic_load(&pg_pool.done) < n; spin++) {
        if (spin < 4096)
            pg_pause();
        else
            sched_yield();  /* a helper holding a task was descheduled: let it run */
    }
    pthread_mutex_unlock(&pg_pool_lock);
}

#endif
