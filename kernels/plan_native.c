/* The copy planner's fast passes in C: what plan.py's and api.py's Python passes
 * compute, without the interpreter's cost per extent (~0.7 us there on a 2-vCPU VM,
 * ~35 ns here, most of it reading Python tuples) or per item.
 *
 * plan(item_offsets, item_nbytes, tables, block_bytes, arena_bytes, items_bytes,
 *      tile_bytes, items_base, arena_base, num_programs)
 *   -> (table, num_segments, num_programs, vec_bytes, num_tiles, nbytes)
 *   or None when anything is wrong or unusual (plan.py then plans in Python,
 *   and its loop names the fault).
 *
 * ``table`` is a bytearray of int64: the segment rows (item_offset, arena_offset,
 * nbytes, first_tile), then the program rows (first_segment, tile_begin,
 * tile_end), exactly as plan.py lays them out. The rules are plan.py's: each
 * item's extents cover its bytes with less than a block to spare, extents lie
 * inside the arena and never share a block, the access width is the largest
 * power of two (<= 16) dividing every absolute address, and the tiles are split
 * into contiguous ranges of equal length (+-1). Every value is bounded before
 * the product or sum that uses it, so no int64 arithmetic wraps, whatever the
 * arguments. Only exact Python ints are read (no __index__, so no Python code
 * runs while the inputs are read and borrowed references stay valid); numpy
 * integers and other int-likes go to the Python passes.
 *
 * item_layout(tensors) -> (lowest, offsets, sizes, span) or None
 *   api._item_layout's numbers for a list of tensors: the index of the
 *   lowest-addressed non-empty tensor (-1: none), each tensor's byte offset
 *   from it (0 for empty ones), byte sizes, and the bytes from it to the end of
 *   the highest. None when a tensor is not contiguous (api.py names it). The
 *   tensors' methods run Python code, so it works on a snapshot of the list.
 *
 * Built on first use by native.py with the host's C compiler (the one Triton
 * needs to launch its kernels on a GPU) and cached by the hash of this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_VEC_BYTES 16
#define INSERTION_SORT_BELOW 64

typedef struct {
    int64_t start, count;
} extent_t;

/* An exact Python int that fits int64 (converting one runs no Python code); sets
 * *bad otherwise. */
static inline int64_t as_int64(PyObject *o, int *bad) {
    if (!PyLong_CheckExact(o)) {
        *bad = 1;
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) *bad = 1;
    return v;
}

/* Sorts extents by start, all in [0, num_blocks): already sorted (the allocator's
 * usual order) costs one pass, a few by insertion, many by LSD radix on the bytes
 * that block numbers use (O(n): qsort took 2.4 ms for 19,200 extents). */
