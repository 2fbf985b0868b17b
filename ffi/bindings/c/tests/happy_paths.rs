//! The C API doing its job: batches (submit, poll, wait, cancel, free), the synchronous
//! transfer, KV layouts moving selected blocks, and notifications between two engines on the
//! P2P handshake with the tcp transport, with data verified.

mod common;

use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use common::*;
use ferry_abi::*;
use ferry_c::*;

#[test]
fn submit_poll_wait_free_moves_the_bytes() {
    let prefill = engine(None);
    let decode = engine(None);
    let src = Buffer::pattern(64 * 1024, 17);
    let mut dst = Buffer::zeroed(64 * 1024);
    register(prefill, &src);
    register(decode, &dst);
    let peer = open(decode, &name(prefill));
    assert_eq!(open(decode, &name(prefill)), peer, "opening again gives the same handle");

    // Two reads from prefill and one write back into it.
    let half = 32 * 1024;
    let b = submit(
        decode,
        &[
            req(FERRY_OPCODE_READ, peer, dst.addr(), src.addr() + half, half),
            req(FERRY_OPCODE_READ, peer, dst.addr() + half, src.addr(), half),
        ],
    );
    ok(ferry_batch_wait(b, WAIT_MS));
    let mut st = [FerryTransferStatus { state: -1, code: -1, transferred: 7 }; 2];
    let mut pending = 9usize;
    // SAFETY: `st` holds 2 statuses; `pending` is a valid out-pointer.
    ok(unsafe { ferry_batch_poll(b, st.as_mut_ptr(), 2, &mut pending) });
    assert_eq!(pending, 0);
    for s in st {
        assert_eq!(s, FerryTransferStatus { state: FERRY_STATE_COMPLETED, code: FERRY_OK, transferred: half });
    }
    let mut n = 0usize;
    // SAFETY: a valid out-pointer.
    ok(unsafe { ferry_batch_len(b, &mut n) });
    assert_eq!(n, 2);
    let mut released = 0;
    // SAFETY: a valid out-pointer.
    ok(unsafe { ferry_batch_released(b, &mut released) });
    assert_eq!(released, 1, "a completed batch touches no memory any more");
    ok(ferry_batch_cancel(b)); // no effect on a finished batch
    // SAFETY: as above.
    ok(unsafe { ferry_batch_poll(b, st.as_mut_ptr(), 2, &mut pending) });
    assert_eq!(st[0].state, FERRY_STATE_COMPLETED, "cancelling a finished batch changes nothing");
    ok(ferry_batch_free(b));
    let s = src.bytes();
    let half = half as usize;
    assert_eq!(&dst.bytes()[..half], &s[half..]);
    assert_eq!(&dst.bytes()[half..], &s[..half]);

    // transfer_sync: write a new pattern from decode into prefill's buffer, read it back.
    dst.fill(0xC3);
    let sync = [req(FERRY_OPCODE_WRITE, peer, dst.addr(), src.addr() + 100, 1000)];
    // SAFETY: `sync` holds 1 request.
    ok(unsafe { ferry_transfer_sync(decode, sync.as_ptr(), 1, 0) });
    assert!(src.bytes()[100..1100].iter().all(|&x| x == 0xC3));
    assert_eq!(src.bytes()[99], Buffer::pattern(100, 17).bytes()[99], "bytes around the range are untouched");

    // The segment's buffers, as the descriptor publishes them: count first, then the list.
    let second = Buffer::zeroed(4096);
    register(prefill, &second);
    let (mut count, mut addrs, mut lens) = (usize::MAX, [0u64; 4], [0u64; 4]);
    // SAFETY: null arrays with cap 0; a valid out-pointer.
    ok(unsafe { ferry_segment_buffers(decode, peer, null_mut(), null_mut(), 0, &mut count) });
    assert_eq!(count, 1, "opened before `second` was registered: the descriptor as fetched then");
    // SAFETY: the arrays hold 4 entries each.
    ok(unsafe { ferry_segment_buffers(decode, peer, addrs.as_mut_ptr(), lens.as_mut_ptr(), 4, &mut count) });
    assert_eq!((count, addrs[0], lens[0], addrs[1]), (1, src.addr(), 64 * 1024, 0));
    let fresh = open(prefill, &name(prefill));
    // SAFETY: the arrays hold 4 entries each; only the first entry is asked for.
    ok(unsafe { ferry_segment_buffers(prefill, fresh, addrs.as_mut_ptr(), lens.as_mut_ptr(), 1, &mut count) });
    assert_eq!((count, addrs[0], lens[0]), (2, src.addr(), 64 * 1024), "both counted, in registration order");
    assert_eq!(addrs[1], 0, "nothing written past `cap`");
    // Its own segment is answered live: a third registration shows at once.
    let third = Buffer::zeroed(4096);
    register(prefill, &third);
    // SAFETY: the arrays hold 4 entries each.
    ok(unsafe { ferry_segment_buffers(prefill, fresh, addrs.as_mut_ptr(), lens.as_mut_ptr(), 4, &mut count) });
    assert_eq!((count, &addrs[..3]), (3, &[src.addr(), second.addr(), third.addr()][..]));

    ok(ferry_close_segment(decode, peer));
    fails(ferry_close_segment(decode, peer), FERRY_E_NOT_FOUND, &[]);
    // SAFETY: a valid out-pointer.
    fails(
        unsafe { ferry_segment_buffers(decode, peer, null_mut(), null_mut(), 0, &mut count) },
        FERRY_E_NOT_FOUND,
        &[],
    );
    // SAFETY: `cap` says 4 but the arrays are null: refused before anything is written.
    fails(
        unsafe { ferry_segment_buffers(prefill, fresh, null_mut(), lens.as_mut_ptr(), 4, &mut count) },
        FERRY_E_INVALID_ARGUMENT,
        &["`addrs` is null but its count is 4"],
    );
    // SAFETY: a null out-pointer is refused.
    fails(
        unsafe { ferry_segment_buffers(prefill, fresh, null_mut(), null_mut(), 0, null_mut()) },
        FERRY_E_INVALID_ARGUMENT,
        &["`out_count` is null"],
    );
    destroy(decode);
    destroy(prefill);
    drop((second, third));
}

