/* The copy planner's fast passes in C: what plan.py's and items.py's Python passes
 * compute, without the interpreter's cost per extent or per item (BENCHMARKS.md,
 * "With the planner's C pass": most of what is left is reading Python tuples).
 *
 * plan(item_offsets, item_nbytes, tables, block_bytes, arena_bytes, items_bytes,
 *      tile_bytes, items_base, arena_base, num_programs)
 *   -> (table, num_segments, num_programs, vec_bytes, num_tiles, nbytes)
 *   or None when anything is wrong or unusual (plan.py then plans in Python,
 *   and its loop names the fault). ``tables``: a list or tuple of per-item lists
 *   or tuples of (start, count) pairs (tuples, tuple subclasses such as the
 *   catalogs' ``Extent``, or lists).
 *
 * plan_step(item_offsets, item_nbytes, extents, bounds, block_bytes, ...)
 *   the same plan from a step table (kernels/step_table.py): ``extents`` a
 *   C-contiguous int64 buffer of [E, 2] (start, count) pairs, item i's being pairs
 *   [bounds[i], bounds[i + 1]) of the int64 buffer ``bounds`` (N + 1 entries);
 *   read through the buffer protocol, no Python object per extent.
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
 * check_step(extents, bounds, num_blocks) -> -1, the first extent outside, or None
 *   what a worker checks of a step table it received (see check_step below);
 *   without num_blocks, the arrays only (-1 or None): what step_table.step_arrays
 *   checks of every step table made, without numpy's calls (BENCHMARKS.md).
 *
 * item_layout(tensors) -> (lowest, offsets, sizes, span) or None
 *   items.python_item_layout's numbers for a list of tensors: the index of the
 *   lowest-addressed non-empty tensor (-1: none), each tensor's byte offset
 *   from it (0 for empty ones), byte sizes, and the bytes from it to the end of
 *   the highest. None when a tensor is not contiguous (items.py names it). The
 *   tensors' methods run Python code, so it works on a snapshot of the list.
 *   It calls torch.Tensor's is_contiguous, data_ptr and nbytes descriptors on
 *   each tensor (looked up once, at the first call: a bound-method lookup per
 *   call cost about as much again), never an attribute a subclass could
 *   override; it takes exact torch.Tensors only, with no torch function mode
 *   active (a subclass's __torch_function__, or a mode, could answer for them):
 *   anything else goes to items.py, which asks torch with torch functions disabled.
 *
 * Built at install time as the extension module ecoffload.kernels._plan_native
 * (setup.py, optional: without a compiler the install warns and plan.py's
 * Python passes run); loaded by native.py.
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
 * that block numbers use (O(n): qsort was the cost of large fragmented steps). */
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

/* One (start, count) entry of a table: a tuple (or a tuple subclass: the catalogs'
 * Extent named tuples, whose items sit where a tuple's do) or a list of two ints. */
