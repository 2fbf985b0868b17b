/*
 * lingering.c - a test plugin whose requests never finish on their own and, once cancelled,
 * stay pending for LINGER_MS more, as a transport still finishing a DMA would. It touches no
 * memory. The host must report the timeout to the caller at once but keep the memory leased
 * (and the plugin batch alive) until poll stops reporting the requests pending.
 *
 *   cc -shared -fPIC -Wall -Werror -I ffi/include -o libferry_transport_lingering.so lingering.c
 */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "ferry_abi.h"

#define LINGER_MS 300

struct FerryPluginInstance { int unused; };
struct FerryPluginTarget { int unused; };
struct FerryPluginBatch {
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
    *out = calloc(1, sizeof(FerryPluginInstance));
    return *out ? FERRY_OK : FERRY_E_INTERNAL;
}
static void l_destroy(FerryPluginInstance *inst) { free(inst); }
static int32_t l_open(FerryPluginInstance *inst, const char *desc, FerryPluginTarget **out) {
    (void)inst; (void)desc;
    if (!out) return FERRY_E_INVALID_ARGUMENT;
    *out = calloc(1, sizeof(FerryPluginTarget));
    return *out ? FERRY_OK : FERRY_E_INTERNAL;
}
static void l_close(FerryPluginInstance *inst, FerryPluginTarget *t) { (void)inst; free(t); }
static int32_t l_submit(FerryPluginInstance *inst, FerryPluginTarget *t, const FerryTransferRequest *reqs,
                        size_t count, FerryPluginBatch **out) {
    (void)inst; (void)t; (void)reqs;
    if (!out) return FERRY_E_INVALID_ARGUMENT;
    FerryPluginBatch *b = calloc(1, sizeof(FerryPluginBatch));
    if (!b) return FERRY_E_INTERNAL;
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
static void l_cancel(FerryPluginInstance *inst, FerryPluginBatch *b) {
    (void)inst;
    long long expected = 0;
    if (b) atomic_compare_exchange_strong(&b->cancelled_at_ms, &expected, now_ms());
}
static void l_free(FerryPluginInstance *inst, FerryPluginBatch *b) { (void)inst; free(b); }

static const FerryPluginApi table = {
    .struct_size = sizeof(FerryPluginApi),
    .abi_major = FERRY_PLUGIN_ABI_MAJOR,
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .protocol = "lingering",
    .capabilities = FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY,
    .create = l_create,
    .destroy = l_destroy,
    .open_target = l_open,
    .close_target = l_close,
    .submit = l_submit,
    .poll = l_poll,
    .cancel = l_cancel,
    .free_batch = l_free,
};

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
    (void)host_abi_minor;
    return host_abi_major == FERRY_PLUGIN_ABI_MAJOR ? &table : NULL;
}