#[test]
fn kv_layouts_move_exactly_the_selected_blocks() {
    const BLOCKS: u32 = 16;
    const LEN: u64 = 512;
    let prefill = engine(None);
    let decode = engine(None);
    // Two regions per side (say, K and V of one layer), each 16 blocks of 512 bytes; every
    // block of prefill is filled with a byte naming its region and block.
    let p_regions: Vec<Buffer> = (0..2u8)
        .map(|r| {
            let mut bytes = vec![0u8; 8192];
            for b in 0..BLOCKS as usize {
                bytes[b * 512..(b + 1) * 512].fill(r << 7 | b as u8);
            }
            Buffer::from_bytes(bytes)
        })
        .collect();
    let d_regions = [Buffer::zeroed(8192), Buffer::zeroed(8192)];
    for b in &p_regions {
        register(prefill, b);
    }
    for b in &d_regions {
        register(decode, b);
    }
    let local_bases = [d_regions[0].addr(), d_regions[1].addr()];
    let remote_bases = [p_regions[0].addr(), p_regions[1].addr()];
    let mut layout = 0u64;
    // SAFETY: `local_bases` holds 2 bases; a valid out-pointer.
    ok(unsafe { ferry_kv_layout_register(decode, local_bases.as_ptr(), 2, BLOCKS, LEN, &mut layout) });
    let peer = open(decode, &name(prefill));

    // Pull prefill blocks 3,4,5 and 9 into decode blocks 10,11,12 and 0.
    let local_ids = [10u32, 11, 12, 0];
    let remote_ids = [3u32, 4, 5, 9];
    let mut b: FerryBatch = 0;
    // SAFETY: every array holds the count passed; a valid out-pointer.
    ok(unsafe {
        ferry_kv_submit_blocks(
            decode,
            layout,
            peer,
            remote_bases.as_ptr(),
            2,
            BLOCKS,
            LEN,
            FERRY_OPCODE_READ,
            local_ids.as_ptr(),
            remote_ids.as_ptr(),
            4,
            &mut b,
        )
    });
    ok(ferry_batch_wait(b, WAIT_MS));
    let mut runs = 0usize;
    // SAFETY: a valid out-pointer.
    ok(unsafe { ferry_batch_len(b, &mut runs) });
    assert_eq!(runs, 4, "3,4,5 merge into one run per region; 9 is a run of its own: 2 x 2");
    let mut failed = [u32::MAX; 4];
    let mut nfailed = 99usize;
    // SAFETY: `failed` has room for 4 ids; a valid out-pointer.
    ok(unsafe { ferry_batch_failed_blocks(b, failed.as_mut_ptr(), 4, &mut nfailed) });
    assert_eq!(nfailed, 0);
    ok(ferry_batch_free(b));

    for (r, region) in d_regions.iter().enumerate() {
        for block in 0..BLOCKS as usize {
            let got = &region.bytes()[block * 512..(block + 1) * 512];
            let expected = match local_ids.iter().position(|&l| l as usize == block) {
                Some(i) => (r as u8) << 7 | remote_ids[i] as u8,
                None => 0,
            };
            assert!(got.iter().all(|&x| x == expected), "region {r} block {block}: expected {expected:#x}");
        }
    }

    // And push decode block 10 back into prefill block 15 (a write).
    let (l, rm) = ([10u32], [15u32]);
    // SAFETY: as above.
    ok(unsafe {
        ferry_kv_submit_blocks(
            decode,
            layout,
            peer,
            remote_bases.as_ptr(),
            2,
            BLOCKS,
            LEN,
            FERRY_OPCODE_WRITE,
            l.as_ptr(),
            rm.as_ptr(),
            1,
            &mut b,
        )
    });
    ok(ferry_batch_wait(b, 0));
    ok(ferry_batch_free(b));
    assert!(p_regions[0].bytes()[15 * 512..].iter().all(|&x| x == 3), "block 3's content landed in block 15");
    assert!(p_regions[1].bytes()[15 * 512..].iter().all(|&x| x == 0x80 | 3));

    ok(ferry_kv_layout_unregister(decode, layout));
    destroy(decode);
    destroy(prefill);
}