static inline int read_pair(PyObject *pair, int64_t *start, int64_t *count) {
    int bad = 0;
    if (PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2) {
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

/* One launch's step: item i's bytes [offsets[i], offsets[i] + nbytes[i]) of the items
 * buffer, its extents ext[bounds[i] .. bounds[i + 1]) (start, count pairs). */
typedef struct {
    Py_ssize_t items, n;
    const int64_t *offsets, *nbytes, *ext, *bounds;
} step_t;

typedef struct {
    long long block, arena_bytes, items_bytes, tile_bytes, items_base, arena_base, num_programs;
} params_t;

/* The plan of a step whose numbers are all read (no Python object touched), or None. */
static PyObject *plan_step_core(const step_t *st, const params_t *pr) {
    long long block = pr->block, items_bytes = pr->items_bytes, tile_bytes = pr->tile_bytes;
    if (block <= 0 || pr->arena_bytes < 0 || pr->arena_bytes % block || tile_bytes <= 0 ||
        pr->num_programs <= 0)
        Py_RETURN_NONE;
    int64_t num_blocks = pr->arena_bytes / block;
    Py_ssize_t n = st->n;
    if (st->bounds[0] != 0 || st->bounds[st->items] != n) Py_RETURN_NONE;
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
    for (Py_ssize_t i = 0; i < st->items; i++) {
        int64_t offset = st->offsets[i], nbytes = st->nbytes[i];
        if (offset < 0 || nbytes < 0 || offset > items_bytes || nbytes > items_bytes - offset)
            goto done;  /* outside the items buffer (offset first: the difference fits) */
        int64_t first = st->bounds[i], last = st->bounds[i + 1];
        if (first != s || last < first || last > n) goto done;  /* not one item after another */
        int64_t pos = offset, end = offset + nbytes;
        int bad = 0;
        for (int64_t k = first; k < last; k++) {
            int64_t start = st->ext[2 * k], count = st->ext[2 * k + 1];
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
            bits |= ((uint64_t)pr->items_base + (uint64_t)pos) |
                    ((uint64_t)pr->arena_base + (uint64_t)row[1]);
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

    /* Tiles per segment: whole VEC words in TILE_BYTES tiles, a tail of < VEC bytes in one
     * more. VEC is a power of two, and so is any usual tile size: shifts, not one 64-bit
     * division per segment (about half of a sorted 2,000-extent plan went to three). */
    int64_t vec = (int64_t)(bits & (~bits + 1));
    int tile_shift = (tile_bytes & (tile_bytes - 1)) == 0 ? __builtin_ctzll(tile_bytes) : -1;
    int64_t tiles = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t take = rows[4 * k + 2], body = take & ~(vec - 1);
        int64_t whole = tile_shift >= 0 ? body >> tile_shift : body / tile_bytes;
        rows[4 * k + 3] = tiles;
        /* (at most one tile per byte: tiles <= total <= arena_bytes, no overflow) */
        tiles += whole + (body != whole * tile_bytes) + (take != body);
    }

    /* Program rows: tiles [p * T / P, (p + 1) * T / P), each with the segment holding its first tile. */
    int64_t programs = pr->num_programs < tiles ? pr->num_programs : tiles;
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

/* offsets and sizes of ``items`` items (a list or tuple of exact ints) into out[2 * items]:
 * offsets first; 1 when they are not (the Python passes then name the fault). */
static int read_items(PyObject *offsets, PyObject *nbytes_of, Py_ssize_t items, int64_t *out) {
    if (!is_list_or_tuple(offsets) || !is_list_or_tuple(nbytes_of)) return 1;
    if (Py_SIZE(offsets) != items || Py_SIZE(nbytes_of) != items) return 1;
    int bad = 0;
    for (Py_ssize_t i = 0; i < items; i++) {
        out[i] = as_int64(PySequence_Fast_GET_ITEM(offsets, i), &bad);
        out[items + i] = as_int64(PySequence_Fast_GET_ITEM(nbytes_of, i), &bad);
    }
    return bad;
}

#define PARAMS_FORMAT "LLLLLLL"
#define PARAMS_ARGS(p) &(p).block, &(p).arena_bytes, &(p).items_bytes, &(p).tile_bytes, \
    &(p).items_base, &(p).arena_base, &(p).num_programs

static PyObject *plan(PyObject *self, PyObject *args) {
    PyObject *offsets, *nbytes_of, *tables;
    params_t pr;
    if (!PyArg_ParseTuple(args, "OOO" PARAMS_FORMAT, &offsets, &nbytes_of, &tables,
                          PARAMS_ARGS(pr)))
        return NULL;
    if (!is_list_or_tuple(tables)) Py_RETURN_NONE;
    Py_ssize_t items = Py_SIZE(tables), n = 0;
    for (Py_ssize_t i = 0; i < items; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tables, i);
        if (!is_list_or_tuple(t)) Py_RETURN_NONE;
        n += Py_SIZE(t);
    }
    PyObject *result = Py_None;
    int64_t *numbers = malloc(sizeof(int64_t) * (2 * items + items + 1 + 2 * n + 1));
    if (numbers == NULL) return PyErr_NoMemory();
    int64_t *bounds = numbers + 2 * items, *ext = bounds + items + 1;
    if (read_items(offsets, nbytes_of, items, numbers)) goto done;
    Py_ssize_t k = 0;
    bounds[0] = 0;
    for (Py_ssize_t i = 0; i < items; i++) {
        PyObject *table = PySequence_Fast_GET_ITEM(tables, i);
        for (Py_ssize_t j = 0; j < Py_SIZE(table); j++, k++)
            if (read_pair(PySequence_Fast_GET_ITEM(table, j), &ext[2 * k], &ext[2 * k + 1]))
                goto done;  /* not a pair of int64 */
        bounds[i + 1] = k;
    }
    step_t st = {items, n, numbers, numbers + items, ext, bounds};
    result = plan_step_core(&st, &pr);
    free(numbers);
    return result;
done:
    free(numbers);
    Py_INCREF(result);
    return result;
}

/* An int64 buffer (C-contiguous, native order, aligned to 8 bytes) of ``ndim``
 * dimensions, the last of two entries when ndim is 2 (step_table.step_arrays' rules, so
 * both passes take the same arrays): its element count, or -1. A misaligned one (numpy
 * can make them: a view at an odd offset of a byte buffer) is left to numpy, which reads
 * it correctly: an int64 load from it is undefined behaviour in C. */
static Py_ssize_t int64_buffer(PyObject *o, Py_buffer *view, int ndim) {
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        view->obj = NULL;
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=') f++;
    if (view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) return -1;
    if (view->ndim != ndim || (ndim == 2 && view->shape[1] != 2)) return -1;
    if ((uintptr_t)view->buf % _Alignof(int64_t)) return -1;
    return view->len / 8;
}

static PyObject *plan_step(PyObject *self, PyObject *args) {
    PyObject *offsets, *nbytes_of, *extents, *bounds;
    params_t pr;
    if (!PyArg_ParseTuple(args, "OOOO" PARAMS_FORMAT, &offsets, &nbytes_of, &extents, &bounds,
                          PARAMS_ARGS(pr)))
        return NULL;
    Py_buffer ev, bv;
    PyObject *result = Py_None;
    Py_ssize_t pairs = int64_buffer(extents, &ev, 2), edges = int64_buffer(bounds, &bv, 1);
    int64_t *numbers = NULL;
    if (pairs < 0 || pairs % 2 || edges < 1) goto done;
    Py_ssize_t items = edges - 1;
    numbers = malloc(sizeof(int64_t) * (2 * items + 1));
    if (numbers == NULL) {
        result = PyErr_NoMemory();
        goto done;
    }
    if (read_items(offsets, nbytes_of, items, numbers)) goto done;
    step_t st = {items, pairs / 2, numbers, numbers + items, ev.buf, bv.buf};
    result = plan_step_core(&st, &pr);
    free(numbers);
    numbers = NULL;
    PyBuffer_Release(&ev);
    PyBuffer_Release(&bv);
    return result;
done:
    free(numbers);
    if (ev.obj != NULL) PyBuffer_Release(&ev);
    if (bv.obj != NULL) PyBuffer_Release(&bv);
    if (result == Py_None) Py_INCREF(Py_None);
    return result;
}

/* check_step(extents, bounds, num_blocks): -1 when the step arrays are a step table's
 * (plan_step's rules) and every extent lies inside an arena of num_blocks blocks; else
 * the index of the first extent that does not; None when the arrays are not a step
 * table's (step_table.py then names what is wrong). What a worker checks of the tables
 * it receives, before any copy: one pass over the arrays. */
static PyObject *check_step(PyObject *self, PyObject *args) {
    PyObject *extents, *bounds;
    long long num_blocks = -1;  /* -1 (check_arrays): the arrays only, not the extents */
    if (!PyArg_ParseTuple(args, "OO|L", &extents, &bounds, &num_blocks)) return NULL;
    Py_buffer ev, bv;
    PyObject *result = Py_None;
    Py_ssize_t pairs = int64_buffer(extents, &ev, 2), edges = int64_buffer(bounds, &bv, 1);
    if (pairs < 0 || edges < 1) goto done;
    const int64_t *ext = ev.buf, *b = bv.buf;
    Py_ssize_t n = pairs / 2, bad = -1;
    if (b[0] != 0 || b[edges - 1] != n) goto done;
    for (Py_ssize_t i = 1; i < edges; i++)
        if (b[i] < b[i - 1]) goto done;
    for (Py_ssize_t k = 0; k < n && num_blocks >= 0; k++) {
        int64_t start = ext[2 * k], count = ext[2 * k + 1];
        if (start < 0 || start >= num_blocks || count <= 0 || count > num_blocks - start) {
            bad = k;
            break;
        }
    }
    result = PyLong_FromSsize_t(bad);
done:
    if (ev.obj != NULL) PyBuffer_Release(&ev);
    if (bv.obj != NULL) PyBuffer_Release(&bv);
    if (result == Py_None) Py_INCREF(Py_None);
    return result;
}

static PyObject *s_data_ptr, *s_nbytes, *s_is_contiguous;  /* interned names */
/* torch.Tensor's (once found): the type, two methods, the nbytes getter, and
 * torch._C._is_torch_function_mode_enabled. */
static PyObject *tensor_type, *tensor_data_ptr, *tensor_is_contiguous, *tensor_nbytes, *mode_on;

/* torch.Tensor's type and descriptors, looked up at the first call (torch is imported
 * by then: the caller holds tensors); 0, or -1 with an exception set. */
static int find_tensor_methods(void) {
    if (tensor_data_ptr != NULL) return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *tensor = torch != NULL ? PyObject_GetAttrString(torch, "Tensor") : NULL;
    PyObject *c = torch != NULL ? PyObject_GetAttrString(torch, "_C") : NULL;
    PyObject *mode = c != NULL ? PyObject_GetAttrString(c, "_is_torch_function_mode_enabled")
                               : NULL;
    PyObject *data_ptr = tensor != NULL ? PyObject_GetAttr(tensor, s_data_ptr) : NULL;
    PyObject *is_contiguous = data_ptr != NULL ? PyObject_GetAttr(tensor, s_is_contiguous) : NULL;
    PyObject *nbytes = is_contiguous != NULL ? PyObject_GetAttr(tensor, s_nbytes) : NULL;
    Py_XDECREF(torch);
    Py_XDECREF(c);
    int ok = mode != NULL && nbytes != NULL && PyType_Check(tensor) &&
             Py_TYPE(nbytes)->tp_descr_get != NULL;
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "torch.Tensor.nbytes is not a descriptor");
        Py_XDECREF(tensor);
        Py_XDECREF(mode);
        Py_XDECREF(data_ptr);
        Py_XDECREF(is_contiguous);
        Py_XDECREF(nbytes);
        return -1;
    }
    tensor_type = tensor;
    mode_on = mode;
    tensor_nbytes = nbytes;
    tensor_is_contiguous = is_contiguous;
    tensor_data_ptr = data_ptr;
    return 0;
}

static PyObject *item_layout(PyObject *self, PyObject *given) {
    if (!PyList_CheckExact(given)) Py_RETURN_NONE;
    if (find_tensor_methods() < 0) return NULL;
    PyObject *modes = PyObject_CallNoArgs(mode_on);
    if (modes == NULL) return NULL;
    Py_DECREF(modes);
    if (modes != Py_False) Py_RETURN_NONE;  /* a mode answers for tensors: items.py asks */
    PyObject *tensors = PyList_AsTuple(given);  /* a snapshot: the methods below run Python */
    if (tensors == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(PyTuple_GET_ITEM(tensors, i)) != (PyTypeObject *)tensor_type) {
            Py_DECREF(tensors);  /* a subclass (or no tensor): items.py asks torch itself */
            Py_RETURN_NONE;
        }
    }
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
        PyObject *contiguous = PyObject_CallOneArg(tensor_is_contiguous, t);
        PyObject *ptr = contiguous == Py_True ? PyObject_CallOneArg(tensor_data_ptr, t) : NULL;
        PyObject *nbytes = ptr != NULL ? Py_TYPE(tensor_nbytes)->tp_descr_get(
            tensor_nbytes, t, tensor_type) : NULL;
        int bad = 0;
        int64_t address = ptr != NULL ? as_int64(ptr, &bad) : 0;
        int64_t size = nbytes != NULL ? as_int64(nbytes, &bad) : 0;
        Py_XDECREF(ptr);
        if (nbytes == NULL || bad || size < 0 || address < 0 || size > INT64_MAX - address) {
            Py_XDECREF(nbytes);
            Py_XDECREF(contiguous);
            PyErr_Clear();
            result = Py_None;  /* not contiguous, not a tensor...: items.py says what is wrong */
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
    {"plan_step", plan_step, METH_VARARGS,
     "The copy plan of one launch from int64 step arrays, or None (see plan_native.c)."},
    {"item_layout", item_layout, METH_O, "Where a list of tensors lie, or None (see plan_native.c)."},
    {"check_step", check_step, METH_VARARGS,
     "The first extent of a step table outside the arena, -1, or None (see plan_native.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ecoffload.kernels._plan_native", NULL, -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__plan_native(void) {
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_nbytes = PyUnicode_InternFromString("nbytes");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    if (s_data_ptr == NULL || s_nbytes == NULL || s_is_contiguous == NULL) return NULL;
    return PyModule_Create(&module);
}
