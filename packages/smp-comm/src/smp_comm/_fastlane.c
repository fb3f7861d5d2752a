/* The compiled small-message fast path of smp-comm (see fastpath.py for the frame format).
 *
 * Optional: smp_comm.compiled builds this file on first use against the MPI library that
 * mpi4py has loaded, and falls back to the pure-Python fast path if it cannot. It does the
 * byte-level work of one fast-path message in one call each way, without the Python
 * interpreter's per-step costs: send (a tensor's checks, header and element copy,
 * MPI_Isend + MPI_Test) and take (probe loop with the GIL released, MPI_Mrecv into a new
 * bytearray, the tensor rebuilt over it). encode and decode are exported on their own for
 * the tests and the benchmark. Python keeps every decision: matching, ordering, handles.
 *
 * It must produce exactly the frames fastpath.encode/frame do: the tests compare them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include SMP_MPI_HEADER

#define ALIGN 16
#define MAX_NDIM 32
#define KIND_NUMPY 0
#define KIND_TORCH 1

/* Set once by configure(): the types and dtype tables fastpath.py uses. */
static PyObject *tensor_type, *ndarray_type, *strided, *t_codes, *np_codes;
static Py_ssize_t t_itemsize[64], np_itemsize[64];
static long t_complex_from = 1 << 30;

/* Set once by configure_decode(): how fastpath.decode builds a 1-d tensor, and itself. */
static PyObject *frombuffer, *t_dtypes, *py_decode, *kw_dtype_offset;
static char t_grad_ok[64]; /* codes whose tensors may require grad (floating, complex) */

static PyObject *s_dtype, *s_layout, *s_is_cpu, *s_shape, *s_is_neg, *s_is_conj,
    *s_requires_grad, *s_requires_grad_, *s_is_contiguous, *s_contiguous, *s_data_ptr, *s_tobytes;

static PyObject *mpi_error(int rc, const char *what) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
    text[len] = '\0';
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (MPI error %d)", what, text, rc);
    return NULL;
}

static int as_comm(PyObject *o, MPI_Comm *out) {
    /* mpi4py gives handles as unsigned 64-bit integers (an int handle sign-extended) */
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *out = (MPI_Comm)(intptr_t)v;
    return 1;
}

static int fill_itemsizes(PyObject *codes, Py_ssize_t *table) {
    /* codes: {dtype: code}; item sizes from each dtype's `itemsize` attribute. */
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(codes, &pos, &key, &value)) {
        long code = PyLong_AsLong(value);
        if (code < 0 || code >= 64) {
            PyErr_SetString(PyExc_ValueError, "dtype code out of range");
            return 0;
        }
        PyObject *size = PyObject_GetAttrString(key, "itemsize");
        if (!size) return 0;
        table[code] = PyLong_AsSsize_t(size);
        Py_DECREF(size);
        if (table[code] < 0) return 0;
    }
    return 1;
}

/* configure(Tensor, strided, torch_codes, complex_from, ndarray, numpy_codes) */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *tt, *st, *tc, *nt, *nc;
    long cf;
    if (!PyArg_ParseTuple(args, "OOO!lOO!", &tt, &st, &PyDict_Type, &tc, &cf, &nt, &PyDict_Type, &nc))
        return NULL;
    if (!fill_itemsizes(tc, t_itemsize) || !fill_itemsizes(nc, np_itemsize)) return NULL;
    Py_XSETREF(tensor_type, Py_NewRef(tt));
    Py_XSETREF(strided, Py_NewRef(st));
    Py_XSETREF(t_codes, Py_NewRef(tc));
    Py_XSETREF(ndarray_type, Py_NewRef(nt));
    Py_XSETREF(np_codes, Py_NewRef(nc));
    t_complex_from = cf;
    Py_RETURN_NONE;
}

/* 1 true, 0 false, -1 error: the truth of obj.<name> (attribute, or method if call). */
static int flag(PyObject *obj, PyObject *name, int call) {
    PyObject *r = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (!r) return -1;
    int v = PyObject_IsTrue(r);
    Py_DECREF(r);
    return v;
}

static Py_ssize_t head_size(int ndim) {
    Py_ssize_t fixed = 12 + 8 * (Py_ssize_t)ndim;
    return fixed + ((ALIGN - fixed % ALIGN) % ALIGN);
}

