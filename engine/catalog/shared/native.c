/* The shared catalog's hot paths in C: a hit, a pin and an unpin of items this catalog
 * object has seen READY, over the same shared words the Python code reads and writes
 * (format.py's layout), without the interpreter's cost per word (~40 of them per
 * pinned hit) or the two ctypes calls of the robust mutex.
 *
 * Fast paths only. Each call either does exactly what the Python method does for
 * the usual case and returns its result, or writes nothing and answers an int:
 *   0          "slow": the Python method does the whole operation (it waits for a
 *              held mutex, recovers a dirty catalog, hashes an unseen key, reaps
 *              dead processes' pin records, raises the errors);
 *   EOWNERDEAD the mutex's last holder died: this thread holds the mutex, already
 *              marked consistent (at once: unlocking before that would make it
 *              unrecoverable for every process); the caller counts the death,
 *              releases the mutex and goes the Python way (lock.py);
 *   another errno of pthread_mutex_trylock (ENOTRECOVERABLE...): the mutex is not
 *              held; the caller raises as the Python way would.
 * Never while fault_points.hook is set (the crash tests inject faults between the
 * Python path's writes).
 *
 * HitPath(words, seen, ready, fault_points, slots_at, pins_at, max_items, max_pins,
 *         pid, start)
 *   words: the catalog's int64 memoryview of its region (the base address is read
 *   through the buffer protocol at every call, so a closed catalog raises instead
 *   of touching an unmapped region); seen: its dict key -> SharedEntry; ready:
 *   ItemState.READY; slots_at, pins_at: word offsets of the slots and pin records.
 *
 *   hit(key, pin)  lookup(key, pin=pin) of a seen READY entry -> the entry or an int
 *   pin(key)       pin(key) of a seen READY entry -> the entry or an int
 *   unpin(keys)    unpin_many(keys), every key seen (at most MAX_BATCH) -> True or an int
 *   identify(pid, start)  who this process is (again in a forked child)
 *   counters: hits, pins, unpins (keys), slow (calls answered 0)
 *
 * The module exports LAYOUT, the word offsets it was compiled with; the loader
 * (native.py) refuses the module unless they equal
 * format.py's. Every index read from the region is bounded before
 * it is used; an out-of-range one answers "slow" (the Python path then meets it).
 *
 * Built at install time as ecoffload.engine.catalog.shared._catalog_native (setup.py, optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>

/* format.py's layout (checked against it by the loader: LAYOUT). */
enum { H_DIRTY = 9, H_TICK = 11, H_LRU_HEAD = 13, H_LRU_TAIL = 14, H_PIN_FREE = 16,
       H_EVICTABLE = 18, H_HITS = 23 };
enum { S_STATE = 0, S_GEN = 1, S_PREV = 2, S_NEXT = 3, S_TICK = 4, S_PINS = 5, S_PIN_HEAD = 6,
       S_BLOCKS = 7 };
enum { P_SLOT = 0, P_NEXT = 1, P_PID = 2, P_START = 3, P_COUNT = 4 };
enum { SLOT_WORDS = 32, PIN_WORDS = 5, MUTEX_AT = 256, READY = 2, HEADER_WORDS = 128 };
enum { HIT = 1, PIN = 2 };
#define MAX_BATCH 256 /* keys of one unpin call; more go the Python way */

typedef struct {
    PyObject_HEAD
    PyObject *words;  /* the catalog's memoryview of its region */
    PyObject *seen;   /* key -> SharedEntry, the catalog's own dict */
    PyObject *ready;  /* ItemState.READY */
    PyObject *faults; /* fault_points' module dict: "hook" */
    int64_t sl, pn, max_items, max_pins, pid, start, need_words;
    unsigned long long hits, pins, unpins, slow;
} HitPath;

static PyObject *s_slot, *s_generation, *s_state, *s_pins, *s_hook;

