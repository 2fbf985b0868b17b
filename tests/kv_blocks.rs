//! The KV-block API end to end: only the named blocks move, adjacent blocks merge into one
//! request, and failures are reported per block.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::sync::Arc;
use std::time::Duration;

use ferry::{BlockSlice, BlockTransfer, ErrorKind, InProcessMetadata, KvLayout, Location};
use ferry_test_support::{Buffer, builder, pair};

const BLOCKS: u32 = 32;
const BLOCK_LEN: u64 = 256;
const T: Duration = Duration::from_secs(5);

/// Two layers, K and V each: four regions of `BLOCKS` blocks.
fn kv_cache(seed: u8) -> Vec<Buffer> {
    (0..4).map(|r| Buffer::filled((BLOCKS as u64 * BLOCK_LEN) as usize, seed.wrapping_add(r))).collect()
}

/// Every region of `d_cache` (zeroed before) holds `p_cache`'s `remote` blocks at `local`, and
/// zeros everywhere else.
fn assert_read_into_zeroed(d_cache: &[Buffer], p_cache: &[Buffer], local: &[u32], remote: &[u32]) {
    for (r, (d, p)) in d_cache.iter().zip(p_cache).enumerate() {
        for (l, rm) in local.iter().zip(remote) {
            assert_eq!(block(d, *l), block(p, *rm), "region {r} block {l}");
        }
        for id in (0..BLOCKS).filter(|i| !local.contains(i)) {
            assert!(block(d, id).iter().all(|&b| b == 0), "untouched block {id} of region {r} changed");
        }
    }
}