#[test]
fn a_published_layout_is_read_by_name_and_one_region_moves_alone() {
    const BLOCKS: u32 = 8;
    const LEN: u64 = 256;
    let prefill = engine(None);
    let decode = engine(None);
    let p_regions: Vec<Buffer> = (0..2u64).map(|r| Buffer::pattern(BLOCKS as usize * 256, 40 + r as u8)).collect();
    let d_regions = [Buffer::zeroed(BLOCKS as usize * 256), Buffer::zeroed(BLOCKS as usize * 256)];
    p_regions.iter().for_each(|b| register(prefill, b));
    d_regions.iter().for_each(|b| register(decode, b));
    let p_bases = [p_regions[0].addr(), p_regions[1].addr()];
    let d_bases = [d_regions[0].addr(), d_regions[1].addr()];
    let kv = CString::new("kv").unwrap();
    let (mut published, mut local) = (0u64, 0u64);
    // SAFETY: `p_bases` holds 2 bases; a NUL-terminated name; a valid out-pointer.
    ok(unsafe { ferry_kv_layout_publish(prefill, kv.as_ptr(), p_bases.as_ptr(), 2, BLOCKS, LEN, &mut published) });
    // SAFETY: as above.
    fails(
        unsafe { ferry_kv_layout_publish(prefill, kv.as_ptr(), p_bases.as_ptr(), 2, BLOCKS, LEN, &mut published) },
        FERRY_E_ALREADY_EXISTS,
        &["a KV layout named `kv` is published"],
    );
    // SAFETY: `d_bases` holds 2 bases; a valid out-pointer.
    ok(unsafe { ferry_kv_layout_register(decode, d_bases.as_ptr(), 2, BLOCKS, LEN, &mut local) });
    let peer = open(decode, &name(prefill));

    // The size first, then the bases.
    let (mut count, mut blocks, mut len) = (0usize, 0u32, 0u64);
    // SAFETY: NULL with cap 0; valid out-pointers.
    fails(
        unsafe { ferry_kv_remote_layout(decode, peer, kv.as_ptr(), null_mut(), 0, &mut count, &mut blocks, &mut len) },
        FERRY_E_INVALID_ARGUMENT,
        &["`cap` is 0 but layout `kv` has 2 regions"],
    );
    assert_eq!((count, blocks, len), (2, BLOCKS, LEN));
    let mut bases = [0u64; 2];
    // SAFETY: `bases` has room for 2; valid out-pointers.
    ok(unsafe {
        ferry_kv_remote_layout(decode, peer, kv.as_ptr(), bases.as_mut_ptr(), 2, &mut count, &mut blocks, &mut len)
    });
    assert_eq!(bases, p_bases);
    let other = CString::new("draft").unwrap();
    // SAFETY: as above.
    fails(
        unsafe {
            ferry_kv_remote_layout(
                decode,
                peer,
                other.as_ptr(),
                bases.as_mut_ptr(),
                2,
                &mut count,
                &mut blocks,
                &mut len,
            )
        },
        FERRY_E_NOT_FOUND,
        &["publishes no KV layout named `draft` (it publishes: kv)"],
    );

    // Region 1 only, blocks 2, 3 into 0, 1.
    let (l, r, regions) = ([0u32, 1], [2u32, 3], [1u32]);
    let mut b: FerryBatch = 0;
    // SAFETY: every array holds the count passed; a valid out-pointer.
    ok(unsafe {
        ferry_kv_submit_block_regions(
            decode,
            local,
            peer,
            bases.as_ptr(),
            count,
            blocks,
            len,
            FERRY_OPCODE_READ,
            l.as_ptr(),
            r.as_ptr(),
            2,
            regions.as_ptr(),
            1,
            &mut b,
        )
    });
    ok(ferry_batch_wait(b, WAIT_MS));
    ok(ferry_batch_free(b));
    assert_eq!(&d_regions[1].bytes()[..512], &p_regions[1].bytes()[512..1024], "region 1's blocks 2, 3 moved");
    assert!(d_regions[0].bytes().iter().all(|&x| x == 0), "region 0 was not asked for");
    let bad = [2u32];
    // SAFETY: as above.
    fails(
        unsafe {
            ferry_kv_submit_block_regions(
                decode,
                local,
                peer,
                bases.as_ptr(),
                count,
                blocks,
                len,
                FERRY_OPCODE_READ,
                l.as_ptr(),
                r.as_ptr(),
                2,
                bad.as_ptr(),
                1,
                &mut b,
            )
        },
        FERRY_E_OUT_OF_BOUNDS,
        &["region 2 (position 0 of the region subset) is out of range"],
    );

    ok(ferry_kv_layout_unregister(prefill, published));
    destroy(decode);
    destroy(prefill);
}

