/*
 * unruly.c - a test plugin that breaks the completion-callback rules of ABI 1.1 in every way a
 * host can detect, around one correct report per request. It moves no bytes: each request is
 * reported completed. In submit, after storing the batch in *out, it reports
 *   - request `count` (an index outside the batch),
 *   - request 0 with a null status, and with state FERRY_STATE_PENDING,
 *   - every request once, correctly,
 *   - request 0 a second time;
 * and, before allocating a new batch, request 0 of the batch it returned last time (which the
 * host has freed since: a report for a batch the host does not know). The host must log each
 * violation, ignore it, and complete the batch from the correct reports.
 *
 * Without the host's completion callback it has nothing to offer: poll reports every request
 * completed.
 *
 *   cc -shared -fPIC -Wall -Werror -I ffi/include -o libferry_transport_unruly.so unruly.c
 */
#include <stdlib.h>

#include "ferry_abi.h"

struct FerryPluginInstance {
    FerryCompletionFn sink; /* the host's completion callback (NULL: the host polls) */
    void *sink_ctx;
    FerryPluginBatch *previous; /* the batch submit returned last (freed by the host since) */
};
struct FerryPluginTarget { int unused; };
struct FerryPluginBatch { size_t count; };

static int32_t u_create(const FerryHostServices *host, const char *name, const char *config,
                        FerryPluginInstance **out) {
    (void)host; (void)name; (void)config;
    if (!out) return FERRY_E_INVALID_ARGUMENT;
    *out = calloc(1, sizeof(FerryPluginInstance));
    return *out ? FERRY_OK : FERRY_E_INTERNAL;
}
static void u_destroy(FerryPluginInstance *inst) { free(inst); }
static int32_t u_set_completion_sink(FerryPluginInstance *inst, FerryCompletionFn sink, void *ctx) {
    if (!inst || !sink) return FERRY_E_INVALID_ARGUMENT;
    inst->sink = sink;
    inst->sink_ctx = ctx;
    return FERRY_OK;
}
static int32_t u_open(FerryPluginInstance *inst, const char *desc, FerryPluginTarget **out) {
    (void)inst; (void)desc;
    if (!out) return FERRY_E_INVALID_ARGUMENT;
    *out = calloc(1, sizeof(FerryPluginTarget));
    return *out ? FERRY_OK : FERRY_E_INTERNAL;
}
static void u_close(FerryPluginInstance *inst, FerryPluginTarget *t) { (void)inst; free(t); }
static int32_t u_submit(FerryPluginInstance *inst, FerryPluginTarget *t, const FerryTransferRequest *reqs,
                        size_t count, FerryPluginBatch **out) {
    (void)t;
    if (!inst || !out || !reqs || count == 0) return FERRY_E_INVALID_ARGUMENT;
    FerryTransferStatus completed = {FERRY_STATE_COMPLETED, FERRY_OK, 0};
    FerryTransferStatus pending = {FERRY_STATE_PENDING, FERRY_OK, 0};
    /* The previous batch is freed: reported before a new one is allocated at its address. */
    if (inst->sink && inst->previous) inst->sink(inst->sink_ctx, inst->previous, 0, &completed, NULL);
    FerryPluginBatch *b = calloc(1, sizeof(FerryPluginBatch));
    if (!b) return FERRY_E_INTERNAL;
    b->count = count;
    *out = b;
    inst->previous = b;
    if (!inst->sink) return FERRY_OK;
    inst->sink(inst->sink_ctx, b, count, &completed, NULL);
    inst->sink(inst->sink_ctx, b, 0, NULL, NULL);
    inst->sink(inst->sink_ctx, b, 0, &pending, NULL);
    for (size_t i = 0; i < count; i++) {
        completed.transferred = reqs[i].length;
        inst->sink(inst->sink_ctx, b, i, &completed, NULL);
    }
    inst->sink(inst->sink_ctx, b, 0, &completed, "once more");
    return FERRY_OK;
}
static int32_t u_poll(FerryPluginInstance *inst, FerryPluginBatch *b, FerryTransferStatus *st, size_t count) {
    (void)inst;
    if (!b || !st || count != b->count) return FERRY_E_INVALID_ARGUMENT;
    for (size_t i = 0; i < count; i++) st[i] = (FerryTransferStatus){FERRY_STATE_COMPLETED, FERRY_OK, 0};
    return 0;
}
static void u_cancel(FerryPluginInstance *inst, FerryPluginBatch *b) { (void)inst; (void)b; }
static void u_free(FerryPluginInstance *inst, FerryPluginBatch *b) { (void)inst; free(b); }

static const FerryPluginApi table = {
    .struct_size = sizeof(FerryPluginApi),
    .abi_major = FERRY_PLUGIN_ABI_MAJOR,
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .protocol = "unruly",
    .capabilities = FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY,
    .create = u_create,
    .destroy = u_destroy,
    .open_target = u_open,
    .close_target = u_close,
    .submit = u_submit,
    .poll = u_poll,
    .cancel = u_cancel,
    .free_batch = u_free,
    .set_completion_sink = u_set_completion_sink,
};

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
    (void)host_abi_minor;
    return host_abi_major == FERRY_PLUGIN_ABI_MAJOR ? &table : NULL;
}