static int sort_by_start(extent_t *ext, Py_ssize_t n, int64_t num_blocks) {
    Py_ssize_t i;
    for (i = 1; i < n && ext[i - 1].start <= ext[i].start; i++) {
    }
    if (i >= n) return 0;
    if (n < INSERTION_SORT_BELOW) {
        for (i = 1; i < n; i++) {
            extent_t e = ext[i];
            Py_ssize_t j = i;
            for (; j > 0 && ext[j - 1].start > e.start; j--) ext[j] = ext[j - 1];
            ext[j] = e;
        }
        return 0;
    }
    extent_t *tmp = malloc(sizeof(extent_t) * n), *src = ext, *dst = tmp;
    if (tmp == NULL) return -1;
    uint64_t highest = (uint64_t)(num_blocks - 1);
    for (int shift = 0; shift < 64 && (highest >> shift); shift += 8) {
        Py_ssize_t at[257] = {0};
        for (i = 0; i < n; i++) at[(((uint64_t)src[i].start >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++) at[d + 1] += at[d];
        for (i = 0; i < n; i++) dst[at[((uint64_t)src[i].start >> shift) & 255]++] = src[i];
        extent_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != ext) memcpy(ext, src, sizeof(extent_t) * n);
    free(tmp);
    return 0;
}

/* One (start, count) entry of a table: a tuple or list of two ints. */
static inline int read_pair(PyObject *pair, int64_t *start, int64_t *count) {
    int bad = 0;
    if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2) {
        *start = as_int64(PyTuple_GET_ITEM(pair, 0), &bad);
        *count = as_int64(PyTuple_GET_ITEM(pair, 1), &bad);
    } else if (PyList_CheckExact(pair) && PyList_GET_SIZE(pair) == 2) {
        *start = as_int64(PyList_GET_ITEM(pair, 0), &bad);
        *count = as_int64(PyList_GET_ITEM(pair, 1), &bad);
    } else {
        bad = 1;
    }
    return bad;
}

/* A list or tuple (what the engine passes; other sequences go to the Python passes). */
static inline int is_list_or_tuple(PyObject *o) { return PyList_CheckExact(o) || PyTuple_CheckExact(o); }

static PyObject *plan(PyObject *self, PyObject *args) {
    PyObject *offsets, *nbytes_of, *tables;
    long long block, arena_bytes, items_bytes, tile_bytes, items_base, arena_base, num_programs;
    if (!PyArg_ParseTuple(args, "OOOLLLLLLL", &offsets, &nbytes_of, &tables, &block,
                          &arena_bytes, &items_bytes, &tile_bytes, &items_base, &arena_base,
                          &num_programs))
        return NULL;
    if (!is_list_or_tuple(offsets) || !is_list_or_tuple(nbytes_of) || !is_list_or_tuple(tables))
        Py_RETURN_NONE;
    if (block <= 0 || arena_bytes < 0 || arena_bytes % block || tile_bytes <= 0 || num_programs <= 0)
        Py_RETURN_NONE;
    int64_t num_blocks = arena_bytes / block;
    Py_ssize_t items = Py_SIZE(tables);
    if (Py_SIZE(offsets) != items || Py_SIZE(nbytes_of) != items) Py_RETURN_NONE;

    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < items; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tables, i);
        if (!is_list_or_tuple(t)) Py_RETURN_NONE;
        n += Py_SIZE(t);
    }
    PyObject *result = Py_None;
    extent_t *ext = malloc(sizeof(extent_t) * (n ? n : 1));
    int64_t *rows = malloc(sizeof(int64_t) * 4 * (n ? n : 1));
    if (ext == NULL || rows == NULL) {
        result = PyErr_NoMemory();
        goto done;
    }

    /* Segments: one per extent, the item's last one clipped to its end. */
    uint64_t bits = MAX_VEC_BYTES;
    int64_t total = 0;
    Py_ssize_t s = 0;
    for (Py_ssize_t i = 0; i < items; i++) {
        int bad = 0;
        int64_t offset = as_int64(PySequence_Fast_GET_ITEM(offsets, i), &bad);
        int64_t nbytes = as_int64(PySequence_Fast_GET_ITEM(nbytes_of, i), &bad);
        if (bad || offset < 0 || nbytes < 0 || offset > items_bytes || nbytes > items_bytes - offset)
            goto done;  /* outside the items buffer (offset first: the difference fits) */
        PyObject *table = PySequence_Fast_GET_ITEM(tables, i);
        int64_t pos = offset, end = offset + nbytes;
        for (Py_ssize_t k = 0; k < Py_SIZE(table); k++) {
            int64_t start, count;
            if (read_pair(PySequence_Fast_GET_ITEM(table, k), &start, &count)) {
                bad = 1;  /* not a pair of int64 */
                break;
            }
            if (start < 0 || start >= num_blocks || count <= 0 || count > num_blocks - start) {
                bad = 1;  /* outside the arena (bounded first: the products below fit) */
                break;
            }
            int64_t span = count * block, take = end - pos;
            if (take > span) take = span;
            if (take <= 0 || span - take >= block) {
                bad = 1;  /* more blocks than the item's bytes need */
                break;
            }
            int64_t *row = rows + 4 * s;
            row[0] = pos;
            row[1] = start * block;
            row[2] = take;
            ext[s].start = start;
            ext[s].count = count;
            bits |= ((uint64_t)items_base + (uint64_t)pos) | ((uint64_t)arena_base + (uint64_t)row[1]);
            pos += take;
            s++;
        }
        if (bad || pos != end) goto done;  /* pos < end: fewer bytes than the item's */
        if (__builtin_add_overflow(total, nbytes, &total)) goto done;
    }

    /* No block given twice: sorted by start, each extent begins where the last ended or later. */
    if (sort_by_start(ext, n, num_blocks)) {
        result = PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 1; k < n; k++)
        if (ext[k].start < ext[k - 1].start + ext[k - 1].count) goto done;

    int64_t vec = (int64_t)(bits & (~bits + 1));
    int64_t tiles = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t take = rows[4 * k + 2], tail = take % vec;
        rows[4 * k + 3] = tiles;
        tiles += (take - tail) / tile_bytes + ((take - tail) % tile_bytes != 0) + (tail != 0);
    }

    /* Program rows: tiles [p * T / P, (p + 1) * T / P), each with the segment holding its first tile. */
    int64_t programs = num_programs < tiles ? num_programs : tiles;
    if (programs > (PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t) - 4 * n) / 3) {
        result = PyErr_NoMemory();  /* a table of more than 2**63 bytes */
        goto done;
    }
    PyObject *table = PyByteArray_FromStringAndSize(
        NULL, (Py_ssize_t)(sizeof(int64_t) * (4 * n + 3 * programs)));
    if (table == NULL) {
        result = NULL;
        goto done;
    }
    int64_t *out = (int64_t *)PyByteArray_AS_STRING(table);
    memcpy(out, rows, sizeof(int64_t) * 4 * n);
    int64_t *program = out + 4 * n, begin = 0;
    Py_ssize_t seg = 0;
    for (int64_t p = 1; p <= programs; p++) {
        int64_t stop = (int64_t)((__int128)tiles * p / programs);  /* 128 bits: no overflow */
        while (seg + 1 < n && rows[4 * (seg + 1) + 3] <= begin) seg++;
        program[0] = seg;
        program[1] = begin;
        program[2] = stop;
        program += 3;
        begin = stop;
    }
    result = Py_BuildValue("(NnLLLL)", table, n, (long long)programs, (long long)vec,
                           (long long)tiles, (long long)total);