struct Received {
    notes: Vec<(String, String)>,
}

unsafe extern "C" fn collect(ctx: *mut c_void, from: *const c_char, message: *const c_char) {
    // SAFETY: `ctx` is the `Received` the test passed; the strings are valid during the call.
    unsafe {
        let r = &mut *(ctx as *mut Received);
        r.notes.push((
            CStr::from_ptr(from).to_string_lossy().into_owned(),
            CStr::from_ptr(message).to_string_lossy().into_owned(),
        ));
    }
}

fn drain(e: FerryEngine) -> Vec<(String, String)> {
    let mut r = Received { notes: Vec::new() };
    let mut count = 99usize;
    // SAFETY: `collect` matches the callback type; `r` outlives the call; valid out-pointer.
    ok(unsafe { ferry_drain_notifications(e, Some(collect), &mut r as *mut Received as *mut c_void, &mut count) });
    assert_eq!(count, r.notes.len());
    r.notes
}

fn notify(e: FerryEngine, to: &str, message: &str) -> i32 {
    let (to, message) = (CString::new(to).unwrap(), CString::new(message).unwrap());
    // SAFETY: valid C strings.
    unsafe { ferry_notify(e, to.as_ptr(), message.as_ptr()) }
}

#[test]
fn two_p2p_tcp_engines_transfer_and_notify_each_other() {
    let prefill = p2p_engine(10_000);
    let decode = p2p_engine(10_000);
    let (pn, dn) = (name(prefill), name(decode));
    assert!(pn.starts_with("127.0.0.1:") && dn.starts_with("127.0.0.1:") && pn != dn, "{pn} {dn}");
    let mut port = 0u16;
    // SAFETY: a valid out-pointer.
    ok(unsafe { ferry_engine_rpc_port(prefill, &mut port) });
    assert_eq!(format!("127.0.0.1:{port}"), pn, "the rpc port is the one in the segment name");

    let src = Buffer::pattern(1 << 20, 5);
    let dst = Buffer::zeroed(1 << 20);
    register(prefill, &src);
    register(decode, &dst);
    let peer = open(decode, &pn); // a handshake over loopback
    let r = [req(FERRY_OPCODE_READ, peer, dst.addr(), src.addr(), 1 << 20)];
    // SAFETY: `r` holds 1 request.
    ok(unsafe { ferry_transfer_sync(decode, r.as_ptr(), 1, 0) });
    assert_eq!(dst.bytes(), src.bytes());

    // Notifications, both ways, in order, each delivered once.
    assert!(drain(prefill).is_empty());
    ok(notify(decode, &pn, "blocks 1-3 ready"));
    ok(notify(decode, &pn, "request 42 done"));
    ok(notify(prefill, &dn, "ack"));
    assert_eq!(
        drain(prefill),
        vec![(dn.clone(), "blocks 1-3 ready".to_owned()), (dn.clone(), "request 42 done".to_owned())]
    );
    assert!(drain(prefill).is_empty(), "draining empties the queue");
    assert_eq!(drain(decode), vec![(pn.clone(), "ack".to_owned())]);

    // A name of the sender's choosing (Mooncake's TransferNotify.name); NULL: the segment name.
    let (to, who, what) = (CString::new(pn.clone()).unwrap(), c"req-7", c"kv ready");
    // SAFETY: valid C strings (NULL allowed for the sender).
    ok(unsafe { ferry_notify_as(decode, to.as_ptr(), who.as_ptr(), what.as_ptr()) });
    // SAFETY: as above.
    ok(unsafe { ferry_notify_as(decode, to.as_ptr(), std::ptr::null(), what.as_ptr()) });
    assert_eq!(drain(prefill), vec![("req-7".to_owned(), "kv ready".to_owned()), (dn.clone(), "kv ready".to_owned())]);

    // A probe reaches a live peer's handshake listener.
    // SAFETY: a valid C string.
    ok(unsafe { ferry_probe(decode, to.as_ptr()) });

    // A peer that went away is unreachable.
    destroy(prefill);
    fails(notify(decode, &pn, "anyone?"), FERRY_E_PEER_UNREACHABLE, &["peer_unreachable", &pn]);
    // SAFETY: a valid C string.
    fails(unsafe { ferry_probe(decode, to.as_ptr()) }, FERRY_E_PEER_UNREACHABLE, &["peer_unreachable", &pn]);
    destroy(decode);
}

