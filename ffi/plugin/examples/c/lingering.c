/*
 * lingering.c - a test plugin whose requests never finish on their own and, once cancelled,
 * stay pending for LINGER_MS more, as a transport still finishing a DMA would. It touches no
 * memory. The host must report the timeout to the caller at once but keep the memory leased
 * (and the plugin batch alive) until the plugin lets go of the requests.
 *
 * Built against the ABI 1.0 header (-I ffi/plugin/examples/c/abi-1.0) it is polled: poll reports the
 * requests pending until LINGER_MS after the cancel. Built against ABI 1.1 (-I ffi/include) it
 * takes the host's completion callback: the cancel starts a thread that reports the requests
 * cancelled LINGER_MS later, long after the host gave up on them. -DPROTOCOL='"name"' builds a
 * copy serving another protocol.
 *
 *   cc -shared -fPIC -Wall -Werror -I ffi/include -o libferry_transport_lingering.so lingering.c -lpthread
 */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "ferry_abi.h"

#if FERRY_PLUGIN_ABI_MINOR >= 1
#include <pthread.h>
#endif

#ifndef PROTOCOL
#define PROTOCOL "lingering"
#endif
#define LINGER_MS 300

struct FerryPluginInstance {
#if FERRY_PLUGIN_ABI_MINOR >= 1
    FerryCompletionFn sink; /* the host's completion callback (NULL: the host polls) */
    void *sink_ctx;
    pthread_mutex_t lock;   /* guards reporters */
    pthread_cond_t idle;    /* signalled when reporters drops to 0 */
    int reporters;          /* report threads still running: destroy waits for them */
#else
    int unused;
#endif
};
struct FerryPluginTarget { int unused; };
struct FerryPluginBatch {
    FerryPluginInstance *inst;
    size_t count;
    _Atomic long long cancelled_at_ms; /* 0 until cancel */
};

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int32_t l_create(const FerryHostServices *host, const char *name, const char *config,
                        FerryPluginInstance **out) {
    (void)host; (void)name; (void)config;
    if (!out) return FERRY_E_INVALID_ARGUMENT;
    FerryPluginInstance *inst = calloc(1, sizeof(FerryPluginInstance));
    if (!inst) return FERRY_E_INTERNAL;
#if FERRY_PLUGIN_ABI_MINOR >= 1
    pthread_mutex_init(&inst->lock, NULL);
    pthread_cond_init(&inst->idle, NULL);
#endif
    *out = inst;
    return FERRY_OK;
}
static void l_destroy(FerryPluginInstance *inst) {
    if (!inst) return;
#if FERRY_PLUGIN_ABI_MINOR >= 1
    /* The host's callback must not be called after destroy returns: wait for the reporters. */
    pthread_mutex_lock(&inst->lock);
    while (inst->reporters > 0) pthread_cond_wait(&inst->idle, &inst->lock);
    pthread_mutex_unlock(&inst->lock);
    pthread_cond_destroy(&inst->idle);
    pthread_mutex_destroy(&inst->lock);
#endif
    free(inst);
}
static int32_t l_open(FerryPluginInstance *inst, const char *desc, FerryPluginTarget **out) {
    (void)inst; (void)desc;
    if (!out) return FERRY_E_INVALID_ARGUMENT;
    *out = calloc(1, sizeof(FerryPluginTarget));
    return *out ? FERRY_OK : FERRY_E_INTERNAL;
}
static void l_close(FerryPluginInstance *inst, FerryPluginTarget *t) { (void)inst; free(t); }
static int32_t l_submit(FerryPluginInstance *inst, FerryPluginTarget *t, const FerryTransferRequest *reqs,
                        size_t count, FerryPluginBatch **out) {
    (void)t; (void)reqs;
    if (!out) return FERRY_E_INVALID_ARGUMENT;
    FerryPluginBatch *b = calloc(1, sizeof(FerryPluginBatch));
    if (!b) return FERRY_E_INTERNAL;
    b->inst = inst;
    b->count = count;
    atomic_store(&b->cancelled_at_ms, 0);
    *out = b;
    return FERRY_OK;
}
static int32_t l_poll(FerryPluginInstance *inst, FerryPluginBatch *b, FerryTransferStatus *st, size_t count) {
    (void)inst;
    if (!b || (count && !st) || count != b->count) return FERRY_E_INVALID_ARGUMENT;
    long long at = atomic_load(&b->cancelled_at_ms);
    int done = at != 0 && now_ms() >= at + LINGER_MS;
    for (size_t i = 0; i < count; i++) {
        st[i].state = done ? FERRY_STATE_CANCELLED : FERRY_STATE_PENDING;
        st[i].code = done ? FERRY_E_CANCELLED : FERRY_OK;
        st[i].transferred = 0;
    }
    return done ? 0 : (int32_t)count;
}