/* An exact int attribute of an entry, or -1 (anything else: the Python way). */
static int64_t int_attr(PyObject *entry, PyObject *name) {
    PyObject *v = PyObject_GetAttr(entry, name);
    int64_t x = -1;
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
    if (PyLong_CheckExact(v)) {
        x = PyLong_AsLongLong(v);
        if (x == -1 && PyErr_Occurred()) PyErr_Clear();
    }
    Py_DECREF(v);
    return x;
}

/* The seen entry of key (a new reference) if it is READY, with its slot and generation;
 * NULL and no error for anything else, NULL with an error only if the dict raised. */
static PyObject *seen_ready(HitPath *self, PyObject *key, int check_state, int64_t *slot,
                            int64_t *gen) {
    PyObject *entry, *state;
    if (!PyUnicode_CheckExact(key)) return NULL;
    entry = PyDict_GetItemWithError(self->seen, key);
    if (entry == NULL) return NULL;
    Py_INCREF(entry);
    if (check_state) {
        state = PyObject_GetAttr(entry, s_state);
        if (state == NULL) PyErr_Clear();
        Py_XDECREF(state);
        if (state != self->ready) goto no;
    }
    *slot = int_attr(entry, s_slot);
    *gen = int_attr(entry, s_generation);
    if (*slot < 0 || *slot >= self->max_items || *gen < 0) goto no;
    return entry;
no:
    Py_DECREF(entry);
    return NULL;
}

static int hook_set(HitPath *self) {
    PyObject *hook = PyDict_GetItemWithError(self->faults, s_hook);
    if (hook == NULL) PyErr_Clear();
    return hook != NULL && hook != Py_None;
}

static PyObject *slow(HitPath *self) {
    self->slow++;
    return PyLong_FromLong(0);
}

/* Take the mutex without waiting: 0 (held, catalog clean), -1 (not held: busy, or the
 * catalog is dirty), EOWNERDEAD (held, marked consistent) or another error of trylock
 * (ENOTRECOVERABLE...: not held), which the caller answers. */
static int enter(pthread_mutex_t *mx, int64_t *w) {
    int rc = pthread_mutex_trylock(mx);
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(mx);
        return EOWNERDEAD;
    }
    if (rc) return rc == EBUSY ? -1 : rc;
    if (w[H_DIRTY]) { /* the last updater died inside an update: Python recovers */
        pthread_mutex_unlock(mx);
        return -1;
    }
    return 0;
}

/* The region's words with the mutex taken without waiting (enter): LOCKED, with *w and
 * *mx set and buf to release after unlocking; or not held and buf released: SLOW (the
 * caller goes to Python), a trylock code > 0 that Python answers (EOWNERDEAD: held,
 * consistent, handed over), or FAILED with a Python error set (a closed catalog). */
enum { LOCKED = 0, FAILED = -1, SLOW = -2 };
static int lock_words(HitPath *self, Py_buffer *buf, int64_t **w, pthread_mutex_t **mx) {
    /* Writable only: a read-only mapping would fault, an immutable object would change. */
    if (PyObject_GetBuffer(self->words, buf, PyBUF_WRITABLE)) return FAILED;
    *w = (int64_t *)buf->buf;
    int rc = SLOW;
    if (buf->len / 8 >= self->need_words) {
        *mx = (pthread_mutex_t *)((char *)buf->buf + MUTEX_AT);
        rc = enter(*mx, *w);
        if (rc == LOCKED) return LOCKED;
        if (rc < 0) rc = SLOW;
    }
    PyBuffer_Release(buf);
    return rc;
}

/* lock_words' answer when it is not LOCKED: NULL (an error), the Python path, or the code. */
static PyObject *not_locked(HitPath *self, int rc) {
    return rc == FAILED ? NULL : rc == SLOW ? slow(self) : PyLong_FromLong(rc);
}

/* This process's pin record of the slot at word b (-1: none) and the record before it
 * in the slot's list (-1: the head); -2 when the list leaves the region or loops. */