#[test]
fn the_callback_may_call_back_into_ferry() {
    let a = p2p_engine(5000);
    let b = p2p_engine(5000);
    ok(notify(a, &name(b), "first"));

    struct Ctx {
        engine: FerryEngine,
        seen: usize,
        inner_count: usize,
    }
    unsafe extern "C" fn reenter(ctx: *mut c_void, _: *const c_char, _: *const c_char) {
        // SAFETY: `ctx` is the test's `Ctx`, alive for the drain call.
        let ctx = unsafe { &mut *(ctx as *mut Ctx) };
        ctx.seen += 1;
        // Drain again from inside the callback: no deadlock, nothing left to deliver.
        // SAFETY: `ignore` matches the type; valid out-pointer.
        let rc = unsafe { ferry_drain_notifications(ctx.engine, Some(ignore), null_mut(), &mut ctx.inner_count) };
        assert_eq!(rc, FERRY_OK);
    }
    unsafe extern "C" fn ignore(_: *mut c_void, _: *const c_char, _: *const c_char) {}
    let mut ctx = Ctx { engine: b, seen: 0, inner_count: 99 };
    let mut count = 0usize;
    // SAFETY: `reenter` matches the type; `ctx` outlives the call; valid out-pointer.
    ok(unsafe { ferry_drain_notifications(b, Some(reenter), &mut ctx as *mut Ctx as *mut c_void, &mut count) });
    assert_eq!((count, ctx.seen, ctx.inner_count), (1, 1, 0));
    destroy(a);
    destroy(b);
}

