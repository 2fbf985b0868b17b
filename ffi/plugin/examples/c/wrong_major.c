/*
 * wrong_major.c - a broken plugin for the loader's tests: its table declares ABI major version
 * FERRY_PLUGIN_ABI_MAJOR + 1, and its entry returns the table whatever the host asks for.
 * A host must refuse it (FERRY_E_PLUGIN, error kind `plugin`) without calling any function.
 *
 *   cc -shared -fPIC -Wall -Werror -I ffi/include -o libferry_transport_wrongmajor.so wrong_major.c
 */
#include "ferry_abi.h"

static int32_t wm_create(const FerryHostServices *host, const char *segment_name, const char *config_json,
                         FerryPluginInstance **out) {
    (void)host;
    (void)segment_name;
    (void)config_json;
    (void)out;
    return FERRY_E_UNSUPPORTED;
}

static void wm_instance(FerryPluginInstance *instance) { (void)instance; }

static int32_t wm_publish(FerryPluginInstance *instance, const char *descriptor_json, FerryPublishFn sink,
                          void *sink_ctx) {
    (void)instance;
    (void)descriptor_json;
    (void)sink;
    (void)sink_ctx;
    return FERRY_E_UNSUPPORTED;
}

static int32_t wm_register(FerryPluginInstance *instance, uint64_t addr, uint64_t length, const char *location) {
    (void)instance;
    (void)addr;
    (void)length;
    (void)location;
    return FERRY_E_UNSUPPORTED;
}

static int32_t wm_unregister(FerryPluginInstance *instance, uint64_t addr, uint64_t length) {
    (void)instance;
    (void)addr;
    (void)length;
    return FERRY_E_UNSUPPORTED;
}

static int32_t wm_open_target(FerryPluginInstance *instance, const char *descriptor_json, FerryPluginTarget **out) {
    (void)instance;
    (void)descriptor_json;
    (void)out;
    return FERRY_E_UNSUPPORTED;
}

static void wm_close_target(FerryPluginInstance *instance, FerryPluginTarget *target) {
    (void)instance;
    (void)target;
}

static int32_t wm_submit(FerryPluginInstance *instance, FerryPluginTarget *target,
                         const FerryTransferRequest *requests, size_t count, FerryPluginBatch **out) {
    (void)instance;
    (void)target;
    (void)requests;
    (void)count;
    (void)out;
    return FERRY_E_UNSUPPORTED;
}

static int32_t wm_poll(FerryPluginInstance *instance, FerryPluginBatch *batch, FerryTransferStatus *statuses,
                       size_t count) {
    (void)instance;
    (void)batch;
    (void)statuses;
    (void)count;
    return FERRY_E_UNSUPPORTED;
}

static void wm_batch(FerryPluginInstance *instance, FerryPluginBatch *batch) {
    (void)instance;
    (void)batch;
}

static size_t wm_batch_error(FerryPluginInstance *instance, FerryPluginBatch *batch, size_t index, char *buffer,
                             size_t capacity) {
    (void)instance;
    (void)batch;
    (void)index;
    if (buffer && capacity > 0) buffer[0] = '\0';
    return 0;
}

static const FerryPluginApi api = {
    .struct_size = sizeof(FerryPluginApi),
    .abi_major = FERRY_PLUGIN_ABI_MAJOR + 1,
    .abi_minor = 0,
    .protocol = "wrongmajor",
    .capabilities = FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY,
    .create = wm_create,
    .shutdown = wm_instance,
    .destroy = wm_instance,
    .publish = wm_publish,
    .register_memory = wm_register,
    .unregister_memory = wm_unregister,
    .open_target = wm_open_target,
    .close_target = wm_close_target,
    .submit = wm_submit,
    .poll = wm_poll,
    .cancel = wm_batch,
    .batch_error = wm_batch_error,
    .free_batch = wm_batch,
};

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
    /* Deliberately wrong: answers every host, whatever its version. */
    (void)host_abi_major;
    (void)host_abi_minor;
    return &api;
}