static int64_t my_record(HitPath *self, const int64_t *w, int64_t b, int64_t *prev) {
    int64_t r = w[b + S_PIN_HEAD], hops = 0;
    *prev = -1;
    while (r >= 0) {
        if (r >= self->max_pins || ++hops > self->max_pins) return -2;
        int64_t p = self->pn + r * PIN_WORDS;
        if (w[p + P_PID] == self->pid && w[p + P_START] == self->start) return r;
        *prev = r;
        r = w[p + P_NEXT];
    }
    return -1;
}

static int slot_index(HitPath *self, int64_t s) { return s >= 0 && s < self->max_items; }

/* hit / pin: flags HIT (count the hit, move to the LRU tail) and PIN. */
static PyObject *hit_or_pin(HitPath *self, PyObject *key, int flags) {
    Py_buffer buf;
    int64_t s, gen, r, prev, b, p, *w, pins, tail = -1, before = -1, after = -1;
    PyObject *entry, *pins_obj;
    pthread_mutex_t *mx;
    int rc;
    if (hook_set(self)) return slow(self);
    entry = seen_ready(self, key, 1, &s, &gen);
    if (entry == NULL) return PyErr_Occurred() ? NULL : slow(self);
    rc = lock_words(self, &buf, &w, &mx);
    if (rc != LOCKED) {
        Py_DECREF(entry);
        return not_locked(self, rc);
    }
    b = self->sl + s * SLOT_WORDS;
    if (w[b + S_GEN] != gen || w[b + S_STATE] != READY) goto unlock_slow;
    /* Everything that could send it the Python way is checked before the first write. */
    r = -1;
    if (flags & PIN) {
        r = my_record(self, w, b, &prev);
        if (r == -2) goto unlock_slow;
        if (r < 0) { /* a free record, or Python reaps dead processes' records */
            r = w[H_PIN_FREE];
            if (r < 0 || r >= self->max_pins) goto unlock_slow;
            r = -1 - r; /* taken from the free list below */
        }
    }
    /* Counters one step from int64's limits: Python's writes raise there (a memoryview
     * holds int64s), so C declines rather than wrap (undefined behaviour) or differ. */
    if (flags & PIN) {
        if (w[b + S_PINS] == INT64_MAX || (r >= 0 && w[self->pn + r * PIN_WORDS + P_COUNT] ==
                                                         INT64_MAX))
            goto unlock_slow;
        int64_t left;
        if (w[b + S_PINS] == 0 && __builtin_sub_overflow(w[H_EVICTABLE], w[b + S_BLOCKS], &left))
            goto unlock_slow;
    }
    if (flags & HIT) {
        if (w[H_HITS] == INT64_MAX || w[H_TICK] == INT64_MAX) goto unlock_slow;
        tail = w[H_LRU_TAIL];
        if (!slot_index(self, tail)) goto unlock_slow;
        if (tail != s) {
            before = w[b + S_PREV];
            after = w[b + S_NEXT];
            if ((before != -1 && !slot_index(self, before)) || !slot_index(self, after))
                goto unlock_slow;
        }
    }
    if (flags & PIN || (flags & HIT && tail != s)) w[H_DIRTY] = self->pid; /* structure */
    if (flags & HIT) { /* lookup's counter, then _lru_touch */
        w[H_HITS] += 1;
        int64_t tick = w[H_TICK] + 1;
        w[H_TICK] = tick;
        w[b + S_TICK] = tick;
        if (tail != s) {
            if (before >= 0)
                w[self->sl + before * SLOT_WORDS + S_NEXT] = after;
            else
                w[H_LRU_HEAD] = after;
            w[self->sl + after * SLOT_WORDS + S_PREV] = before;
            w[b + S_PREV] = tail;
            w[b + S_NEXT] = -1;
            w[self->sl + tail * SLOT_WORDS + S_NEXT] = s;
            w[H_LRU_TAIL] = s;
        }
    }
    if (flags & PIN) { /* _pin_slot */
        if (r < 0) {
            r = -1 - r;
            p = self->pn + r * PIN_WORDS;
            w[H_PIN_FREE] = w[p + P_NEXT];
            w[p + P_SLOT] = s;
            w[p + P_PID] = self->pid;
            w[p + P_START] = self->start;
            w[p + P_NEXT] = w[b + S_PIN_HEAD];
            w[b + S_PIN_HEAD] = r;
            w[p + P_COUNT] = 1;
        } else {
            w[self->pn + r * PIN_WORDS + P_COUNT] += 1;
        }
        pins = w[b + S_PINS] + 1;
        w[b + S_PINS] = pins;
        if (pins == 1) w[H_EVICTABLE] -= w[b + S_BLOCKS];
    } else {
        pins = w[b + S_PINS];
    }
    w[H_DIRTY] = 0;
    if (pthread_mutex_unlock(mx)) {
        PyBuffer_Release(&buf);
        Py_DECREF(entry);
        PyErr_SetString(PyExc_RuntimeError,
                        "ecoffload: the shared catalog's mutex would not unlock after a native "
                        "hit (a bug: this thread held it)");
        return NULL;
    }
    PyBuffer_Release(&buf);
    if (flags & HIT) self->hits++;
    if (flags & PIN) self->pins++;
    pins_obj = PyLong_FromLongLong(pins);
    if (pins_obj == NULL || PyObject_SetAttr(entry, s_pins, pins_obj)) {
        Py_XDECREF(pins_obj);
        Py_DECREF(entry);
        return NULL;
    }
    Py_DECREF(pins_obj);
    return entry;
unlock_slow:
    pthread_mutex_unlock(mx);
    PyBuffer_Release(&buf);
    Py_DECREF(entry);
    return slow(self);
}

