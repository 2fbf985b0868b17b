/*
 * memcpy_plugin.c - a small, complete Ferry transport plugin written in C.
 *
 * Protocol "cmemcpy": moves bytes with memmove between engines of one process, like the Rust
 * `example` plugin. It is the worked example of docs/plugins.md ("Writing a plugin in C").
 *
 * Build:
 *   cc -shared -fPIC -Wall -Werror -I ffi/include \
 *      -o libferry_transport_cmemcpy.so ffi/plugin/examples/c/memcpy_plugin.c
 *
 * The same source builds against the ABI 1.0 header (-I ffi/plugin/examples/c/abi-1.0): the code for
 * the completion callback of ABI 1.1 is compiled only when the header declares it, so the
 * tests can load both builds and check that a plugin built against 1.0 is still polled.
 * -DPROTOCOL='"name"' builds a copy serving another protocol (one library per protocol is
 * loaded per process).
 *
 * Design, kept deliberately simple:
 * - every instance is listed in one process-wide table, by segment name;
 * - one mutex guards that table and every instance's list of registered regions, and is held
 *   while bytes are copied: a peer can then neither unregister its memory nor go away in the
 *   middle of a copy. (A fast plugin would use finer locks; correctness is the point here.)
 * - requests finish inside submit(), so poll() always reports 0 pending and cancel() has
 *   nothing to stop; with the host's completion callback (ABI 1.1), submit() reports each
 *   request to it before returning, and the host polls nothing.
 * Only this file's entry point is exported: every other function is static.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_abi.h"

#ifndef PROTOCOL
#define PROTOCOL "cmemcpy"
#endif
/* Descriptor field with the publishing instance's id (a restarted peer is recognised). */
#define INSTANCE_FIELD "cmemcpy_instance"

typedef struct Region {
    uint64_t addr;
    uint64_t length;
} Region;

/* The opaque types of ferry_abi.h are defined by the plugin. */
struct FerryPluginInstance {
    char *segment;       /* this instance's segment name */
    uint64_t id;         /* published as INSTANCE_FIELD */
    FerryLogFn log;      /* the host's log callback (NULL: none) */
    void *log_ctx;
    Region *regions;     /* registered memory; guarded by table_lock */
    size_t region_count;
    size_t region_capacity;
    bool listed;         /* in the table; guarded by table_lock */
    struct FerryPluginInstance *next;
#if FERRY_PLUGIN_ABI_MINOR >= 1
    FerryCompletionFn sink; /* the host's completion callback (NULL: the host polls) */
    void *sink_ctx;
#endif
};

struct FerryPluginTarget {
    char *name;          /* the peer's segment name */
    uint64_t instance;   /* the peer instance's id from its descriptor (0: not given) */
};

struct FerryPluginBatch {
    size_t count;
    FerryTransferStatus *statuses;
    char **errors;       /* per request: a message, or NULL */
};

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static FerryPluginInstance *table; /* live instances; guarded by table_lock */
static uint64_t next_id = 1;       /* guarded by table_lock */

/* ---- small helpers ---------------------------------------------------------------------- */

static char *copy_string(const char *s) {
    size_t n = strlen(s) + 1;
    char *copy = malloc(n);
    if (copy) memcpy(copy, s, n);
    return copy;
}