/* A frame with seq 0 and room for nbytes of elements; the caller copies them in. */
static PyObject *new_frame(int kind, long code, int grad, PyObject *shape, Py_ssize_t nbytes,
                           char **data) {
    int ndim = (int)PyTuple_GET_SIZE(shape);
    Py_ssize_t head = head_size(ndim);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, head + nbytes);
    if (!frame) return NULL;
    char *p = PyBytes_AS_STRING(frame);
    memset(p, 0, (size_t)head);
    p[8] = (char)kind;
    p[9] = (char)code;
    p[10] = (char)grad;
    p[11] = (char)ndim;
    for (int i = 0; i < ndim; i++) {
        int64_t d = (int64_t)PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (d == -1 && PyErr_Occurred()) {
            Py_DECREF(frame);
            return NULL;
        }
        memcpy(p + 12 + 8 * i, &d, 8); /* little-endian hosts only: checked at build */
    }
    *data = p + head;
    return frame;
}

/* Product of a shape tuple's entries times itemsize, saturating at PY_SSIZE_T_MAX (a later
 * zero still gives 0); -1 on error (exception set). */
static Py_ssize_t shape_bytes(PyObject *shape, Py_ssize_t itemsize) {
    Py_ssize_t n = itemsize;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (d < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative dimension");
            return -1;
        }
        n = (d != 0 && n > PY_SSIZE_T_MAX / d) ? PY_SSIZE_T_MAX : n * d;
    }
    return n;
}

/* 1 and *code set: obj.dtype has a code in `codes`; 0: it has none; -1: error. */
static int dtype_code(PyObject *obj, PyObject *codes, long *code) {
    PyObject *dtype = PyObject_GetAttr(obj, s_dtype);
    if (!dtype) return -1;
    PyObject *code_obj = PyDict_GetItemWithError(codes, dtype); /* borrowed */
    Py_DECREF(dtype);
    if (!code_obj) return PyErr_Occurred() ? -1 : 0;
    *code = PyLong_AsLong(code_obj);
    return 1;
}

static PyObject *encode_tensor(PyObject *obj, Py_ssize_t limit) {
    PyObject *frame = NULL, *shape = NULL, *contig = NULL, *ptr_obj = NULL;
    long code;
    int found = dtype_code(obj, t_codes, &code);
    if (found <= 0) return found < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *layout = PyObject_GetAttr(obj, s_layout);
    if (!layout) return NULL;
    int is_strided = layout == strided;
    Py_DECREF(layout);
    if (!is_strided) Py_RETURN_NONE;
    int v = flag(obj, s_is_cpu, 0);
    if (v <= 0) return v < 0 ? NULL : Py_NewRef(Py_None);
    shape = PyObject_GetAttr(obj, s_shape);
    if (!shape) return NULL;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_NDIM) goto none;
    Py_ssize_t nbytes = shape_bytes(shape, t_itemsize[code]);
    if (nbytes < 0) goto fail;
    if (nbytes > limit) goto none;
    if ((v = flag(obj, s_is_neg, 1)) != 0) goto none_or_fail;
    if (code >= t_complex_from && (v = flag(obj, s_is_conj, 1)) != 0) goto none_or_fail;
    int grad = flag(obj, s_requires_grad, 0);
    if (grad < 0) goto fail;
    if ((v = flag(obj, s_is_contiguous, 1)) < 0) goto fail;
    contig = v ? Py_NewRef(obj) : PyObject_CallMethodNoArgs(obj, s_contiguous);
    if (!contig) goto fail;
    char *data;
    frame = new_frame(KIND_TORCH, code, grad, shape, nbytes, &data);
    if (!frame) goto fail;
    if (nbytes) {
        ptr_obj = PyObject_CallMethodNoArgs(contig, s_data_ptr);
        if (!ptr_obj) goto fail;
        void *src = PyLong_AsVoidPtr(ptr_obj);
        if (!src && PyErr_Occurred()) goto fail;
        memcpy(data, src, (size_t)nbytes);
    }
    Py_XDECREF(ptr_obj);
    Py_DECREF(contig);
    Py_DECREF(shape);
    return frame;
none_or_fail:
    if (v < 0) goto fail;
none:
    Py_XDECREF(contig);
    Py_DECREF(shape);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(frame);
    Py_XDECREF(ptr_obj);
    Py_XDECREF(contig);
    Py_XDECREF(shape);
    return NULL;
}