static PyObject *hp_hit(HitPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hit(key, pin) takes two arguments");
        return NULL;
    }
    int pin = PyObject_IsTrue(args[1]);
    if (pin < 0) return NULL;
    return hit_or_pin(self, args[0], pin ? HIT | PIN : HIT);
}

static PyObject *hp_pin(HitPath *self, PyObject *key) { return hit_or_pin(self, key, PIN); }

/* unpin_many: all or nothing; each distinct slot in the order of its first key. */
static PyObject *hp_unpin(HitPath *self, PyObject *keys) {
    int64_t slots[MAX_BATCH], gens[MAX_BATCH], ds[MAX_BATCH], dn[MAX_BATCH], dr[MAX_BATCH],
        dprev[MAX_BATCH];
    Py_ssize_t n, i, j, d = 0;
    PyObject *seq, *entry;
    Py_buffer buf;
    pthread_mutex_t *mx;
    int64_t *w;
    int rc;
    if (hook_set(self)) return slow(self);
    seq = PySequence_Fast(keys, "unpin(keys) takes a list or tuple of keys");
    if (seq == NULL) return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0 || n > MAX_BATCH) {
        Py_DECREF(seq);
        return slow(self);
    }
    for (i = 0; i < n; i++) {
        entry = seen_ready(self, PySequence_Fast_GET_ITEM(seq, i), 0, &slots[i], &gens[i]);
        if (entry == NULL) {
            Py_DECREF(seq);
            return PyErr_Occurred() ? NULL : slow(self);
        }
        Py_DECREF(entry);
    }
    Py_DECREF(seq);
    rc = lock_words(self, &buf, &w, &mx);
    if (rc != LOCKED) return not_locked(self, rc);
    for (i = 0; i < n; i++) { /* still the reservation seen, still READY? */
        int64_t b = self->sl + slots[i] * SLOT_WORDS;
        if (w[b + S_GEN] != gens[i] || w[b + S_STATE] != READY) goto unlock_slow;
        for (j = 0; j < d && ds[j] != slots[i]; j++)
            ;
        if (j == d) {
            ds[d] = slots[i];
            dn[d++] = 0;
        }
        dn[j]++;
    }
    int64_t evictable = w[H_EVICTABLE];
    for (j = 0; j < d; j++) { /* enough pins of ours for all? (nothing written yet) */
        int64_t r = my_record(self, w, self->sl + ds[j] * SLOT_WORDS, &dprev[j]);
        if (r < 0 || dn[j] > w[self->pn + r * PIN_WORDS + P_COUNT]) goto unlock_slow;
        /* What the writes below compute, checked first: no wrap (Python raises there). */
        int64_t b = self->sl + ds[j] * SLOT_WORDS, pins;
        if (__builtin_sub_overflow(w[b + S_PINS], dn[j], &pins) ||
            (pins == 0 && __builtin_add_overflow(evictable, w[b + S_BLOCKS], &evictable)))
            goto unlock_slow;
        dr[j] = r;
    }
    w[H_DIRTY] = self->pid;
    for (j = 0; j < d; j++) { /* _unpin_slot dn[j] times */
        int64_t b = self->sl + ds[j] * SLOT_WORDS, r = dr[j], p = self->pn + r * PIN_WORDS;
        int64_t count = w[p + P_COUNT] - dn[j], pins = w[b + S_PINS] - dn[j];
        w[p + P_COUNT] = count;
        w[b + S_PINS] = pins;
        if (count == 0) { /* the record back to the free list */
            if (dprev[j] < 0)
                w[b + S_PIN_HEAD] = w[p + P_NEXT];
            else
                w[self->pn + dprev[j] * PIN_WORDS + P_NEXT] = w[p + P_NEXT];
            w[p + P_NEXT] = w[H_PIN_FREE];
            w[H_PIN_FREE] = r;
        }
        if (pins == 0) w[H_EVICTABLE] += w[b + S_BLOCKS];
    }
    w[H_DIRTY] = 0;
    if (pthread_mutex_unlock(mx)) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_RuntimeError,
                        "ecoffload: the shared catalog's mutex would not unlock after a native "
                        "unpin (a bug: this thread held it)");
        return NULL;
    }
    PyBuffer_Release(&buf);
    self->unpins += n;
    Py_RETURN_TRUE;