/* A newly allocated, formatted message (NULL when out of memory). */
static char *format_message(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return NULL;
    char *text = malloc((size_t)n + 1);
    if (!text) return NULL;
    va_start(ap, fmt);
    vsnprintf(text, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return text;
}

static void plugin_log(const FerryPluginInstance *inst, uint32_t level, const char *fmt, ...) {
    if (!inst->log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    inst->log(inst->log_ctx, level, line);
}

/* The instance serving `segment`, or NULL. Caller holds table_lock. */
static FerryPluginInstance *find_instance(const char *segment) {
    for (FerryPluginInstance *i = table; i; i = i->next)
        if (strcmp(i->segment, segment) == 0) return i;
    return NULL;
}

static void unlist(FerryPluginInstance *inst) { /* caller holds table_lock */
    if (!inst->listed) return;
    for (FerryPluginInstance **p = &table; *p; p = &(*p)->next) {
        if (*p == inst) {
            *p = inst->next;
            break;
        }
    }
    inst->listed = false;
}

/* Whether [addr, addr + length) lies inside one registered region. Caller holds table_lock. */
static bool registered(const FerryPluginInstance *inst, uint64_t addr, uint64_t length) {
    for (size_t i = 0; i < inst->region_count; i++) {
        const Region *r = &inst->regions[i];
        if (addr >= r->addr && addr - r->addr <= r->length && length <= r->length - (addr - r->addr)) return true;
    }
    return false;
}

/* ---- a minimal JSON reader: the top-level strings of a descriptor ------------------------ */

static void skip_ws(const char **p) {
    while (**p == ' ' || **p == '\t' || **p == '\n' || **p == '\r') (*p)++;
}

static bool parse_hex4(const char *s, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return false;
    }
    *out = v;
    return true;
}

/* Appends code point `cp` (< 0x10000) as UTF-8 at out + n (if out) and returns the new n. */
static size_t put_utf8(char *out, size_t n, unsigned cp) {
    unsigned char b[3];
    size_t len;
    if (cp < 0x80) {
        b[0] = (unsigned char)cp;
        len = 1;
    } else if (cp < 0x800) {
        b[0] = (unsigned char)(0xC0 | (cp >> 6));
        b[1] = (unsigned char)(0x80 | (cp & 0x3F));
        len = 2;
    } else {
        b[0] = (unsigned char)(0xE0 | (cp >> 12));
        b[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (unsigned char)(0x80 | (cp & 0x3F));
        len = 3;
    }
    if (out) memcpy(out + n, b, len);
    return n + len;
}

/*
 * Reads the JSON string at *p (its opening quote) and moves *p past it. With `out`, writes the
 * unescaped, NUL-terminated text there; it never needs more than strlen(*p) + 1 bytes.
 * Escaped surrogate pairs (\uD83D\uDE00) are refused: descriptor names do not use them.
 */
static bool parse_string(const char **p, char *out) {
    const char *s = *p;
    size_t n = 0;
    if (*s++ != '"') return false;
    for (;;) {
        unsigned char c = (unsigned char)*s++;
        if (c == '"') break;
        if (c < 0x20) return false; /* also the terminating NUL: unterminated string */
        if (c == '\\') {
            unsigned cp;
            switch (*s++) {
            case '"': c = '"'; break;
            case '\\': c = '\\'; break;
            case '/': c = '/'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u':
                if (!parse_hex4(s, &cp) || cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
                s += 4;
                n = put_utf8(out, n, cp);
                continue;
            default: return false;
            }
        }
        if (out) out[n] = (char)c;
        n++;
    }
    if (out) out[n] = '\0';
    *p = s;
    return true;
}

/* Skips one JSON value (nesting at most 64 deep). */
static bool skip_value(const char **p, int depth) {
    if (depth > 64) return false;
    skip_ws(p);
    char open = **p;
    if (open == '"') return parse_string(p, NULL);
    if (open == '{' || open == '[') {
        char close = open == '{' ? '}' : ']';
        (*p)++;
        skip_ws(p);
        if (**p == close) {
            (*p)++;
            return true;
        }
        for (;;) {
            if (open == '{') {
                skip_ws(p);
                if (!parse_string(p, NULL)) return false;
                skip_ws(p);
                if (*(*p)++ != ':') return false;
            }
            if (!skip_value(p, depth + 1)) return false;
            skip_ws(p);
            char c = *(*p)++;
            if (c == close) return true;
            if (c != ',') return false;
        }
    }
    /* A number, true, false or null (checked loosely: this reader only skips them). */
    size_t n = strspn(*p, "+-.0123456789eEaflnrstu");
    if (n == 0) return false;
    *p += n;
    return true;
}

/*
 * Reads the top-level "name" and "protocol" strings and the INSTANCE_FIELD number of a
 * segment descriptor. On success *name and *protocol are newly allocated.
 */
static int32_t read_descriptor(const char *json, char **name, char **protocol, uint64_t *instance) {
    int32_t status = FERRY_E_INVALID_ARGUMENT;
    const char *p = json;
    char *key = malloc(strlen(json) + 1);
    *name = *protocol = NULL;
    *instance = 0;
    if (!key) return FERRY_E_INTERNAL;
    skip_ws(&p);
    if (*p++ != '{') goto out;
    skip_ws(&p);
    if (*p == '}') {
        p++;
    } else {
        for (;;) {
            skip_ws(&p);
            if (!parse_string(&p, key)) goto out;
            skip_ws(&p);
            if (*p++ != ':') goto out;
            skip_ws(&p);
            char **slot = strcmp(key, "name") == 0 ? name : strcmp(key, "protocol") == 0 ? protocol : NULL;
            if (slot && *p == '"') {
                free(*slot); /* a repeated key: the last one counts */
                *slot = malloc(strlen(p) + 1);
                if (!*slot) {
                    status = FERRY_E_INTERNAL;
                    goto out;
                }
                if (!parse_string(&p, *slot)) goto out;
            } else if (strcmp(key, INSTANCE_FIELD) == 0 && *p >= '0' && *p <= '9') {
                char *end;
                *instance = strtoull(p, &end, 10);
                p = end;
            } else if (!skip_value(&p, 1)) {
                goto out;
            }
            skip_ws(&p);
            char c = *p++;
            if (c == '}') break;
            if (c != ',') goto out;
        }
    }
    skip_ws(&p);
    if (*p == '\0' && *name && **name && *protocol) status = FERRY_OK;
out:
    free(key);
    if (status != FERRY_OK) {
        free(*name);
        free(*protocol);
        *name = *protocol = NULL;
    }
    return status;
}

/* ---- the function table ----------------------------------------------------------------- */

static int32_t cm_create(const FerryHostServices *host, const char *segment_name, const char *config_json,
                         FerryPluginInstance **out) {
    if (!segment_name || !*segment_name || !config_json || !out) return FERRY_E_INVALID_ARGUMENT;
    /* This plugin has no settings; a real one would read them from config_json. */
    FerryPluginInstance *inst = calloc(1, sizeof *inst);
    if (!inst) return FERRY_E_INTERNAL;
    /* Read only the host fields its struct_size covers (an older host's struct may be shorter). */
    if (host) {
        if (host->struct_size >= offsetof(FerryHostServices, abi_minor) &&
            host->abi_major != FERRY_PLUGIN_ABI_MAJOR) {
            free(inst);
            return FERRY_E_INVALID_ARGUMENT;
        }
        if (host->struct_size >= offsetof(FerryHostServices, log) + sizeof(FerryLogFn)) {
            inst->log = host->log;
            inst->log_ctx = host->ctx;
        }
    }
    inst->segment = copy_string(segment_name);
    if (!inst->segment) {
        free(inst);
        return FERRY_E_INTERNAL;
    }
    pthread_mutex_lock(&table_lock);
    if (find_instance(segment_name)) {
        pthread_mutex_unlock(&table_lock);
        plugin_log(inst, FERRY_LOG_WARN, "cmemcpy: segment `%s` already has an instance in this process",
                   segment_name);
        free(inst->segment);
        free(inst);
        return FERRY_E_ALREADY_EXISTS;
    }
    inst->id = next_id++;
    inst->next = table;
    inst->listed = true;
    table = inst;
    pthread_mutex_unlock(&table_lock);
    plugin_log(inst, FERRY_LOG_INFO, "cmemcpy: instance %llu created for segment `%s`",
               (unsigned long long)inst->id, segment_name);
    *out = inst;
    return FERRY_OK;
}

static void cm_shutdown(FerryPluginInstance *inst) {
    if (!inst) return;
    /* Peers can no longer reach this instance. No batch is pending: they all finish in submit. */
    pthread_mutex_lock(&table_lock);
    unlist(inst);
    pthread_mutex_unlock(&table_lock);
}

static void cm_destroy(FerryPluginInstance *inst) {
    if (!inst) return;
    cm_shutdown(inst);
    free(inst->regions);
    free(inst->segment);
    free(inst);
}

static int32_t cm_publish(FerryPluginInstance *inst, const char *descriptor_json, FerryPublishFn sink,
                          void *sink_ctx) {
    if (!inst || !descriptor_json || !sink) return FERRY_E_INVALID_ARGUMENT;
    char value[24];
    snprintf(value, sizeof value, "%llu", (unsigned long long)inst->id);
    sink(sink_ctx, INSTANCE_FIELD, value); /* a JSON number */
    return FERRY_OK;
}

static int32_t cm_register_memory(FerryPluginInstance *inst, uint64_t addr, uint64_t length, const char *location) {
    if (!inst || !location || length == 0) return FERRY_E_INVALID_ARGUMENT;
    if (addr + length < addr) return FERRY_E_OUT_OF_BOUNDS;
    if (strncmp(location, "npu:", 4) == 0 || strncmp(location, "cuda:", 5) == 0) {
        plugin_log(inst, FERRY_LOG_WARN, "cmemcpy: moves host memory only, not %s", location);
        return FERRY_E_UNSUPPORTED;
    }
    int32_t status = FERRY_OK;
    pthread_mutex_lock(&table_lock);
    for (size_t i = 0; i < inst->region_count; i++) {
        const Region *r = &inst->regions[i];
        if (addr < r->addr + r->length && r->addr < addr + length) status = FERRY_E_ALREADY_EXISTS;
    }
    if (status == FERRY_OK && inst->region_count == inst->region_capacity) {
        size_t capacity = inst->region_capacity ? 2 * inst->region_capacity : 8;
        Region *grown = realloc(inst->regions, capacity * sizeof *grown);
        if (grown) {
            inst->regions = grown;
            inst->region_capacity = capacity;
        } else {
            status = FERRY_E_INTERNAL;
        }
    }
    if (status == FERRY_OK) inst->regions[inst->region_count++] = (Region){addr, length};
    pthread_mutex_unlock(&table_lock);
    return status;
}

static int32_t cm_unregister_memory(FerryPluginInstance *inst, uint64_t addr, uint64_t length) {
    if (!inst) return FERRY_E_INVALID_ARGUMENT;
    int32_t status = FERRY_E_NOT_FOUND;
    pthread_mutex_lock(&table_lock); /* waits for copies in progress: they hold the lock */
    for (size_t i = 0; i < inst->region_count; i++) {
        if (inst->regions[i].addr != addr) continue;
        if (inst->regions[i].length != length) {
            status = FERRY_E_INVALID_ARGUMENT;
        } else {
            inst->regions[i] = inst->regions[--inst->region_count];
            status = FERRY_OK;
        }
        break;
    }
    pthread_mutex_unlock(&table_lock);
    return status;
}

static int32_t cm_open_target(FerryPluginInstance *inst, const char *descriptor_json, FerryPluginTarget **out) {
    if (!inst || !descriptor_json || !out) return FERRY_E_INVALID_ARGUMENT;
    char *name, *protocol;
    uint64_t instance;
    int32_t status = read_descriptor(descriptor_json, &name, &protocol, &instance);
    if (status != FERRY_OK) {
        plugin_log(inst, FERRY_LOG_WARN, "cmemcpy: open_target: the descriptor is not a JSON object with a name");
        return status;
    }
    bool ours = strcmp(protocol, PROTOCOL) == 0;
    free(protocol);
    if (!ours) {
        free(name);
        return FERRY_E_UNSUPPORTED;
    }
    FerryPluginTarget *target = malloc(sizeof *target);
    if (!target) {
        free(name);
        return FERRY_E_INTERNAL;
    }
    target->name = name;
    target->instance = instance;
    *out = target;
    return FERRY_OK;
}

static void cm_close_target(FerryPluginInstance *inst, FerryPluginTarget *target) {
    (void)inst;
    if (!target) return;
    free(target->name);
    free(target);
}

static void free_batch(FerryPluginBatch *batch) {
    if (!batch) return;
    if (batch->errors)
        for (size_t i = 0; i < batch->count; i++) free(batch->errors[i]);
    free(batch->errors);
    free(batch->statuses);
    free(batch);
}

static void fail(FerryPluginBatch *batch, size_t i, int32_t code, char *message) {
    batch->statuses[i] = (FerryTransferStatus){FERRY_STATE_FAILED, code, 0};
    batch->errors[i] = message; /* may be NULL when out of memory: only the text is lost */
}

static int32_t cm_submit(FerryPluginInstance *inst, FerryPluginTarget *target, const FerryTransferRequest *requests,
                         size_t count, FerryPluginBatch **out) {
    if (!inst || !target || !requests || !out || count == 0) return FERRY_E_INVALID_ARGUMENT;
    /* Check every request first: on error, none starts. */
    for (size_t i = 0; i < count; i++) {
        const FerryTransferRequest *r = &requests[i];
        if ((r->opcode != FERRY_OPCODE_READ && r->opcode != FERRY_OPCODE_WRITE) || r->flags != 0 || r->length == 0)
            return FERRY_E_INVALID_ARGUMENT;
        if (r->local_addr + r->length < r->local_addr || r->remote_addr + r->length < r->remote_addr)
            return FERRY_E_OUT_OF_BOUNDS;
    }
    FerryPluginBatch *batch = calloc(1, sizeof *batch);
    if (!batch) return FERRY_E_INTERNAL;
    batch->count = count;
    batch->statuses = calloc(count, sizeof *batch->statuses);
    batch->errors = calloc(count, sizeof *batch->errors);
    if (!batch->statuses || !batch->errors) {
        free_batch(batch);
        return FERRY_E_INTERNAL;
    }

    pthread_mutex_lock(&table_lock);
    if (!inst->listed) {
        pthread_mutex_unlock(&table_lock);
        free_batch(batch);
        return FERRY_E_SHUTDOWN;
    }
    const FerryPluginInstance *peer = find_instance(target->name);
    bool restarted = peer && target->instance != 0 && peer->id != target->instance;
    for (size_t i = 0; i < count; i++) {
        const FerryTransferRequest *r = &requests[i];
        if (!peer || restarted) {
            fail(batch, i, FERRY_E_PEER_UNREACHABLE,
                 format_message(restarted ? "segment `%s` was restarted: its descriptor is stale"
                                          : "no cmemcpy instance serves segment `%s` in this process",
                                target->name));
        } else if (!registered(inst, r->local_addr, r->length)) {
            fail(batch, i, FERRY_E_OUT_OF_BOUNDS,
                 format_message("local range %#llx+%llu is not registered", (unsigned long long)r->local_addr,
                                (unsigned long long)r->length));
        } else if (!registered(peer, r->remote_addr, r->length)) {
            fail(batch, i, FERRY_E_OUT_OF_BOUNDS,
                 format_message("remote range %#llx+%llu is not registered by segment `%s`",
                                (unsigned long long)r->remote_addr, (unsigned long long)r->length, target->name));
        } else {
            /* Both ranges are registered, and the lock keeps them so until the copy is done. */
            void *local = (void *)(uintptr_t)r->local_addr;
            void *remote = (void *)(uintptr_t)r->remote_addr;
            if (r->opcode == FERRY_OPCODE_READ) memmove(local, remote, (size_t)r->length);
            else memmove(remote, local, (size_t)r->length);
            batch->statuses[i] = (FerryTransferStatus){FERRY_STATE_COMPLETED, FERRY_OK, r->length};
        }
    }
    pthread_mutex_unlock(&table_lock);
    *out = batch;
#if FERRY_PLUGIN_ABI_MINOR >= 1
    /* Every request is finished and *out holds the batch: report them now. The host frees the
       batch only once the last report was made and submit returned. */
    if (inst->sink)
        for (size_t i = 0; i < count; i++)
            inst->sink(inst->sink_ctx, batch, i, &batch->statuses[i], batch->errors[i]);
#endif
    return FERRY_OK;
}

static int32_t cm_poll(FerryPluginInstance *inst, FerryPluginBatch *batch, FerryTransferStatus *statuses,
                       size_t count) {
    if (!inst || !batch || !statuses || count != batch->count) return FERRY_E_INVALID_ARGUMENT;
    memcpy(statuses, batch->statuses, count * sizeof *statuses);
    return 0; /* every request finished inside submit */
}

static void cm_cancel(FerryPluginInstance *inst, FerryPluginBatch *batch) {
    /* Nothing to stop: no request outlives submit, so no memory is touched after it. */
    (void)inst;
    (void)batch;
}

static size_t cm_batch_error(FerryPluginInstance *inst, FerryPluginBatch *batch, size_t index, char *buffer,
                             size_t capacity) {
    (void)inst;
    const char *text = batch && index < batch->count && batch->errors[index] ? batch->errors[index] : "";
    size_t length = strlen(text);
    if (buffer && capacity > 0) {
        size_t n = length < capacity - 1 ? length : capacity - 1;
        memcpy(buffer, text, n);
        buffer[n] = '\0';
    }
    return length;
}

static void cm_free_batch(FerryPluginInstance *inst, FerryPluginBatch *batch) {
    (void)inst;
    free_batch(batch);
}

#if FERRY_PLUGIN_ABI_MINOR >= 1
/* ABI 1.1: the host offers its completion callback right after create, before any other call
   on the instance (so no lock is needed). Accepting it means reporting every request. */
static int32_t cm_set_completion_sink(FerryPluginInstance *inst, FerryCompletionFn sink, void *ctx) {
    if (!inst || !sink) return FERRY_E_INVALID_ARGUMENT;
    inst->sink = sink;
    inst->sink_ctx = ctx;
    return FERRY_OK;
}
#endif

static const FerryPluginApi api = {
    .struct_size = sizeof(FerryPluginApi),
    .abi_major = FERRY_PLUGIN_ABI_MAJOR,
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .protocol = PROTOCOL,
    .capabilities = FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY,
    .reserved = 0,
    .create = cm_create,
    .shutdown = cm_shutdown,
    .destroy = cm_destroy,
    .publish = cm_publish,
    .register_memory = cm_register_memory,
    .unregister_memory = cm_unregister_memory,
    .open_target = cm_open_target,
    .close_target = cm_close_target,
    .submit = cm_submit,
    .poll = cm_poll,
    .cancel = cm_cancel,
    .batch_error = cm_batch_error,
    .free_batch = cm_free_batch,
#if FERRY_PLUGIN_ABI_MINOR >= 1
    .set_completion_sink = cm_set_completion_sink,
#endif
};

/* The one exported symbol (FerryPluginEntryFn). */
const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

const FerryPluginApi *ferry_transport_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
    (void)host_abi_minor; /* a host of any 1.x minor reads the fields it knows */
    return host_abi_major == FERRY_PLUGIN_ABI_MAJOR ? &api : NULL;
}