static PyObject *encode_array(PyObject *obj, Py_ssize_t limit) {
    long code;
    int found = dtype_code(obj, np_codes, &code);
    if (found <= 0) return found < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *shape = PyObject_GetAttr(obj, s_shape);
    if (!shape) return NULL;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_NDIM) {
        Py_DECREF(shape);
        Py_RETURN_NONE;
    }
    Py_ssize_t nbytes = shape_bytes(shape, np_itemsize[code]);
    if (nbytes < 0 || nbytes > limit) {
        Py_DECREF(shape);
        if (nbytes < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *bytes = PyObject_CallMethodNoArgs(obj, s_tobytes); /* C order, any layout */
    if (!bytes) {
        Py_DECREF(shape);
        return NULL;
    }
    char *data;
    PyObject *frame = new_frame(KIND_NUMPY, code, 0, shape, nbytes, &data);
    if (frame) memcpy(data, PyBytes_AS_STRING(bytes), (size_t)nbytes);
    Py_DECREF(bytes);
    Py_DECREF(shape);
    return frame;
}

/* encode(obj, limit) -> frame bytes (seq 0) or None: as fastpath.frame(fastpath.encode()). */
static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode(obj, limit)");
        return NULL;
    }
    PyObject *obj = args[0];
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if ((PyObject *)Py_TYPE(obj) == tensor_type) return encode_tensor(obj, limit);
    if ((PyObject *)Py_TYPE(obj) == ndarray_type) return encode_array(obj, limit);
    Py_RETURN_NONE;
}

static PyObject *post_frame(MPI_Comm comm, PyObject *frame, int64_t seq, int dest, int tag) {
    char *p = PyBytes_AS_STRING(frame);
    memcpy(p, &seq, 8);
    MPI_Request req;
    int rc = MPI_Isend(p, (int)PyBytes_GET_SIZE(frame), MPI_BYTE, dest, tag, comm, &req);
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Isend");
    int done = 0;
    rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
        Py_INCREF(frame); /* MPI may still read it: leaked rather than freed under it */
        return mpi_error(rc, "MPI_Test");
    }
    if (done) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)(intptr_t)req);
}

/* send(comm, obj, limit, seq, dest, tag): encode and post in one call. None if obj does
 * not qualify; else its payload bytes if the frame has left, or (request, frame, payload
 * bytes) if it is still pending (the frame must live until the request completes). */
static PyObject *send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    MPI_Comm comm;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "send(comm, obj, limit, seq, dest, tag)");
        return NULL;
    }
    if (!as_comm(args[0], &comm)) return NULL;
    PyObject *frame = encode(self, args + 1, 2);
    if (!frame || frame == Py_None) return frame;
    int64_t seq = (int64_t)PyLong_AsLongLong(args[3]);
    int dest = (int)PyLong_AsLong(args[4]);
    int tag = (int)PyLong_AsLong(args[5]);
    PyObject *pending = PyErr_Occurred() ? NULL : post_frame(comm, frame, seq, dest, tag);
    if (!pending) {
        Py_DECREF(frame);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(frame);
    Py_ssize_t nbytes = PyBytes_GET_SIZE(frame) - head_size(p[11]);
    if (pending == Py_None) {
        Py_DECREF(pending);
        Py_DECREF(frame);
        return PyLong_FromSsize_t(nbytes);
    }
    return Py_BuildValue("NNn", pending, frame, nbytes);
}

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* take(comm, probes, rank) -> (source, tag, seq, object, payload bytes) of one frame, or
 * None if none arrived in `probes` probes (made with the GIL released). If the frame cannot
 * be decoded, object is the frame (a bytearray) and payload bytes -1: the caller decodes it
 * again to report the error. */
static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    MPI_Comm comm;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "take(comm, probes, rank)");
        return NULL;
    }
    if (!as_comm(args[0], &comm)) return NULL;
    long probes = PyLong_AsLong(args[1]);
    if (probes == -1 && PyErr_Occurred()) return NULL;
    int found = 0, rc = MPI_SUCCESS;
    MPI_Message msg;
    MPI_Status st;
    if (probes <= 1) {
        rc = MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &found, &msg, &st);
    } else {
        Py_BEGIN_ALLOW_THREADS
        for (long i = 0; i < probes && !found && rc == MPI_SUCCESS; i++)
            rc = MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &found, &msg, &st);
        Py_END_ALLOW_THREADS
    }
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Improbe");
    if (!found) Py_RETURN_NONE;
    int count = 0;
    rc = MPI_Get_count(&st, MPI_BYTE, &count);
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Get_count");
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, count);
    char dummy[16];
    /* The message is ours once probed: receive it even if the bytearray failed. */
    rc = MPI_Mrecv(buf ? PyByteArray_AS_STRING(buf) : dummy, buf ? count : 0, MPI_BYTE, &msg,
                   MPI_STATUS_IGNORE);
    if (!buf) return NULL;
    if (rc != MPI_SUCCESS) {
        Py_DECREF(buf);
        return mpi_error(rc, "MPI_Mrecv");
    }
    int64_t seq = -1;
    if (count >= 8) memcpy(&seq, PyByteArray_AS_STRING(buf), 8);
    PyObject *dargs[2] = {buf, args[2]};
    PyObject *decoded = decode(self, dargs, 2);
    if (decoded && PyTuple_Check(decoded) && PyTuple_GET_SIZE(decoded) == 2) {
        PyObject *out = Py_BuildValue("iiLOO", st.MPI_SOURCE, st.MPI_TAG, (long long)seq,
                                      PyTuple_GET_ITEM(decoded, 0), PyTuple_GET_ITEM(decoded, 1));
        Py_DECREF(decoded);
        Py_DECREF(buf);
        return out;
    }
    Py_XDECREF(decoded);
    PyErr_Clear();
    return Py_BuildValue("iiLNi", st.MPI_SOURCE, st.MPI_TAG, (long long)seq, buf, -1);
}