unlock_slow:
    pthread_mutex_unlock(mx);
    PyBuffer_Release(&buf);
    return slow(self);
}

static PyObject *hp_identify(HitPath *self, PyObject *args) {
    long long pid, start;
    if (!PyArg_ParseTuple(args, "LL:identify", &pid, &start)) return NULL;
    self->pid = pid;
    self->start = start;
    Py_RETURN_NONE;
}

static int hp_init(HitPath *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"words", "seen", "ready", "fault_points", "slots_at", "pins_at",
                            "max_items", "max_pins", "pid", "start", NULL};
    PyObject *words, *seen, *ready, *fault_points, *faults;
    long long sl, pn, max_items, max_pins, pid, start;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOLLLLLL:HitPath", names, &words,
                                     &PyDict_Type, &seen, &ready, &fault_points, &sl, &pn,
                                     &max_items, &max_pins, &pid, &start))
        return -1;
    if (!PyMemoryView_Check(words) || PyMemoryView_GET_BUFFER(words)->readonly ||
        sl < HEADER_WORDS || pn < sl || max_items <= 0 ||
        max_pins <= 0 || max_items > (1LL << 40) || max_pins > (1LL << 40) || pn > (1LL << 50)) {
        PyErr_SetString(PyExc_ValueError,
                        "HitPath: expected the catalog's writable memoryview and its layout (word "
                        "offsets past the header, positive sizes)");
        return -1;
    }
    faults = PyModule_GetDict(fault_points);
    if (faults == NULL) return -1;
    Py_INCREF(words);
    Py_XSETREF(self->words, words);
    Py_INCREF(seen);
    Py_XSETREF(self->seen, seen);
    Py_INCREF(ready);
    Py_XSETREF(self->ready, ready);
    Py_INCREF(faults);
    Py_XSETREF(self->faults, faults);
    self->sl = sl;
    self->pn = pn;
    self->max_items = max_items;
    self->max_pins = max_pins;
    self->pid = pid;
    self->start = start;
    /* The pin records end the words it touches; the slots lie below them. */
    self->need_words = pn + max_pins * PIN_WORDS;
    if (sl + max_items * SLOT_WORDS > pn) {
        PyErr_SetString(PyExc_ValueError, "HitPath: the slots overlap the pin records");
        return -1;
    }
    return 0;
}

