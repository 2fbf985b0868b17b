/*
 * transfer.c: Ferry's C API end to end, in one process.
 *
 * Two engines ("prefill" and "decode") use the P2P handshake metadata and the tcp transport
 * (handshakes and notifications go over loopback sockets; data between engines of one
 * process takes Ferry's same-process memcpy shortcut). The program registers a buffer on each,
 * writes a pattern from decode into prefill, reads it back into another area, moves selected
 * KV blocks, sends a notification and drains it on the other side, shows what an error looks
 * like, and cleans up. It prints each step and exits 0 when everything checked out.
 *
 * Build and run (from the repository root):
 *   cargo build --release -p ferry-capi
 *   cc -std=c99 -Wall -Werror -I ffi/include ffi/bindings/c/examples/transfer.c \
 *      -L target/release -lferry_c -Wl,-rpath,$PWD/target/release -o /tmp/ferry-transfer
 *   /tmp/ferry-transfer
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"

#define BUF_LEN 4096u
#define HALF (BUF_LEN / 2u)
#define BLOCKS 8u
#define BLOCK_LEN 256u

static const char *CONFIG =
    "{\"local_hostname\": \"127.0.0.1\", \"metadata_server\": \"P2PHANDSHAKE\", \"protocol\": \"tcp\"}";

/* Prints the failed call with Ferry's explanation and exits. */
static void check(int32_t rc, const char *what) {
    if (rc != FERRY_OK) {
        fprintf(stderr, "FAILED: %s returned %d: %s\n", what, (int)rc, ferry_last_error());
        exit(1);
    }
}

static void expect(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "FAILED: %s\n", what);
        exit(1);
    }
}

static uint64_t addr_of(const void *p) { return (uint64_t)(uintptr_t)p; }

struct received {
    int count;
    char from[128];
    char message[128];
};

/* Notification callback: the strings are valid only during the call, so copy them. */
static void on_notification(void *ctx, const char *from, const char *message) {
    struct received *r = (struct received *)ctx;
    r->count++;
    snprintf(r->from, sizeof r->from, "%s", from);
    snprintf(r->message, sizeof r->message, "%s", message);
}

