//! The submit path: checks every request, leases its local range, and hands each transport an
//! engine-minted submission for its share.

use super::*;

/// How long `TransferEngine::transfer` waits, after its timeout, for the transports to fail a
/// still pending batch themselves before it cancels it: they fail what they hold at the same
/// deadline, and what they do to fail a request (the TCP transport fences its connection, so
/// that nothing of it lands after a later request) is done before the caller hears of it.
pub(crate) const REPORT_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

pub(super) fn request_error(i: usize, e: Error) -> Error {
    e.context(format!("request {i}: {}; nothing was submitted", e.message()))
}

impl TransferEngine {
    /// Validates and starts a batch of requests.
    ///
    /// Every local range must lie in one registered region and every remote range in one buffer
    /// of the target's descriptor (a failing remote check refetches that descriptor once, since
    /// the peer may have registered more memory). When any request is invalid, nothing is
    /// started and the error names the request's index. Returns the batch to poll, await,
    /// or cancel.
    ///
    /// The caller must not run two transfers into overlapping destination ranges at the same
    /// time, nor touch a destination range until its request completed (as with any DMA engine).
    pub async fn submit(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.submit_marked(requests, false).await
    }

    /// [`submit`](Self::submit), with the batch's [`Submission::caller_waits`] set to
    /// `caller_waits` (only the blocking entry points set it, from the caller's own thread);
    /// a refused submission is counted in the engine's metrics.
    async fn submit_marked(&self, requests: &[TransferRequest], caller_waits: bool) -> Result<Batch> {
        let submitted = self.submit_checked(requests, caller_waits).await;
        if let Err(e) = &submitted {
            self.inner.metrics.rejected(e.kind());
        }
        submitted
    }

    async fn submit_checked(&self, requests: &[TransferRequest], caller_waits: bool) -> Result<Batch> {
        self.inner.check_open()?;
        if requests.is_empty() {
            return Err(Error::invalid("empty batch: no requests to submit"));
        }
        // Every local range in registered memory, leased (for the batch) before any segment is
        // looked up.
        let leases = self
            .inner
            .memory
            .lease_spans(requests.iter().map(|r| (r.source, r.length)))
            .map_err(|(i, e)| request_error(i, e))?;

        // Distinct target segments, in first-use order (usually one).
        let mut segments: Vec<Route> = Vec::with_capacity(1);
        let mut slot_of: Vec<u32> = Vec::with_capacity(requests.len());
        for r in requests {
            let slot = match segments.iter().position(|s| s.handle() == r.target) {
                Some(p) => p,
                None => {
                    segments.push(self.inner.segment_for_use(r.target).await?);
                    segments.len() - 1
                }
            };
            slot_of.push(slot as u32);
        }
        let mut refreshed = vec![false; segments.len()];
        'validate: loop {
            let caps: Vec<_> = segments.iter().map(|s| s.transport.capabilities()).collect();
            for (i, r) in requests.iter().enumerate() {
                let slot = slot_of[i] as usize;
                let seg = &segments[slot];
                let caps = caps[slot];
                if (r.opcode == Opcode::Read && !caps.read) || (r.opcode == Opcode::Write && !caps.write) {
                    return Err(request_error(
                        i,
                        Error::new(
                            ErrorKind::Unsupported,
                            format!("transport `{}` cannot {:?}", seg.transport.protocol(), r.opcode),
                        ),
                    ));
                }
                if let Err(e) = seg.check_remote(r.target_offset, r.length) {
                    if e.kind() == ErrorKind::OutOfBounds && !refreshed[slot] {
                        refreshed[slot] = true;
                        segments[slot] = self.inner.load_segment(seg.name()).await?;
                        continue 'validate;
                    }
                    return Err(request_error(i, e));
                }
            }
            break;
        }

        let targets = segments.iter().map(|r| r.segment.clone()).collect();
        let (batch, mut all) =
            Batch::from_leases(requests, leases, targets, None, Some(self.inner.metrics.clone()), caller_waits)
                .map_err(|(i, e)| request_error(i, e))?;
        if segments.len() == 1 {
            segments[0].transport.submit(&segments[0].segment, all);
        } else {
            for (slot, route) in segments.iter().enumerate() {
                let mine: Submission = all.take(|i, _| slot_of[i as usize] as usize == slot);
                route.transport.submit(&route.segment, mine);
            }
        }
        Ok(batch)
    }

    /// Blocking form of [`submit`](Self::submit).
    pub fn submit_blocking(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.block_on(self.submit(requests))?
    }

    /// [`submit_blocking`](Self::submit_blocking) for a caller that waits for the batch on this
    /// thread at once ([`Batch::wait_blocking`] or [`Batch::wait_ok_blocking`]), as
    /// [`transfer_blocking`](Self::transfer_blocking), C's `ferry_transfer_sync` and
    /// `ferry bench` do.
    ///
    /// The transports are told so ([`Submission::caller_waits`]), and their `submit` runs on
    /// this thread ([`block_on`](Self::block_on) polls the submit here, not on a runtime
    /// worker), so one may finish a request before this returns: the TCP transport does the
    /// whole round trip of a single request on this thread when one of its peer's direct
    /// connections is idle, which saves two thread wake-ups (to its I/O thread and back). The
    /// batch may therefore already be done when this returns, or this may return only at the
    /// request's deadline (the transfer timeout) with the batch failed: use it only when this
    /// thread would wait that long. A caller that wants to do other work while the batch runs,
    /// or to wait less than the transfer timeout, uses [`submit_blocking`](Self::submit_blocking).
    pub fn submit_for_blocking_wait(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.block_on(self.submit_marked(requests, true))?
    }

    /// Submits and waits (with the configured transfer timeout); `Ok` only when every request
    /// completed.
    ///
    /// A batch still pending at the timeout is given one second more for its transports to fail
    /// it themselves (they fail what they hold at the same deadline), then cancelled: a request
    /// is reported failed by its transport, after whatever the transport does to fail it (the TCP
    /// transport fences the connection that carried it).
    pub async fn transfer(&self, requests: &[TransferRequest]) -> Result<()> {
        let batch = self.submit(requests).await?;
        let mut outcome = batch.wait_ok(self.transfer_timeout()).await;
        if outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Timeout) && !batch.is_done() {
            outcome = batch.wait_ok(REPORT_GRACE).await;
        }
        if outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Timeout) {
            batch.cancel();
        }
        outcome
    }

    /// Blocking form of [`transfer`](Self::transfer).
    pub fn transfer_blocking(&self, requests: &[TransferRequest]) -> Result<()> {
        let batch = self.submit_for_blocking_wait(requests)?;
        let mut outcome = batch.wait_ok_blocking(self.transfer_timeout());
        if outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Timeout) && !batch.is_done() {
            outcome = batch.wait_ok_blocking(REPORT_GRACE);
        }
        if outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Timeout) {
            batch.cancel();
        }
        outcome
    }
}
