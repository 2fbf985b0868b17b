/*
 * small_struct.c - a broken plugin for the loader's tests: its table declares struct_size 24,
 * smaller than the ABI 1.0 FerryPluginApi (FERRY_PLUGIN_API_V1_0_SIZE): it ends after
 * `protocol`, with no function at all. A host must read nothing past those 24 bytes and refuse
 * the plugin (FERRY_E_PLUGIN, error kind `plugin`).
 *
 *   cc -shared -fPIC -Wall -Werror -I ffi/include -o libferry_transport_smallstruct.so small_struct.c
 */
#include "ferry_abi.h"

/* The first fields of FerryPluginApi, and nothing after them. */
struct SmallTable {
    uint64_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
    const char *protocol;
};

_Static_assert(sizeof(struct SmallTable) == 24, "the short table is 24 bytes");
_Static_assert(sizeof(struct SmallTable) < FERRY_PLUGIN_API_V1_0_SIZE, "shorter than any 1.x table");

static const struct SmallTable table = {
    .struct_size = sizeof(struct SmallTable),
    .abi_major = FERRY_PLUGIN_ABI_MAJOR,
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .protocol = "smallstruct",
};

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
    (void)host_abi_minor;
    /* The host reads it through a FerryPluginApi pointer, but only struct_size bytes of it. */
    return host_abi_major == FERRY_PLUGIN_ABI_MAJOR ? (const FerryPluginApi *)(const void *)&table : NULL;
}