int main(void) {
    printf("ferry %s\n", ferry_version());

    /* 1. Two engines, each named 127.0.0.1:<its rpc port>. */
    FerryEngine prefill = 0, decode = 0;
    check(ferry_engine_create(CONFIG, &prefill), "ferry_engine_create(prefill)");
    check(ferry_engine_create(CONFIG, &decode), "ferry_engine_create(decode)");
    char prefill_name[128], decode_name[128];
    size_t len = 0;
    check(ferry_engine_segment_name(prefill, prefill_name, sizeof prefill_name, &len), "segment_name(prefill)");
    check(ferry_engine_segment_name(decode, decode_name, sizeof decode_name, &len), "segment_name(decode)");
    uint16_t port = 0;
    check(ferry_engine_rpc_port(prefill, &port), "ferry_engine_rpc_port");
    printf("engines: prefill %s (rpc port %u), decode %s\n", prefill_name, (unsigned)port, decode_name);

    /* 2. One buffer per engine, registered (the promise: they stay allocated until destroy). */
    unsigned char *pbuf = calloc(BUF_LEN, 1);
    unsigned char *dbuf = calloc(BUF_LEN, 1);
    expect(pbuf != NULL && dbuf != NULL, "allocating buffers");
    check(ferry_register_memory(prefill, addr_of(pbuf), BUF_LEN, "cpu:0"), "register prefill buffer");
    check(ferry_register_memory(decode, addr_of(dbuf), BUF_LEN, NULL), "register decode buffer");
    printf("registered %u bytes on each engine\n", BUF_LEN);

    /* 3. Decode opens prefill's segment (a P2P handshake over loopback). */
    uint64_t peer = 0;
    check(ferry_open_segment(decode, prefill_name, &peer), "ferry_open_segment");
    printf("decode opened segment %s\n", prefill_name);

    /* 4. Write a pattern from decode's first half into prefill's first half: submit, poll, wait. */
    for (unsigned i = 0; i < HALF; i++) dbuf[i] = (unsigned char)(i * 7u + 3u);
    FerryTransferRequest write_req = {FERRY_OPCODE_WRITE, 0, peer, addr_of(dbuf), addr_of(pbuf), HALF};
    FerryBatch batch = 0;
    check(ferry_submit(decode, &write_req, 1, &batch), "ferry_submit(write)");
    FerryTransferStatus status;
    size_t pending = 0;
    check(ferry_batch_poll(batch, &status, 1, &pending), "ferry_batch_poll");
    check(ferry_batch_wait(batch, 0), "ferry_batch_wait");
    check(ferry_batch_poll(batch, &status, 1, &pending), "ferry_batch_poll after wait");
    expect(status.state == FERRY_STATE_COMPLETED && status.transferred == HALF && pending == 0, "write completed");
    check(ferry_batch_free(batch), "ferry_batch_free");
    expect(memcmp(pbuf, dbuf, HALF) == 0, "prefill holds the pattern");
    printf("wrote %u bytes decode -> prefill\n", HALF);

    /* 5. Read it back into decode's second half in one call. */
    FerryTransferRequest read_req = {FERRY_OPCODE_READ, 0, peer, addr_of(dbuf + HALF), addr_of(pbuf), HALF};
    check(ferry_transfer_sync(decode, &read_req, 1, 5000), "ferry_transfer_sync(read)");
    expect(memcmp(dbuf, dbuf + HALF, HALF) == 0, "read-back matches the pattern");
    printf("read %u bytes prefill -> decode: verified\n", HALF);

    /* 6. KV blocks: prefill's buffer seen as 8 blocks of 256 bytes on each side; decode pulls
     *    prefill's blocks 1, 2 and 5 into its blocks 4, 5 and 0 (1+2 merge into one request). */
    for (unsigned b = 0; b < BLOCKS; b++) memset(pbuf + b * BLOCK_LEN, (int)(0xA0u + b), BLOCK_LEN);
    memset(dbuf, 0, BUF_LEN);
    uint64_t local_base = addr_of(dbuf), remote_base = addr_of(pbuf), layout = 0;
    check(ferry_kv_layout_register(decode, &local_base, 1, BLOCKS, BLOCK_LEN, &layout), "kv_layout_register");
    uint32_t local_blocks[] = {4, 5, 0}, remote_blocks[] = {1, 2, 5};
    check(ferry_kv_submit_blocks(decode, layout, peer, &remote_base, 1, BLOCKS, BLOCK_LEN, FERRY_OPCODE_READ,
                                 local_blocks, remote_blocks, 3, &batch),
          "ferry_kv_submit_blocks");
    size_t runs = 0;
    check(ferry_batch_len(batch, &runs), "ferry_batch_len");
    check(ferry_batch_wait(batch, 0), "ferry_batch_wait(kv)");
    check(ferry_batch_free(batch), "ferry_batch_free(kv)");
    for (unsigned i = 0; i < 3; i++) {
        const unsigned char *got = dbuf + local_blocks[i] * BLOCK_LEN;
        for (unsigned j = 0; j < BLOCK_LEN; j++) expect(got[j] == 0xA0u + remote_blocks[i], "KV block content");
    }
    expect(dbuf[1 * BLOCK_LEN] == 0, "untouched blocks stay untouched");
    check(ferry_kv_layout_unregister(decode, layout), "kv_layout_unregister");
    printf("moved KV blocks 1,2,5 -> 4,5,0 in %u requests: verified\n", (unsigned)runs);

    /* 7. Notification: decode tells prefill, prefill drains it. */
    check(ferry_notify(decode, prefill_name, "kv ready: request 42"), "ferry_notify");
    struct received got = {0, "", ""};
    size_t drained = 0;
    check(ferry_drain_notifications(prefill, on_notification, &got, &drained), "ferry_drain_notifications");
    expect(drained == 1 && got.count == 1, "one notification received");
    expect(strcmp(got.from, decode_name) == 0 && strcmp(got.message, "kv ready: request 42") == 0,
           "notification sender and text");
    printf("notification from %s: \"%s\"\n", got.from, got.message);

    /* 8. The error path: a read past the end of prefill's buffer is refused before it starts. */
    FerryTransferRequest bad = {FERRY_OPCODE_READ, 0, peer, addr_of(dbuf), addr_of(pbuf) + BUF_LEN - 100, 200};
    int32_t rc = ferry_transfer_sync(decode, &bad, 1, 0);
    expect(rc == FERRY_E_OUT_OF_BOUNDS, "out-of-bounds read returns FERRY_E_OUT_OF_BOUNDS");
    printf("out-of-bounds read refused (%d): %s\n", (int)rc, ferry_last_error());
    rc = ferry_batch_free(batch);
    expect(rc == FERRY_E_NOT_FOUND, "a freed batch handle is not found");
    printf("double free refused (%d): %s\n", (int)rc, ferry_last_error());

    /* 9. Clean up: unregister, destroy, then the memory may be freed. */
    check(ferry_close_segment(decode, peer), "ferry_close_segment");
    check(ferry_unregister_memory(decode, addr_of(dbuf)), "unregister decode buffer");
    check(ferry_engine_destroy(decode), "destroy decode");
    check(ferry_engine_destroy(prefill), "destroy prefill");
    expect(ferry_engine_destroy(prefill) == FERRY_E_NOT_FOUND, "a destroyed engine is not found");
    free(pbuf);
    free(dbuf);
    printf("engines destroyed; all checks passed\n");
    return 0;
}
