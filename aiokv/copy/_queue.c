/* Queue one copy plan's layers on the copy streams in one call, without the GIL.
 *
 * The Python copier would otherwise make one driver call per (layer, stream) and per
 * (run, layer), and one per event, each taking and giving back the GIL: beside a model
 * whose thread launches kernels, every hand-back is a wait for the model's thread.
 * Here the whole range of layers is one call: the driver's entry points and the plan's
 * arrays come in a struct (aiokv/copy/queueing.py: QueueArgs, the same layout), the
 * GIL is released around the loop, and a failed driver call is written back into the
 * struct for Python to name.
 *
 * No CUDA header: the entry points are the driver's, found by Python (cuGetProcAddress)
 * and passed as addresses; the types below are the driver ABI's (cuda.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct { /* CUDA_MEMCPY2D */
    size_t srcXInBytes, srcY;
    unsigned int srcMemoryType;
    const void *srcHost;
    uint64_t srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    unsigned int dstMemoryType;
    void *dstHost;
    uint64_t dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} Memcpy2D;

#define CU_MEMORYTYPE_UNIFIED 4

typedef int (*batch_fn)(void *dsts, void *srcs, void *sizes, size_t count, void *attrs,
                        size_t *attr_idxs, size_t num_attrs, size_t *fail_idx, void *stream);
typedef int (*copy2d_fn)(const Memcpy2D *op, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned int flags);
typedef int (*sync_fn)(void *event);

enum { FAIL_NONE = 0, FAIL_WAIT = 1, FAIL_BATCH = 2, FAIL_2D = 3, FAIL_RECORD = 4, FAIL_SYNC = 5 };

typedef struct { /* QueueArgs in queueing.py: keep the two in step */
    batch_fn batch;
    copy2d_fn copy2d;
    record_fn record;
    wait_fn wait;
    void *attrs;            /* one CUmemcpyAttributes for every copy */
    uint64_t *streams;      /* [n_streams] CUstream */
    int64_t n_streams;
    uint64_t ready;         /* an event every stream waits for first; 0: none */
    int64_t first_layer, last_layer, layers;
    uint64_t *dsts, *srcs;  /* [layers, positions] */
    uint64_t *sizes;        /* [positions] */
    int64_t positions;
    int64_t *bounds;        /* [n_streams + 1]: stream s moves positions bounds[s]:bounds[s+1] */
    uint64_t *run_dsts, *run_srcs; /* [layers, n_runs] */
    int64_t *heights, *stream_of;  /* [n_runs] */
    int64_t n_runs;
    uint64_t width, src_pitch, dst_pitch;
    uint64_t *layer_events; /* [layers, n_streams], recorded after each layer; NULL: none */
    uint64_t *end_events;   /* [n_streams], recorded after last_layer; NULL: none */
    int64_t barrier;        /* each stream starts a layer once every stream did the one before */
    sync_fn sync;           /* cuEventSynchronize, for ahead */
    int64_t ahead;          /* > 0: layer L is queued once layer L - ahead ran (layer_events) */
    /* out: the call that failed */
    int64_t err, fail_kind, fail_layer, fail_stream, fail_index;
    uint64_t fail_copy;
} QueueArgs;

static int fail(QueueArgs *a, int err, int64_t kind, int64_t layer, int64_t s, int64_t index) {
    a->err = err;
    a->fail_kind = kind;
    a->fail_layer = layer;
    a->fail_stream = s;
    a->fail_index = index;
    return err;
}

