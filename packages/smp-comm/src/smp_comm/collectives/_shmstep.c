/* The hot loop of a small shared-memory collective (see shm.py for the segment's layout and
 * its step protocol). Loaded with ctypes by smp_comm.collectives.fast; no Python API.
 *
 * A small collective is one step: copy this rank's bytes into its slot, publish the step,
 * wait until every peer published it, check that all described the same collective, reduce.
 * Done from Python, each of those is several interpreter-level calls (~80 us on a busy
 * 2-core box); here each is one call. Every decision that is not hot (what failed, whether
 * a peer died, timeouts, error messages) stays in Python: smp_await returns to it whenever
 * it would sleep.
 */
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LINE_WORDS 16 /* 128-byte control lines */
#define SEQ 0
#define DESC 4
#define DESC_LEN 6

static int64_t *line(char *base, int64_t r) { return (int64_t *)(base + r * LINE_WORDS * 8); }

static void futex_wake(int64_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Copy nbytes from src into slot, describe the collective (desc: DESC_LEN words, or NULL)
 * and publish step s. */
void smp_publish(char *base, int64_t rank, int64_t s, const int64_t *desc, const char *src,
                 int64_t nbytes, char *slot) {
    int64_t *mine = line(base, rank);
    if (nbytes > 0) memcpy(slot, src, (size_t)nbytes);
    if (desc != NULL) memcpy(mine + DESC + (s % 2) * DESC_LEN, desc, DESC_LEN * 8);
    __atomic_store_n(mine + SEQ, s, __ATOMIC_RELEASE);
    futex_wake(mine + SEQ);
}

/* Wait until every rank published step s: spin for about spin_ns (yielding the core when
 * others want it), then sleep on the first late rank's word for up to sleep_ns (not at all
 * if sleep_ns is 0). Returns -1 when all have published, else the rank still awaited (the
 * caller checks for failures and timeouts, then calls again). The GIL is released (ctypes). */
int64_t smp_await(char *base, int64_t size, int64_t rank, int64_t s, int64_t spin_ns,
                  int64_t sleep_ns) {
    int64_t start = 0;
    for (int64_t r = 0; r < size; r++) {
        if (r == rank) continue;
        int64_t *seq = line(base, r) + SEQ;
        int64_t seen = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
        for (int i = 0; seen < s && i < 256; i++) {
            __builtin_ia32_pause();
            seen = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
        }
        if (seen >= s) continue;
        if (start == 0) start = now_ns();
        while (seen < s && now_ns() - start < spin_ns) {
            sched_yield();
            seen = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
        }
        if (seen >= s) continue;
        if (sleep_ns <= 0) return r;
        struct timespec ts = {sleep_ns / 1000000000, sleep_ns % 1000000000};
        syscall(SYS_futex, (uint32_t *)seq, FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
        if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) < s) return r;
    }
    return -1;
}

/* The first rank whose description of step s differs from rank 0's, or -1. */
int64_t smp_mismatch(char *base, int64_t size, int64_t s) {
    int64_t *first = line(base, 0) + DESC + (s % 2) * DESC_LEN;
    for (int64_t r = 1; r < size; r++)
        if (memcmp(first, line(base, r) + DESC + (s % 2) * DESC_LEN, DESC_LEN * 8)) return r;
    return -1;
}

/* smp_publish, then smp_await: -1 when every rank has taken the step, else the rank still
 * awaited (the caller goes on waiting with smp_await). */
int64_t smp_step(char *base, int64_t size, int64_t rank, int64_t s, const int64_t *desc,
                 const char *src, int64_t nbytes, char *dst, int64_t spin_ns, int64_t sleep_ns) {
    smp_publish(base, rank, s, desc, src, nbytes, dst);
    int64_t r = smp_await(base, size, rank, s, spin_ns, sleep_ns);
    return r;
}

/* o[i] = o[i] (op) b[i] for i < m: the one binary step of every reduction here, so all of
 * them round alike (the callers fix the rank order); an unknown op returns -1 from the
 * calling function. AVERAGE ends an avg: o[i] / n. */
#define FOLD(o, b, m)                                                                  \
    switch (op) {                                                                      \
    case 0: case 1: for (int64_t i = 0; i < (m); i++) (o)[i] = (o)[i] + (b)[i]; break; \
    case 2: for (int64_t i = 0; i < (m); i++) (o)[i] = (o)[i] * (b)[i]; break;         \
    case 3: for (int64_t i = 0; i < (m); i++) (o)[i] = (b)[i] < (o)[i] ? (b)[i] : (o)[i]; break; \
    case 4: for (int64_t i = 0; i < (m); i++) (o)[i] = (b)[i] > (o)[i] ? (b)[i] : (o)[i]; break; \
    default: return -1;                                                                \
    }