static void hp_dealloc(HitPath *self) {
    Py_XDECREF(self->words);
    Py_XDECREF(self->seen);
    Py_XDECREF(self->ready);
    Py_XDECREF(self->faults);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef hp_methods[] = {
    {"hit", (PyCFunction)(void (*)(void))hp_hit, METH_FASTCALL,
     "lookup(key, pin=pin) of a seen READY item: the entry, or an int (see the C file)."},
    {"pin", (PyCFunction)hp_pin, METH_O,
     "pin(key) of a seen READY item: the entry, or an int (see the C file)."},
    {"unpin", (PyCFunction)hp_unpin, METH_O,
     "unpin_many(keys) of seen READY items: True, or an int (see the C file)."},
    {"identify", (PyCFunction)hp_identify, METH_VARARGS, "identify(pid, start): who pins."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef hp_members[] = {
    {"hits", T_ULONGLONG, offsetof(HitPath, hits), READONLY, "hits served here"},
    {"pins", T_ULONGLONG, offsetof(HitPath, pins), READONLY, "pins served here"},
    {"unpins", T_ULONGLONG, offsetof(HitPath, unpins), READONLY, "keys unpinned here"},
    {"slow", T_ULONGLONG, offsetof(HitPath, slow), READONLY, "calls sent the Python way"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HitPathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ecoffload.engine.catalog.shared._catalog_native.HitPath",
    .tp_basicsize = sizeof(HitPath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The shared catalog's hit, pin and unpin fast paths (see the C file).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hp_init,
    .tp_dealloc = (destructor)hp_dealloc,
    .tp_methods = hp_methods,
    .tp_members = hp_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ecoffload.engine.catalog.shared._catalog_native",
                                    NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__catalog_native(void) {
    PyObject *m, *layout;
    s_slot = PyUnicode_InternFromString("slot");
    s_generation = PyUnicode_InternFromString("generation");
    s_state = PyUnicode_InternFromString("state");
    s_pins = PyUnicode_InternFromString("pins");
    s_hook = PyUnicode_InternFromString("hook");
    if (!s_slot || !s_generation || !s_state || !s_pins || !s_hook) return NULL;
    if (PyType_Ready(&HitPathType) < 0) return NULL;
    m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    layout = Py_BuildValue(
        "{sisisisisisisisisisisisisisisisisisisisisisisisi}", "H_DIRTY", H_DIRTY, "H_TICK", H_TICK,
        "H_LRU_HEAD", H_LRU_HEAD, "H_LRU_TAIL", H_LRU_TAIL, "H_PIN_FREE", H_PIN_FREE,
        "H_EVICTABLE", H_EVICTABLE, "H_HITS", H_HITS, "S_STATE", S_STATE, "S_GEN", S_GEN,
        "S_PREV", S_PREV, "S_NEXT", S_NEXT, "S_TICK", S_TICK, "S_PINS", S_PINS, "S_PIN_HEAD",
        S_PIN_HEAD, "S_BLOCKS", S_BLOCKS, "P_SLOT", P_SLOT, "P_NEXT", P_NEXT, "P_PID", P_PID,
        "P_START", P_START, "P_COUNT", P_COUNT, "SLOT_WORDS", SLOT_WORDS, "PIN_WORDS", PIN_WORDS,
        "MUTEX_AT", MUTEX_AT, "READY", READY);
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout)) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&HitPathType);
    if (PyModule_AddObject(m, "HitPath", (PyObject *)&HitPathType)) {
        Py_DECREF(&HitPathType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