/// Polls `ferry_batch_released` until it reports 1; returns how long that took.
#[track_caller]
fn wait_released(b: FerryBatch, within: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let mut released = -1;
        // SAFETY: a valid out-pointer.
        ok(unsafe { ferry_batch_released(b, &mut released) });
        assert!(released == 0 || released == 1, "{released}");
        if released == 1 {
            return t.elapsed();
        }
        assert!(t.elapsed() < within, "batch {b} not released after {within:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_pending_batch_can_be_polled_timed_out_cancelled_and_freed() {
    let silent = SilentPeer::start();
    let e = p2p_engine(3_000);
    let local = Buffer::zeroed(4096);
    register(e, &local);
    let peer = open(e, &silent.name);
    let b = submit(
        e,
        &[
            req(FERRY_OPCODE_READ, peer, local.addr(), silent.buffer_addr, 1024),
            req(FERRY_OPCODE_WRITE, peer, local.addr() + 2048, silent.buffer_addr + 4096, 1024),
        ],
    );
    let mut st = [FerryTransferStatus::default(); 2];
    let mut pending = 0usize;
    // SAFETY: `st` holds 2 statuses; valid out-pointer.
    ok(unsafe { ferry_batch_poll(b, st.as_mut_ptr(), 2, &mut pending) });
    assert_eq!(pending, 2);
    assert!(st.iter().all(|s| s.state == FERRY_STATE_PENDING && s.code == FERRY_OK && s.transferred == 0));

    let t = Instant::now();
    fails(ferry_batch_wait(b, 100), FERRY_E_TIMEOUT, &["timeout: 2 of 2 request(s) still pending after 100ms"]);
    assert!(t.elapsed() >= Duration::from_millis(100) && t.elapsed() < Duration::from_secs(3));
    fails(ferry_batch_wait(b, 20), FERRY_E_TIMEOUT, &[]); // still running: wait again

    ok(ferry_batch_cancel(b));
    // SAFETY: as above.
    ok(unsafe { ferry_batch_poll(b, st.as_mut_ptr(), 2, &mut pending) });
    assert_eq!(pending, 0);
    assert!(st.iter().all(|s| s.state == FERRY_STATE_CANCELLED && s.code == FERRY_E_CANCELLED));
    fails(ferry_batch_wait(b, WAIT_MS), FERRY_E_CANCELLED, &["cancelled: 2 of 2 request(s) failed; first, request 0"]);

    // transfer_sync times out and cancels what is pending.
    let r = [req(FERRY_OPCODE_READ, peer, local.addr(), silent.buffer_addr, 16)];
    // SAFETY: `r` holds 1 request.
    fails(unsafe { ferry_transfer_sync(e, r.as_ptr(), 1, 50) }, FERRY_E_TIMEOUT, &["still pending after 50ms"]);

    // Freeing a pending batch cancels it.
    let b2 = submit(e, &r);
    ok(ferry_batch_free(b2));
    fails(ferry_batch_wait(b2, 1), FERRY_E_NOT_FOUND, &["was freed"]);

    // The transport lets go of the cancelled requests when the peer hangs up (well before
    // their 3 s deadline); then destroy finds no memory in use.
    silent.hang_up();
    let took = wait_released(b, Duration::from_secs(2));
    assert!(took < Duration::from_secs(2), "released by the hang-up, not the deadline: {took:?}");
    ok(ferry_batch_free(b));
    let t = Instant::now();
    ok(ferry_engine_destroy(e));
    assert!(t.elapsed() < Duration::from_secs(3), "destroy took {:?}", t.elapsed());
    drop(local);
}

#[test]
fn a_cancelled_block_transfer_names_its_blocks() {
    let silent = SilentPeer::start();
    let e = p2p_engine(3_000);
    let local = Buffer::zeroed(8 * 256);
    register(e, &local);
    let peer = open(e, &silent.name);
    let mut layout = 0u64;
    // SAFETY: one base; valid out-pointer.
    ok(unsafe { ferry_kv_layout_register(e, &local.addr(), 1, 8, 256, &mut layout) });
    let (l, r) = ([1u32, 2, 6], [0u32, 1, 7]);
    let mut b: FerryBatch = 0;
    // SAFETY: every array holds the count passed; valid out-pointer.
    ok(unsafe {
        ferry_kv_submit_blocks(
            e,
            layout,
            peer,
            &silent.buffer_addr,
            1,
            8,
            256,
            FERRY_OPCODE_READ,
            l.as_ptr(),
            r.as_ptr(),
            3,
            &mut b,
        )
    });
    ok(ferry_batch_cancel(b));
    fails(ferry_batch_wait(b, WAIT_MS), FERRY_E_CANCELLED, &[]);
    let mut n = 0usize;
    // SAFETY: NULL with capacity 0 is a size query.
    fails(
        unsafe { ferry_batch_failed_blocks(b, null_mut(), 0, &mut n) },
        FERRY_E_INVALID_ARGUMENT,
        &["`cap` is 0 but 3 block(s) failed"],
    );
    assert_eq!(n, 3);
    let mut ids = [0u32; 3];
    // SAFETY: room for 3 ids.
    ok(unsafe { ferry_batch_failed_blocks(b, ids.as_mut_ptr(), 3, &mut n) });
    assert_eq!(ids, [1, 2, 6]);
    silent.hang_up();
    wait_released(b, Duration::from_secs(2));
    ok(ferry_batch_free(b));
    destroy(e);
}

#[test]
fn a_waiting_thread_holds_up_no_other_call() {
    let silent = SilentPeer::start();
    let e = p2p_engine(4_000);
    let local = Buffer::zeroed(4096);
    register(e, &local);
    let peer = open(e, &silent.name);
    let b = submit(e, &[req(FERRY_OPCODE_READ, peer, local.addr(), silent.buffer_addr, 64)]);
    let waiter = std::thread::spawn(move || {
        let rc = ferry_batch_wait(b, 30_000);
        (rc, last_error())
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(!waiter.is_finished(), "the batch is pending");
    // While the waiter blocks: other engines and batches work, quickly.
    let t = Instant::now();
    let other = engine(None);
    let buf = Buffer::pattern(256, 1);
    register(other, &buf);
    let seg = open(other, &name(other));
    let ob = submit(other, &[req(FERRY_OPCODE_READ, seg, buf.addr(), buf.addr() + 128, 64)]);
    ok(ferry_batch_wait(ob, WAIT_MS));
    ok(ferry_batch_free(ob));
    assert!(name(e).starts_with("127.0.0.1:"));
    destroy(other);
    assert!(!waiter.is_finished(), "still pending after the other calls ({:?})", t.elapsed());
    // Cancelling from this thread wakes the waiter. (Had a lock been held across its wait, the
    // calls above would have blocked until the request's 4 s deadline, and it would report a
    // timeout instead.)
    ok(ferry_batch_cancel(b));
    let (rc, msg) = waiter.join().unwrap();
    assert_eq!(rc, FERRY_E_CANCELLED, "{msg}");
    assert!(msg.starts_with("cancelled: "), "the waiter's own last error: {msg}");
    silent.hang_up();
    wait_released(b, Duration::from_secs(3));
    ok(ferry_batch_free(b));
    destroy(e);
}

#[test]
fn engines_can_be_created_and_destroyed_from_many_threads() {
    let threads: Vec<_> = (0..4)
        .map(|i| {
            std::thread::spawn(move || {
                let e = engine(None);
                let src = Buffer::pattern(4096, i);
                let dst = Buffer::zeroed(4096);
                register(e, &src);
                register(e, &dst);
                let seg = open(e, &name(e));
                let r = [req(FERRY_OPCODE_READ, seg, dst.addr(), src.addr(), 4096)];
                for _ in 0..20 {
                    // SAFETY: `r` holds 1 request.
                    ok(unsafe { ferry_transfer_sync(e, r.as_ptr(), 1, 0) });
                }
                assert_eq!(dst.bytes(), src.bytes());
                destroy(e);
                e
            })
        })
        .collect();
    let handles: Vec<FerryEngine> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for h in &handles {
        fails(ferry_engine_destroy(*h), FERRY_E_NOT_FOUND, &["was destroyed"]);
    }
    let mut sorted = handles.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), handles.len(), "every engine got its own handle");
}

/// `ferry_allocate_buffer` / `ferry_free_buffer`: zero-filled, page-aligned host memory (the
/// tcp transport has no allocator of its own) that moves like any registered memory, is not
/// freed while an engine has it registered, and outlives its engine.
#[test]
fn allocated_buffers_move_bytes_and_are_not_freed_while_registered() {
    const LEN: u64 = 256 * 1024;
    let (a, b) = (p2p_engine(10_000), p2p_engine(10_000));
    let (mut src, mut dst) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    ok(unsafe { ferry_allocate_buffer(a, LEN, &mut src) });
    // SAFETY: as above.
    ok(unsafe { ferry_allocate_buffer(b, LEN, &mut dst) });
    for addr in [src, dst] {
        assert_eq!(addr % 4096, 0, "page-aligned");
        // SAFETY: the buffer owns LEN bytes; no transfer touches it yet.
        assert!(unsafe { std::slice::from_raw_parts(addr as *const u8, LEN as usize) }.iter().all(|&x| x == 0));
    }
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 13 % 251) as u8).collect();
    // SAFETY: as above.
    unsafe { std::slice::from_raw_parts_mut(src as *mut u8, LEN as usize) }.copy_from_slice(&pattern);
    // SAFETY: the buffers stay allocated while registered (ferry_free_buffer refuses otherwise).
    ok(unsafe { ferry_register_memory(a, src, LEN, c"*".as_ptr()) });
    // SAFETY: as above.
    ok(unsafe { ferry_register_memory(b, dst, LEN, c"*".as_ptr()) });
    let peer = open(b, &name(a));
    let batch = submit(b, &[req(FERRY_OPCODE_READ, peer, dst, src, LEN)]);
    ok(ferry_batch_wait(batch, WAIT_MS));
    ok(ferry_batch_free(batch));
    // SAFETY: the transfer finished.
    assert!(unsafe { std::slice::from_raw_parts(dst as *const u8, LEN as usize) } == pattern.as_slice());

    // Registered (with the engine that allocated it, or another): not freed.
    fails(ferry_free_buffer(src), FERRY_E_BUSY, &["still registered", &name(a)]);
    ok(ferry_unregister_memory(a, src));
    // SAFETY: as above.
    ok(unsafe { ferry_register_memory(b, src, LEN, c"*".as_ptr()) });
    fails(ferry_free_buffer(src), FERRY_E_BUSY, &["still registered", &name(b)]);
    ok(ferry_unregister_memory(b, src));
    ok(ferry_free_buffer(src));
    fails(ferry_free_buffer(src), FERRY_E_NOT_FOUND, &["not a buffer of ferry_allocate_buffer"]);

    // Its engine destroyed, the buffer stays allocated until freed.
    destroy(b);
    // SAFETY: still allocated.
    assert!(unsafe { std::slice::from_raw_parts(dst as *const u8, LEN as usize) } == pattern.as_slice());
    ok(ferry_free_buffer(dst));

    // Bad arguments.
    let mut out = 0u64;
    // SAFETY: a valid out-pointer.
    fails(unsafe { ferry_allocate_buffer(a, 0, &mut out) }, FERRY_E_INVALID_ARGUMENT, &["`length` is 0"]);
    // SAFETY: a null out-pointer is refused before it is used.
    fails(unsafe { ferry_allocate_buffer(a, 1, std::ptr::null_mut()) }, FERRY_E_INVALID_ARGUMENT, &["out_addr"]);
    destroy(a);
    // SAFETY: a valid out-pointer.
    fails(unsafe { ferry_allocate_buffer(a, 1, &mut out) }, FERRY_E_NOT_FOUND, &["destroyed"]);
    fails(ferry_free_buffer(0), FERRY_E_NOT_FOUND, &[]);
}