#define AVERAGE(T, o, m)                                                               \
    if (op == 1) for (int64_t i = 0; i < (m); i++) (o)[i] = (o)[i] / (T)n;

/* out[i] = src_0[i] (op) src_1[i] (op) ... left to right, src_r = phase + r * stride bytes;
 * avg divides by n at the end. Returns 0, or -1 for a (dtype, op) not handled here. */
#define REDUCE(T)                                                                      \
    {                                                                                  \
        T *o = (T *)out;                                                               \
        const T *a = (const T *)phase;                                                 \
        for (int64_t i = 0; i < count; i++) o[i] = a[i];                               \
        for (int64_t r = 1; r < n; r++) {                                              \
            const T *b = (const T *)(phase + r * stride);                              \
            FOLD(o, b, count)                                                          \
        }                                                                              \
        AVERAGE(T, o, count)                                                           \
        return 0;                                                                      \
    }

int smp_reduce(char *out, const char *phase, int64_t stride, int64_t n, int64_t count,
               int64_t dtype, int64_t op) {
    switch (dtype) {
    case 0: REDUCE(float)
    case 1: REDUCE(double)
    case 2: if (op == 1) return -1; REDUCE(int32_t)
    case 3: if (op == 1) return -1; REDUCE(int64_t)
    default: return -1;
    }
}

/* The large all-reduce's fused reduction (see LocalCollectives.all_reduce): this rank's part
 * of a chunk, v[i] = src_0[i] (op) src_1[i] (op) ... in rank order, where src_rank = own
 * (this rank's own tensor: its values never went through the segment) and src_r = phase +
 * r * stride bytes for every peer r; avg divides by n at the end. One pass writes v to both
 * out_a (may be own: each block is read before it is written) and out_b (this rank's slot
 * of the next phase, where the peers copy it from). Blocks of SMP_BLOCK elements stay in
 * L1 between the ranks' terms, so memory sees each source read once and each output written
 * once, against n + 2 passes for the same sum from separate binary kernels. Returns 0, or
 * -1 for a (dtype, op) not handled here (like smp_reduce). Same operations, same order,
 * same rounding as smp_reduce and torch's kernels: only the traversal differs. */
#define SMP_BLOCK 1024
#if defined(__GNUC__) && !defined(__clang__)
#define SMP_VECTORIZE __attribute__((optimize("O3")))
#else
#define SMP_VECTORIZE
#endif

#define REDUCE2(T)                                                                     \
    {                                                                                  \
        T acc[SMP_BLOCK];                                                              \
        for (int64_t lo = 0; lo < count; lo += SMP_BLOCK) {                            \
            int64_t m = count - lo < SMP_BLOCK ? count - lo : SMP_BLOCK;               \
            for (int64_t r = 0; r < n; r++) {                                          \
                const T *restrict b = r == rank ? (const T *)own + lo                  \
                                                : (const T *)(phase + r * stride) + lo; \
                if (r == 0) { for (int64_t i = 0; i < m; i++) acc[i] = b[i]; continue; } \
                FOLD(acc, b, m)                                                        \
            }                                                                          \
            AVERAGE(T, acc, m)                                                         \
            T *restrict oa = (T *)out_a + lo;                                          \
            T *restrict ob = (T *)out_b + lo;                                          \
            for (int64_t i = 0; i < m; i++) { oa[i] = acc[i]; ob[i] = acc[i]; }        \
        }                                                                              \
        return 0;                                                                      \
    }

SMP_VECTORIZE
int smp_reduce2(char *out_a, char *out_b, const char *own, const char *phase, int64_t stride,
                int64_t n, int64_t rank, int64_t count, int64_t dtype, int64_t op) {
    if (op < 0 || op > 4) return -1;
    switch (dtype) {
    case 0: REDUCE2(float)
    case 1: REDUCE2(double)
    case 2: if (op == 1) return -1; REDUCE2(int32_t)
    case 3: if (op == 1) return -1; REDUCE2(int64_t)
    default: return -1;
    }
}

/* memcpy for the large all-reduce's copy out of the segment, into memory the caller does not
 * read back soon: on x86-64, streaming stores skip reading each destination line before
 * overwriting it (a third of the traffic of a plain copy into a tensor that is not cached).
 * The fence makes the bytes visible before a later publish. */
#if defined(__x86_64__)
#include <emmintrin.h>
void smp_copy_out(char *dst, const char *src, int64_t nbytes) {
    int64_t i = 0;
    for (; i < nbytes && ((uintptr_t)(dst + i) & 15); i++) dst[i] = src[i];
    for (; i + 64 <= nbytes; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i < nbytes; i++) dst[i] = src[i];
    _mm_sfence();
}
#else
void smp_copy_out(char *dst, const char *src, int64_t nbytes) {
    if (nbytes > 0) memcpy(dst, src, (size_t)nbytes);
}
#endif