done:
    if (result == Py_None) Py_INCREF(Py_None);
    free(ext);
    free(rows);
    return result;
}

static PyObject *s_data_ptr, *s_nbytes, *s_is_contiguous;  /* interned method names */

static PyObject *item_layout(PyObject *self, PyObject *given) {
    if (!PyList_CheckExact(given)) Py_RETURN_NONE;
    PyObject *tensors = PyList_AsTuple(given);  /* a snapshot: the methods below run Python */
    if (tensors == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    PyObject *offsets = PyList_New(n), *sizes = PyList_New(n), *result = NULL;
    int64_t *ptrs = malloc(sizeof(int64_t) * (n ? n : 1));
    if (offsets == NULL || sizes == NULL || ptrs == NULL) {
        if (ptrs == NULL) PyErr_NoMemory();
        goto done;
    }
    int64_t low = INT64_MAX, high = 0;
    Py_ssize_t lowest = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(tensors, i);
        PyObject *contiguous = PyObject_CallMethodNoArgs(t, s_is_contiguous);
        PyObject *ptr = contiguous == Py_True ? PyObject_CallMethodNoArgs(t, s_data_ptr) : NULL;
        PyObject *nbytes = ptr != NULL ? PyObject_GetAttr(t, s_nbytes) : NULL;
        int bad = 0;
        int64_t address = ptr != NULL ? as_int64(ptr, &bad) : 0;
        int64_t size = nbytes != NULL ? as_int64(nbytes, &bad) : 0;
        Py_XDECREF(ptr);
        if (nbytes == NULL || bad || size < 0 || address < 0 || size > INT64_MAX - address) {
            Py_XDECREF(nbytes);
            Py_XDECREF(contiguous);
            PyErr_Clear();
            result = Py_None;  /* not contiguous, not a tensor...: api.py says what is wrong */
            goto done;
        }
        Py_DECREF(contiguous);
        PyList_SET_ITEM(sizes, i, nbytes);
        ptrs[i] = size ? address : -1;  /* an empty tensor's address means nothing */
        if (size && address < low) {
            low = address;
            lowest = i;
        }
        if (size && address + size > high) high = address + size;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *offset = PyLong_FromLongLong(ptrs[i] < 0 ? 0 : ptrs[i] - low);
        if (offset == NULL) goto done;
        PyList_SET_ITEM(offsets, i, offset);
    }
    result = Py_BuildValue("(nOOL)", lowest, offsets, sizes, (long long)(lowest < 0 ? 0 : high - low));
done:
    if (result == Py_None) Py_INCREF(Py_None);
    Py_XDECREF(offsets);
    Py_XDECREF(sizes);
    Py_DECREF(tensors);
    free(ptrs);
    return result;
}

static PyMethodDef methods[] = {
    {"plan", plan, METH_VARARGS, "The copy plan of one launch, or None (see plan_native.c)."},
    {"item_layout", item_layout, METH_O, "Where a list of tensors lie, or None (see plan_native.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ecoffload_plan_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_ecoffload_plan_native(void) {
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_nbytes = PyUnicode_InternFromString("nbytes");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    if (s_data_ptr == NULL || s_nbytes == NULL || s_is_contiguous == NULL) return NULL;
    return PyModule_Create(&module);
}
