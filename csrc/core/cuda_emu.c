/*
 * cuda_emu.c -- what Python sees of the emulated GPU (RINGATTN_CUDA=emulate,
 * csrc/emu): whether this build runs on it, and the reports of its memory
 * checker and SIMT layer (for tests: a report also fails the kernel that
 * made it, as a device fault would).  In other builds cuda_emulated() is
 * False and there are no reports.
 */
#include "core/module.h"
#include "core/cuda_rt.h"

#ifdef RA_CUDA_EMULATED
#include "emu/emu.h"
#endif

int ra_cuda_emulated(void) {
#ifdef RA_CUDA_EMULATED
    return 1;
#else
    return 0;
#endif
}

static PyObject *py_cuda_emulated(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyBool_FromLong(ra_cuda_emulated());
}

static PyObject *py_emu_reports(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
#ifdef RA_CUDA_EMULATED
    const char *text = ra_emu_reports_text();
    return PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
#else
    return PyUnicode_FromString("");
#endif
}

static PyObject *py_emu_reports_clear(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
#ifdef RA_CUDA_EMULATED
    ra_emu_reports_clear();
#endif
    Py_RETURN_NONE;
}

static PyMethodDef emu_methods[] = {
    {"cuda_emulated", py_cuda_emulated, METH_NOARGS,
     "cuda_emulated() -> bool: whether the CUDA part runs on ringattn's "
     "emulated GPU."},
    {"emu_reports", py_emu_reports, METH_NOARGS,
     "emu_reports() -> str: what the emulated GPU's checker reported, one "
     "line per report ('' in other builds)."},
    {"emu_reports_clear", py_emu_reports_clear, METH_NOARGS,
     "emu_reports_clear(): forget the emulated GPU's reports."},
    {NULL, NULL, 0, NULL}};

int ra_cuda_emu_exec(PyObject *m) {
    return PyModule_AddFunctions(m, emu_methods);
}