static int queue_layers(QueueArgs *a) {
    size_t attr_index = 0;
    Memcpy2D op;
    memset(&op, 0, sizeof op);
    op.srcMemoryType = op.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
    op.WidthInBytes = a->width;
    op.srcPitch = a->src_pitch;
    op.dstPitch = a->dst_pitch;
    a->err = 0;
    a->fail_kind = FAIL_NONE;
    for (int64_t s = 0; s < a->n_streams && a->ready; s++) {
        void *stream = (void *)(uintptr_t)a->streams[s];
        int err = a->wait(stream, (void *)(uintptr_t)a->ready, 0);
        if (err) return fail(a, err, FAIL_WAIT, a->first_layer, s, 0);
    }
    for (int64_t layer = a->first_layer; layer < a->last_layer; layer++) {
        uint64_t *dsts = a->dsts + layer * a->positions;
        uint64_t *srcs = a->srcs + layer * a->positions;
        /* Paced: the copy engines run one direction's copies in the order given, across
         * streams, so a model's own small copy to the host waits for every byte queued
         * before it. Queued no further ahead than `ahead` layers, a job keeps
         * that wait to a few layers' bytes, not a whole job's (or two). The host waits
         * here, in C, without the GIL. */
        for (int64_t s = 0; s < a->n_streams && a->ahead > 0 && layer - a->ahead >= 0; s++) {
            void *done = (void *)(uintptr_t)a->layer_events[(layer - a->ahead) * a->n_streams + s];
            int err = a->sync(done);
            if (err) return fail(a, err, FAIL_SYNC, layer - a->ahead, s, 0);
        }
        for (int64_t s = 0; s < a->n_streams; s++) {
            void *stream = (void *)(uintptr_t)a->streams[s];
            /* A marked load keeps its layers in order across the streams: each stream
             * starts a layer once every stream has done the one before. Unbarriered, the
             * copy engines drain one stream's layers before another's layer 0 (measured on
             * the H200: layer 0 in place after three quarters of the whole load). */
            for (int64_t t = 0; t < a->n_streams && a->barrier && layer > 0; t++) {
                if (t == s) continue;
                void *before = (void *)(uintptr_t)a->layer_events[(layer - 1) * a->n_streams + t];
                int err = a->wait(stream, before, 0);
                if (err) return fail(a, err, FAIL_WAIT, layer, s, t);
            }
            int64_t lo = a->bounds[s], count = a->bounds[s + 1] - lo;
            if (count > 0) {
                size_t failed = SIZE_MAX;
                int err = a->batch(dsts + lo, srcs + lo, a->sizes + lo, (size_t)count, a->attrs,
                                   &attr_index, 1, &failed, stream);
                if (err) {
                    a->fail_copy = failed;
                    return fail(a, err, FAIL_BATCH, layer, s, lo);
                }
            }
            for (int64_t r = 0; r < a->n_runs; r++) {
                if (a->stream_of[r] != s) continue;
                op.dstDevice = a->run_dsts[layer * a->n_runs + r];
                op.srcDevice = a->run_srcs[layer * a->n_runs + r];
                op.Height = (size_t)a->heights[r];
                int err = a->copy2d(&op, stream);
                if (err) return fail(a, err, FAIL_2D, layer, s, r);
            }
            if (a->layer_events) {
                void *event = (void *)(uintptr_t)a->layer_events[layer * a->n_streams + s];
                int err = a->record(event, stream);
                if (err) return fail(a, err, FAIL_RECORD, layer, s, 0);
            }
        }
    }
    for (int64_t s = 0; s < a->n_streams && a->end_events; s++) {
        int err = a->record((void *)(uintptr_t)a->end_events[s],
                            (void *)(uintptr_t)a->streams[s]);
        if (err) return fail(a, err, FAIL_RECORD, a->last_layer, s, 0);
    }
    return 0;
}

static PyObject *run(PyObject *self, PyObject *address) {
    QueueArgs *a = (QueueArgs *)PyLong_AsVoidPtr(address);
    if (a == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null QueueArgs address");
        return NULL;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = queue_layers(a);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"run", run, METH_O,
     "run(address) -> the driver's error (0: every copy and event queued); the QueueArgs "
     "at address say which call failed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiokv.copy._queue",
    "Queues a copy plan's layers on the copy streams in one call, without the GIL.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__queue(void) { return PyModule_Create(&module); }