fn block(buf: &Buffer, id: u32) -> &[u8] {
    &buf.bytes()[(id as u64 * BLOCK_LEN) as usize..((id + 1) as u64 * BLOCK_LEN) as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selected_blocks_move_in_both_directions_and_nothing_else() {
    let meta = InProcessMetadata::new();
    let (prefill, decode) = pair(&meta).await;
    let p_cache = kv_cache(10);
    let d_cache: Vec<Buffer> = (0..4).map(|_| Buffer::zeroed((BLOCKS as u64 * BLOCK_LEN) as usize)).collect();
    let regs = |c: &Vec<Buffer>| c.iter().map(|b| (b.addr(), b.len(), Location::Cpu(0))).collect::<Vec<_>>();
    unsafe { prefill.register_memory_batch(&regs(&p_cache)).await }.unwrap();
    unsafe { decode.register_memory_batch(&regs(&d_cache)).await }.unwrap();
    let bases = |c: &Vec<Buffer>| c.iter().map(Buffer::addr).collect::<Vec<_>>();
    let d_layout = decode.register_kv_layout(KvLayout::uniform(&bases(&d_cache), BLOCKS, BLOCK_LEN)).unwrap();
    let p_layout = KvLayout::uniform(&bases(&p_cache), BLOCKS, BLOCK_LEN);
    let peer = decode.open_segment("prefill").await.unwrap();

    // Decode pulls prefill blocks 3,4,5,9 into its blocks 0,1,2,7.
    let (local, remote) = ([0u32, 1, 2, 7], [3u32, 4, 5, 9]);
    let spec = BlockTransfer::read(&local, &remote);
    let kb = decode.submit_blocks(d_layout, peer, &p_layout, &spec).await.unwrap();
    assert_eq!(kb.runs().len(), 8, "one merged run of three blocks and one single block, per region");
    kb.wait(T).await.unwrap();
    assert!(kb.failed_blocks().is_empty());
    assert_read_into_zeroed(&d_cache, &p_cache, &local, &remote);

    // Decode pushes its block 7 (a copy of prefill's 9) into prefill's block 30.
    let before: Vec<Vec<u8>> = p_cache.iter().map(|b| b.bytes().to_vec()).collect();
    let spec = BlockTransfer::write(&[7], &[30]);
    decode.submit_blocks(d_layout, peer, &p_layout, &spec).await.unwrap().wait(T).await.unwrap();
    for r in 0..4 {
        assert_eq!(block(&p_cache[r], 30), &before[r][9 * BLOCK_LEN as usize..10 * BLOCK_LEN as usize]);
        assert_eq!(&p_cache[r].bytes()[..30 * BLOCK_LEN as usize], &before[r][..30 * BLOCK_LEN as usize]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heterogeneous_parallelism_reads_half_blocks() {
    let meta = InProcessMetadata::new();
    let (prefill, decode) = pair(&meta).await;
    // Prefill (TP=1) holds full 256-byte blocks; decode rank 1 of TP=2 holds 128-byte halves.
    let p = Buffer::filled((BLOCKS as u64 * BLOCK_LEN) as usize, 1);
    let d = Buffer::zeroed((BLOCKS as u64 * BLOCK_LEN / 2) as usize);
    unsafe { prefill.register_memory(p.addr(), p.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { decode.register_memory(d.addr(), d.len(), Location::Cpu(0)).await }.unwrap();
    let dl = decode.register_kv_layout(KvLayout::uniform(&[d.addr()], BLOCKS, BLOCK_LEN / 2)).unwrap();
    let pl = KvLayout::uniform(&[p.addr()], BLOCKS, BLOCK_LEN);
    let peer = decode.open_segment("prefill").await.unwrap();
    let spec =
        BlockTransfer::read(&[0, 1], &[4, 5]).remote_slice(BlockSlice { offset: BLOCK_LEN / 2, len: BLOCK_LEN / 2 });
    let kb = decode.submit_blocks(dl, peer, &pl, &spec).await.unwrap();
    assert_eq!(kb.runs().len(), 2, "half blocks are not contiguous, so they do not merge");
    kb.wait(T).await.unwrap();
    let half = (BLOCK_LEN / 2) as usize;
    assert_eq!(&d.bytes()[..half], &block(&p, 4)[half..]);
    assert_eq!(&d.bytes()[half..2 * half], &block(&p, 5)[half..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_block_requests_get_distinct_errors() {
    let meta = InProcessMetadata::new();
    let (prefill, decode) = pair(&meta).await;
    let p = Buffer::filled(8 * 64, 1);
    let d = Buffer::zeroed(8 * 64);
    unsafe { prefill.register_memory(p.addr(), p.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { decode.register_memory(d.addr(), d.len(), Location::Cpu(0)).await }.unwrap();
    // A layout reaching past registered memory is refused at registration.
    let e = decode.register_kv_layout(KvLayout::uniform(&[d.addr()], 9, 64)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    let dl = decode.register_kv_layout(KvLayout::uniform(&[d.addr()], 8, 64)).unwrap();
    let peer = decode.open_segment("prefill").await.unwrap();
    let spec = |l: &'static [u32], r: &'static [u32]| BlockTransfer::read(l, r);

    let good = KvLayout::uniform(&[p.addr()], 8, 64);
    let e = decode.submit_blocks(dl, peer, &good, &spec(&[8], &[0])).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
    let e = decode.submit_blocks(dl, peer, &good, &spec(&[0, 1], &[0])).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e =
        decode.submit_blocks(dl, peer, &KvLayout::uniform(&[p.addr()], 8, 32), &spec(&[0], &[0])).await.unwrap_err();
    assert!(e.message().contains("length mismatch"), "{e}");
    // A remote layout that claims more than the peer published is caught by the remote check.
    let e =
        decode.submit_blocks(dl, peer, &KvLayout::uniform(&[p.addr()], 100, 64), &spec(&[0], &[50])).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
    assert!(e.message().contains("remote range"), "{e}");
    // Ids cannot be made from integers; a binding's integer is checked.
    assert_eq!(decode.kv_layout_id(dl.raw()).unwrap(), dl);
    assert_eq!(decode.kv_layout_id(dl.raw() + 1000).unwrap_err().kind(), ErrorKind::NotFound);
    decode.unregister_kv_layout(dl).unwrap();
    assert_eq!(decode.unregister_kv_layout(dl).unwrap_err().kind(), ErrorKind::NotFound);
    let e = decode.submit_blocks(dl, peer, &good, &spec(&[0], &[0])).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "an unregistered layout: {e}");
    assert!(d.bytes().iter().all(|&b| b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_reported_per_block() {
    let meta = InProcessMetadata::new();
    let remote_base = 0x4000_0000u64;
    // A mock peer whose memory spans both remote regions; remote block 9 of region 1 fails (the
    // scripted transport stands in for a link error on one run).
    let poison = remote_base + 0x10_0000 + 9 * BLOCK_LEN;
    let script = ferry_transport_mock::MockScript::new();
    script
        .when(ferry_transport_mock::When::Remote { segment: "far".into(), range: poison..poison + 1 })
        .fail(ErrorKind::Transport);
    let remote = script.peer("far", remote_base, vec![0; (0x10_0000 + BLOCKS as u64 * BLOCK_LEN) as usize]);
    ferry::MetadataStore::put(&*meta, "mooncake/ram/far", &remote.to_json()).await.unwrap();
    let reg = ferry::TransportRegistry::new().with(Arc::new(script.factory()));
    let e = builder(&meta).transports(reg).protocol("mock").build().await.unwrap();
    let bufs: Vec<Buffer> = (0..2).map(|_| Buffer::zeroed((BLOCKS as u64 * BLOCK_LEN) as usize)).collect();
    let regions: Vec<_> = bufs.iter().map(|b| (b.addr(), b.len(), Location::Cpu(0))).collect();
    unsafe { e.register_memory_batch(&regions).await }.unwrap();
    let ll = e.register_kv_layout(KvLayout::uniform(&[bufs[0].addr(), bufs[1].addr()], BLOCKS, BLOCK_LEN)).unwrap();
    let rl = KvLayout::uniform(&[remote_base, remote_base + 0x10_0000], BLOCKS, BLOCK_LEN);
    let peer = e.open_segment("far").await.unwrap();
    // Pairs: 0<-1, 1<-2, 2<-8, 3<-9, 4<-10, 20<-20. Runs per region: [0,1]<-[1,2], [2,3,4]<-[8,9,10], [20]<-[20].
    let spec = BlockTransfer::read(&[0, 1, 2, 3, 4, 20], &[1, 2, 8, 9, 10, 20]);
    let kb = e.submit_blocks(ll, peer, &rl, &spec).await.unwrap();
    assert_eq!(kb.runs().len(), 6);
    let err = kb.wait(T).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transport);
    // The run carrying remote block 9 of region 1 failed; it also carried blocks 8 and 10.
    assert_eq!(kb.failed_blocks(), vec![2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_layout_is_fetched_by_name_and_a_layer_moves_alone() {
    let meta = InProcessMetadata::new();
    let (prefill, decode) = pair(&meta).await;
    let p_cache = kv_cache(40);
    let d_cache: Vec<Buffer> = (0..4).map(|_| Buffer::zeroed((BLOCKS as u64 * BLOCK_LEN) as usize)).collect();
    let regs = |c: &Vec<Buffer>| c.iter().map(|b| (b.addr(), b.len(), Location::Cpu(0))).collect::<Vec<_>>();
    unsafe { prefill.register_memory_batch(&regs(&p_cache)).await }.unwrap();
    unsafe { decode.register_memory_batch(&regs(&d_cache)).await }.unwrap();
    let bases = |c: &Vec<Buffer>| c.iter().map(Buffer::addr).collect::<Vec<_>>();
    let d_layout = decode.register_kv_layout(KvLayout::uniform(&bases(&d_cache), BLOCKS, BLOCK_LEN)).unwrap();

    // Opened before the prefill side publishes: the first lookup refetches the descriptor.
    let peer = decode.open_segment("prefill").await.unwrap();
    let e = decode.remote_kv_layout(peer, "kv").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(
        e.message().contains("segment `prefill` publishes no KV layout named `kv` (it publishes no KV layouts)"),
        "{e}"
    );
    let published = KvLayout::uniform(&bases(&p_cache), BLOCKS, BLOCK_LEN);
    let id = prefill.publish_kv_layout("kv", published.clone()).await.unwrap();
    assert_eq!(decode.remote_kv_layout(peer, "kv").await.unwrap(), published);
    let e = decode.remote_kv_layout(peer, "draft").await.unwrap_err();
    assert!(e.message().contains("(it publishes: kv)"), "{e}");

    // Layer 1 (regions 2 and 3) of blocks 5, 6: nothing of layer 0 moves.
    let layer1 = ferry::layer_regions(1..2, 2);
    let spec = BlockTransfer::read(&[0, 1], &[5, 6]).regions(&layer1);
    let kb = decode.submit_blocks(d_layout, peer, &published, &spec).await.unwrap();
    assert_eq!(kb.runs().len(), 2, "one merged run per region of the layer");
    kb.wait(T).await.unwrap();
    for r in 0..4 {
        let moved = r >= 2;
        assert_eq!(block(&d_cache[r], 0) == block(&p_cache[r], 5), moved, "region {r}");
        assert_eq!(block(&d_cache[r], 1) == block(&p_cache[r], 6), moved, "region {r}");
    }

    // Names are unique per engine, checked, and the layout's memory must be registered.
    let again = prefill.publish_kv_layout("kv", published.clone()).await.unwrap_err();
    assert_eq!(again.kind(), ErrorKind::AlreadyExists);
    assert_eq!(prefill.publish_kv_layout("", published.clone()).await.unwrap_err().kind(), ErrorKind::InvalidArgument);
    let stray = KvLayout::uniform(&[0x10], BLOCKS, BLOCK_LEN);
    assert_eq!(prefill.publish_kv_layout("stray", stray).await.unwrap_err().kind(), ErrorKind::OutOfBounds);

    // Unregistered, it leaves the descriptor (a fresh opener no longer finds it).
    prefill.unregister_kv_layout(id).unwrap();
    let deadline = tokio::time::Instant::now() + T;
    loop {
        decode.refresh_segment(peer).await.unwrap();
        match decode.remote_kv_layout(peer, "kv").await {
            Err(e) if e.kind() == ErrorKind::NotFound => break,
            other => assert!(tokio::time::Instant::now() < deadline, "still published: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its name can be published again.
    prefill.publish_kv_layout("kv", published).await.unwrap();
    prefill.shutdown().await.unwrap();
    decode.shutdown().await.unwrap();
}

/// `submit_blocks_for_blocking_wait` (the caller waits on its own thread, outside the runtime)
/// moves the same blocks as `submit_blocks`, and refuses to run inside a runtime.
#[test]
fn blocks_submitted_for_a_blocking_wait_move_the_same_way() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let meta = InProcessMetadata::new();
    let (prefill, decode) = rt.block_on(pair(&meta));
    let p_cache = kv_cache(40);
    let d_cache: Vec<Buffer> = (0..4).map(|_| Buffer::zeroed((BLOCKS as u64 * BLOCK_LEN) as usize)).collect();
    let regs = |c: &Vec<Buffer>| c.iter().map(|b| (b.addr(), b.len(), Location::Cpu(0))).collect::<Vec<_>>();
    let (p_regs, d_regs) = (regs(&p_cache), regs(&d_cache));
    rt.block_on(unsafe { prefill.register_memory_batch(&p_regs) }).unwrap();
    rt.block_on(unsafe { decode.register_memory_batch(&d_regs) }).unwrap();
    let bases = |c: &Vec<Buffer>| c.iter().map(Buffer::addr).collect::<Vec<_>>();
    let d_layout = decode.register_kv_layout(KvLayout::uniform(&bases(&d_cache), BLOCKS, BLOCK_LEN)).unwrap();
    let p_layout = KvLayout::uniform(&bases(&p_cache), BLOCKS, BLOCK_LEN);
    let peer = rt.block_on(decode.open_segment("prefill")).unwrap();

    let (local, remote) = ([4u32, 5, 20], [11u32, 12, 1]);
    let spec = BlockTransfer::read(&local, &remote);
    let kb = decode.submit_blocks_for_blocking_wait(d_layout, peer, &p_layout, &spec).unwrap();
    kb.wait_blocking(T).unwrap();
    assert!(kb.failed_blocks().is_empty());
    assert_read_into_zeroed(&d_cache, &p_cache, &local, &remote);
    let inside = rt.block_on(async { decode.submit_blocks_for_blocking_wait(d_layout, peer, &p_layout, &spec) });
    assert_eq!(inside.err().map(|e| e.kind()), Some(ErrorKind::InvalidArgument), "refused inside a runtime");
    rt.block_on(async {
        prefill.shutdown().await.unwrap();
        decode.shutdown().await.unwrap();
    });
}