#if FERRY_PLUGIN_ABI_MINOR >= 1
/* Sleeps LINGER_MS, then reports every request of the batch cancelled. */
static void *report_later(void *arg) {
    FerryPluginBatch *b = arg;
    FerryPluginInstance *inst = b->inst;
    size_t count = b->count;
    struct timespec linger = {LINGER_MS / 1000, (long)(LINGER_MS % 1000) * 1000000L};
    nanosleep(&linger, NULL);
    FerryTransferStatus cancelled = {FERRY_STATE_CANCELLED, FERRY_E_CANCELLED, 0};
    for (size_t i = 0; i < count; i++)
        inst->sink(inst->sink_ctx, b, i, &cancelled, "cancelled, let go after the linger");
    /* The host may have freed the batch by now: only the instance is used below. */
    pthread_mutex_lock(&inst->lock);
    if (--inst->reporters == 0) pthread_cond_broadcast(&inst->idle);
    pthread_mutex_unlock(&inst->lock);
    return NULL;
}

static int32_t l_set_completion_sink(FerryPluginInstance *inst, FerryCompletionFn sink, void *ctx) {
    if (!inst || !sink) return FERRY_E_INVALID_ARGUMENT;
    inst->sink = sink;
    inst->sink_ctx = ctx;
    return FERRY_OK;
}
#endif

static void l_cancel(FerryPluginInstance *inst, FerryPluginBatch *b) {
    long long expected = 0;
    if (!b || !atomic_compare_exchange_strong(&b->cancelled_at_ms, &expected, now_ms())) return;
#if FERRY_PLUGIN_ABI_MINOR >= 1
    if (inst && inst->sink) {
        pthread_mutex_lock(&inst->lock);
        inst->reporters++;
        pthread_mutex_unlock(&inst->lock);
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int started = pthread_create(&thread, &attr, report_later, b) == 0;
        pthread_attr_destroy(&attr);
        if (!started) {
            /* No thread: report at once (cancel must not block). */
            pthread_mutex_lock(&inst->lock);
            inst->reporters--;
            pthread_mutex_unlock(&inst->lock);
            FerryTransferStatus cancelled = {FERRY_STATE_CANCELLED, FERRY_E_CANCELLED, 0};
            for (size_t i = 0, n = b->count; i < n; i++) inst->sink(inst->sink_ctx, b, i, &cancelled, NULL);
        }
    }
#else
    (void)inst;
#endif
}
static void l_free(FerryPluginInstance *inst, FerryPluginBatch *b) { (void)inst; free(b); }

static const FerryPluginApi table = {
    .struct_size = sizeof(FerryPluginApi),
    .abi_major = FERRY_PLUGIN_ABI_MAJOR,
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .protocol = PROTOCOL,
    .capabilities = FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY,
    .create = l_create,
    .destroy = l_destroy,
    .open_target = l_open,
    .close_target = l_close,
    .submit = l_submit,
    .poll = l_poll,
    .cancel = l_cancel,
    .free_batch = l_free,
#if FERRY_PLUGIN_ABI_MINOR >= 1
    .set_completion_sink = l_set_completion_sink,
#endif
};

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
    (void)host_abi_minor;
    return host_abi_major == FERRY_PLUGIN_ABI_MAJOR ? &table : NULL;
}
