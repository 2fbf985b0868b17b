/*
 * no_entry.c - a broken plugin for the loader's tests: a shared library with functions (one
 * with a near-miss name) but no `ferry_transport_plugin_entry`. A host must refuse it
 * (FERRY_E_PLUGIN, error kind `plugin`) and say which symbol is missing.
 *
 *   cc -shared -fPIC -Wall -Werror -I ffi/include -o libferry_transport_noentry.so no_entry.c
 */
#include "ferry_abi.h"

const char *ferry_transport_protocol(void);
const FerryPluginApi *ferry_transport_plugin_entry_v0(uint32_t host_abi_major, uint32_t host_abi_minor);

const char *ferry_transport_protocol(void) { return "noentry"; }

const FerryPluginApi *ferry_transport_plugin_entry_v0(uint32_t host_abi_major, uint32_t host_abi_minor) {
    (void)host_abi_major;
    (void)host_abi_minor;
    return NULL;
}