/// `ferry_engine_stats` as a C caller uses it: the length first, then the JSON text.
fn stats(e: FerryEngine) -> serde_json::Value {
    let mut len = 0usize;
    // SAFETY: a null buffer with cap 0 and a valid out-pointer.
    fails(
        unsafe { ferry_engine_stats(e, std::ptr::null_mut(), 0, &mut len) },
        FERRY_E_INVALID_ARGUMENT,
        &["too small"],
    );
    assert!(len > 0);
    let mut buf = vec![0 as c_char; len + 256];
    let mut got = 0usize;
    // SAFETY: `buf` holds `buf.len()` bytes; a valid out-pointer.
    ok(unsafe { ferry_engine_stats(e, buf.as_mut_ptr(), buf.len(), &mut got) });
    // SAFETY: the call wrote a NUL-terminated string into `buf`.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap().to_owned();
    assert_eq!(text.len(), got);
    serde_json::from_str(&text).unwrap()
}

#[test]
fn engine_stats_count_what_moved_as_json() {
    let a = engine(None);
    let b = engine(None);
    let src = Buffer::pattern(16 * 1024, 3);
    let dst = Buffer::zeroed(16 * 1024);
    register(a, &src);
    register(b, &dst);
    let peer = open(b, &name(a));
    let reqs = [
        req(FERRY_OPCODE_READ, peer, dst.addr(), src.addr(), 4096),
        req(FERRY_OPCODE_READ, peer, dst.addr() + 4096, src.addr() + 4096, 4096),
    ];
    // SAFETY: `reqs` holds 2 requests.
    ok(unsafe { ferry_transfer_sync(b, reqs.as_ptr(), 2, 0) });

    let s = stats(b);
    assert_eq!(s["segment"], name(b).as_str());
    let read = s["transfers"].as_array().unwrap().iter().find(|t| t["opcode"] == "read").unwrap().clone();
    assert_eq!(
        (read["peer"].as_str(), read["requests"].as_u64(), read["bytes"].as_u64()),
        (Some(name(a).as_str()), Some(2), Some(8192))
    );
    assert_eq!(s["batch_latency"]["count"], 1);
    assert!(s["batch_latency"]["p99_us"].as_f64().unwrap() > 0.0);
    assert_eq!((s["open_segments"].as_u64(), s["registered_bytes"].as_u64()), (Some(1), Some(16 * 1024)));
    assert_eq!(s["failures"]["timeout"], 0);
    assert_eq!(stats(a)["transfers"].as_array().unwrap().len(), 0, "a initiated nothing");

    // A buffer one byte short: refused, the length said.
    let mut len = 0usize;
    // SAFETY: a null buffer with cap 0 and a valid out-pointer.
    let _ = unsafe { ferry_engine_stats(b, std::ptr::null_mut(), 0, &mut len) };
    let mut short = vec![0 as c_char; len];
    let mut again = 0usize;
    // SAFETY: `short` holds `len` bytes.
    fails(unsafe { ferry_engine_stats(b, short.as_mut_ptr(), len, &mut again) }, FERRY_E_INVALID_ARGUMENT, &["`cap`"]);
    assert!(again >= len);
    destroy(a);
    destroy(b);
    // SAFETY: a valid out-pointer.
    fails(unsafe { ferry_engine_stats(b, std::ptr::null_mut(), 0, &mut len) }, FERRY_E_NOT_FOUND, &[]);
}
