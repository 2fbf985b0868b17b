//! Copy-me example: a decode engine pulls selected KV blocks from a prefill engine.
//!
//! Both engines live in this process on the embedded default (no server, `local` transport).
//! Across machines only the builder changes (a `mooncake.json` naming `tcp` or `ascend` and a
//! metadata server); the block calls stay the same.
//!
//! Run: `cargo run --example kv_blocks`

use ferry::{BlockTransfer, KvLayout, Location};

const LAYERS: usize = 2;
const BLOCKS: u32 = 64;
const BLOCK_LEN: u64 = 4096;

fn main() -> anyhow::Result<()> {
    let prefill = ferry::builder().segment_name("example-prefill").build_blocking()?;
    let decode = ferry::builder().segment_name("example-decode").build_blocking()?;

    // Each layer has a K and a V tensor; register each whole tensor once.
    let region_len = (u64::from(BLOCKS) * BLOCK_LEN) as usize;
    let p_cache: Vec<Vec<u8>> = (0..2 * LAYERS).map(|r| vec![r as u8 + 1; region_len]).collect();
    let d_cache: Vec<Vec<u8>> = (0..2 * LAYERS).map(|_| vec![0u8; region_len]).collect();
    let regions =
        |c: &[Vec<u8>]| c.iter().map(|t| (t.as_ptr() as u64, t.len() as u64, Location::Cpu(0))).collect::<Vec<_>>();
    let (p_regions, d_regions) = (regions(&p_cache), regions(&d_cache));
    // SAFETY: the tensors are heap buffers that live until the end of `main`, after both
    // engines shut down, and no reference into them is held while transfers run.
    prefill.block_on(unsafe { prefill.register_memory_batch(&p_regions) })??;
    // SAFETY: as above.
    decode.block_on(unsafe { decode.register_memory_batch(&d_regions) })??;

    // The prefill side publishes its layout by name in its segment descriptor; the decode
    // side fetches it from there (only the request's block ids travel with the request).
    prefill.publish_kv_layout_blocking(
        "kv",
        KvLayout::uniform(&p_cache.iter().map(|t| t.as_ptr() as u64).collect::<Vec<_>>(), BLOCKS, BLOCK_LEN),
    )?;
    let d_layout = decode.register_kv_layout(KvLayout::uniform(
        &d_cache.iter().map(|t| t.as_ptr() as u64).collect::<Vec<_>>(),
        BLOCKS,
        BLOCK_LEN,
    ))?;

    // This request's KV lives in prefill blocks 10..14 and 40; decode allocated blocks 0..5.
    let remote_blocks = [10, 11, 12, 13, 40];
    let local_blocks = [0, 1, 2, 3, 4];
    let peer = decode.open_segment_blocking(prefill.segment_name())?;
    let p_layout = decode.remote_kv_layout_blocking(peer, "kv")?;
    let spec = BlockTransfer::read(&local_blocks, &remote_blocks);
    let batch = decode.submit_blocks_blocking(d_layout, peer, &p_layout, &spec)?;
    if let Err(e) = batch.wait_blocking(decode.transfer_timeout()) {
        // Mark exactly these blocks as failed and recompute them; the rest arrived.
        eprintln!("blocks {:?} failed: {e}", batch.failed_blocks());
        return Err(e.into());
    }
    println!(
        "moved {} blocks x {} regions as {} requests in {:?}",
        local_blocks.len(),
        2 * LAYERS,
        batch.runs().len(),
        batch.batch().elapsed()
    );
    for (r, tensor) in d_cache.iter().enumerate() {
        let tensor = std::hint::black_box(tensor);
        let filled = tensor[..5 * BLOCK_LEN as usize].iter().all(|&b| b == r as u8 + 1);
        let rest_zero = tensor[5 * BLOCK_LEN as usize..].iter().all(|&b| b == 0);
        anyhow::ensure!(filled && rest_zero, "region {r} does not hold what was sent");
    }
    println!("verified: decode blocks 0..5 hold the request's KV; the other blocks are untouched");
    decode.shutdown_blocking()?;
    prefill.shutdown_blocking()?;
    Ok(())
}
