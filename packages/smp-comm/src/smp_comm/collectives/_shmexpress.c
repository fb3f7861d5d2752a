/* The express path of a small collective: one call from Python for the whole step.
 *
 * _shmstep.c's functions, loaded with ctypes, cost about 0.35 us per argument per call
 * (measured: a 7-argument call 2.5 us), so a one-step all-reduce through them spends more
 * in ctypes than MPICH spends on the whole collective. This file wraps the same protocol
 * (it includes _shmstep.c: one definition of the segment's layout and step) as a CPython
 * extension function taking its arguments by METH_FASTCALL, with the GIL released while it
 * copies, publishes, waits and reduces. Every decision that is not hot stays in Python
 * (smp_comm.collectives.express): what to do when a peer is late, errors, timeouts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_shmstep.c"

#define NARGS 8
#define CTX_WORDS 9 /* base, size, rank, spin_ns, stride, slot[2], phase[2] */

/* step(ctx, s, desc, src, nbytes, count, dtype, op) -> int
 *
 * ctx: the segment's constants, 9 int64 packed in bytes (made once per segment: base
 * address, size, rank, spin_ns, slot stride, this rank's slot and the phase area of each
 * step parity); each Python-side load of them cost more than the argument itself.
 * Copy nbytes from src into this rank's slot of step s's parity, publish step s with the
 * 48-byte descriptor desc (bytes), spin up to spin_ns for every peer. Returns:
 *   r >= 0  rank r had not published after the spin (nothing else done: the caller waits
 *           and finishes the collective itself);
 *   -1      every rank took the step and their descriptors match; if op >= 0, src now holds
 *           the reduction (rank order) of the count elements in every rank's slot;
 *   -2      the ranks described the step differently (nothing reduced);
 *   -3      (dtype, op) is not reduced here (the caller checked; a bug if seen). */
static PyObject *express_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != NARGS) {
        PyErr_Format(PyExc_TypeError, "step() takes %d arguments (%zd given)", NARGS, nargs);
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) != CTX_WORDS * 8) {
        PyErr_SetString(PyExc_TypeError, "step(): ctx must be 72 bytes");
        return NULL;
    }
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) != DESC_LEN * 8) {
        PyErr_SetString(PyExc_TypeError, "step(): desc must be 48 bytes");
        return NULL;
    }
    int64_t v[NARGS];
    for (int i = 1; i < NARGS; i++) {
        if (i == 2) continue;
        v[i] = (int64_t)PyLong_AsLongLong(args[i]);
    }
    if (PyErr_Occurred()) return NULL;
    int64_t ctx[CTX_WORDS];
    memcpy(ctx, PyBytes_AS_STRING(args[0]), sizeof ctx);
    const int64_t *desc = (const int64_t *)PyBytes_AS_STRING(args[2]);
    char *base = (char *)(intptr_t)ctx[0];
    int64_t size = ctx[1], rank = ctx[2], spin_ns = ctx[3], stride = ctx[4];
    int64_t s = v[1], parity = s & 1;
    char *src = (char *)(intptr_t)v[3];
    int64_t result;
    Py_BEGIN_ALLOW_THREADS
    smp_publish(base, rank, s, desc, src, v[4], (char *)(intptr_t)ctx[5 + parity]);
    result = smp_await(base, size, rank, s, spin_ns, 0);
    if (result < 0) {
        if (smp_mismatch(base, size, s) >= 0)
            result = -2;
        else if (v[7] >= 0 && smp_reduce(src, (const char *)(intptr_t)ctx[7 + parity], stride,
                                         size, v[5], v[6], v[7]) != 0)
            result = -3;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)result);
}

static PyMethodDef methods[] = {
    {"step", (PyCFunction)(void (*)(void))express_step, METH_FASTCALL,
     "One small collective's step: copy, publish, spin, check, reduce."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shmexpress", "The express path of smp's small collectives.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shmexpress(void) { return PyModule_Create(&module); }