/* configure_decode(torch.frombuffer, dtypes, grad_codes, fastpath.decode) */
static PyObject *configure_decode(PyObject *self, PyObject *args) {
    PyObject *fb, *dts, *grads, *fallback;
    if (!PyArg_ParseTuple(args, "OO!O!O", &fb, &PyTuple_Type, &dts, &PyTuple_Type, &grads, &fallback))
        return NULL;
    memset(t_grad_ok, 0, sizeof t_grad_ok);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(grads); i++) {
        long code = PyLong_AsLong(PyTuple_GET_ITEM(grads, i));
        if (code < 0 || code >= 64) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dtype code out of range");
            return NULL;
        }
        t_grad_ok[code] = 1;
    }
    if (!kw_dtype_offset && !(kw_dtype_offset = Py_BuildValue("(ss)", "dtype", "offset")))
        return NULL;
    Py_XSETREF(frombuffer, fb == Py_None ? NULL : Py_NewRef(fb));
    Py_XSETREF(t_dtypes, Py_NewRef(dts));
    Py_XSETREF(py_decode, Py_NewRef(fallback));
    Py_RETURN_NONE;
}

/* decode(frame, rank) -> (object, payload bytes), as fastpath.decode: a non-empty 1-d tensor
 * here (the commonest small message), anything else by fastpath.decode itself. */
static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !py_decode) {
        PyErr_SetString(PyExc_TypeError, "decode(frame, rank) after configure_decode()");
        return NULL;
    }
    PyObject *buf = args[0];
    Py_ssize_t size = PyByteArray_CheckExact(buf) ? PyByteArray_GET_SIZE(buf) : 0;
    const Py_ssize_t head = head_size(1);
    if (size <= head || !frombuffer) return PyObject_Vectorcall(py_decode, args, 2, NULL);
    const unsigned char *p = (const unsigned char *)PyByteArray_AS_STRING(buf);
    int code = p[9];
    if (p[8] != KIND_TORCH || p[11] != 1 || code >= PyTuple_GET_SIZE(t_dtypes))
        return PyObject_Vectorcall(py_decode, args, 2, NULL);
    PyObject *offset = PyLong_FromSsize_t(head);
    if (!offset) return NULL;
    PyObject *call[3] = {buf, PyTuple_GET_ITEM(t_dtypes, code), offset};
    PyObject *t = PyObject_Vectorcall(frombuffer, call, 1, kw_dtype_offset);
    Py_DECREF(offset);
    if (!t) return NULL;
    if (p[10] && t_grad_ok[code]) {
        PyObject *r = PyObject_CallMethodOneArg(t, s_requires_grad_, Py_True);
        if (!r) {
            Py_DECREF(t);
            return NULL;
        }
        Py_DECREF(r);
    }
    return Py_BuildValue("Nn", t, size - head);
}

static PyMethodDef methods[] = {
    {"configure_decode", configure_decode, METH_VARARGS, "Set decode's tensor constructor."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, "Rebuild a frame's object."},
    {"configure", configure, METH_VARARGS, "Set the tensor/array types and dtype code tables."},
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, "Frame bytes of obj, or None."},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, "Probe, receive, decode a frame."},
    {"send", (PyCFunction)(void (*)(void))send, METH_FASTCALL, "Encode and post; or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastlane", NULL, -1, methods};

#define INTERN(var, text)                                   \
    if (!(var = PyUnicode_InternFromString(text))) return NULL;

PyMODINIT_FUNC PyInit__fastlane(void) {
    INTERN(s_dtype, "dtype");
    INTERN(s_layout, "layout");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_shape, "shape");
    INTERN(s_is_neg, "is_neg");
    INTERN(s_is_conj, "is_conj");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_requires_grad_, "requires_grad_");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_contiguous, "contiguous");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_tobytes, "tobytes");
    return PyModule_Create(&module);
}
