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

#define NARGS 14

/* step(base, size, rank, s, desc, src, nbytes, slot, spin_ns, phase, stride, count, dtype,
 *      op) -> int
 *
 * Copy nbytes from src into slot, publish step s with the 48-byte descriptor desc (bytes),
 * spin up to spin_ns for every peer. Returns:
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
    int64_t v[NARGS];
    for (int i = 0; i < NARGS; i++) {
        if (i == 4) continue;
        v[i] = (int64_t)PyLong_AsLongLong(args[i]);
    }
    if (PyErr_Occurred()) return NULL;
    if (!PyBytes_Check(args[4]) || PyBytes_GET_SIZE(args[4]) != DESC_LEN * 8) {
        PyErr_SetString(PyExc_TypeError, "step(): desc must be 48 bytes");
        return NULL;
    }
    const int64_t *desc = (const int64_t *)PyBytes_AS_STRING(args[4]);
    char *base = (char *)(intptr_t)v[0];
    int64_t size = v[1], rank = v[2], s = v[3];
    int64_t result;
    Py_BEGIN_ALLOW_THREADS
    smp_publish(base, rank, s, desc, (const char *)(intptr_t)v[5], v[6], (char *)(intptr_t)v[7]);
    result = smp_await(base, size, rank, s, v[8], 0);
    if (result < 0) {
        if (smp_mismatch(base, size, s) >= 0)
            result = -2;
        else if (v[13] >= 0 && smp_reduce((char *)(intptr_t)v[5], (const char *)(intptr_t)v[9],
                                          v[10], size, v[11], v[12], v[13]) != 0)
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
