//! [`Pending`]: requests of one batch that this transport accepted and must complete exactly
//! once each, whatever path they take. It is the engine's [`Submission`] with the few shapes the
//! HCCL paths need; dropping one completes the rest with an internal error (the submission's
//! own guarantee).

use ferry_core::{Error, ErrorKind, Result, Submission, TransferRequest};

/// Requests of one batch not completed yet.
pub(crate) struct Pending(Submission);

impl Pending {
    pub(crate) fn new(submission: Submission) -> Self {
        Self(submission)
    }

    /// Request `i` of the batch (an index this holds).
    pub(crate) fn request(&self, i: u32) -> TransferRequest {
        self.0.request(i).request
    }

    pub(crate) fn indices(&self) -> &[u32] {
        self.0.indices()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the caller waits for the batch on the thread that submitted it, right after the
    /// transport's `submit` ([`Submission::caller_waits`]).
    pub(crate) fn caller_waits(&self) -> bool {
        self.0.caller_waits()
    }

    /// Tells the batch that the device moves these bytes while this side's threads wait
    /// ([`Submission::mark_device_completed`]).
    pub(crate) fn mark_device_completed(&self) {
        self.0.mark_device_completed();
    }

    /// Whether the caller cancelled the batch.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Splits off the first `n` requests.
    pub(crate) fn take_front(&mut self, n: usize) -> Pending {
        Pending(self.0.split_front(n))
    }

    /// `self` followed by `rest` (both of the same batch; a request of another batch is
    /// completed as lost rather than mixed in).
    pub(crate) fn append(mut self, rest: Pending) -> Pending {
        if let Err(foreign) = self.0.absorb(rest.0) {
            tracing::error!("hccl transport: requests of two batches were mixed; failing the foreign ones");
            foreign.fail_all(&Error::new(ErrorKind::Internal, "the hccl transport mixed two batches"));
        }
        self
    }

    /// Completes (and releases) every request with `outcome`.
    pub(crate) fn complete_all(self, outcome: &Result<()>) {
        self.0.complete_all(outcome);
    }

    /// Completes request at position `pos` of [`indices`](Self::indices) and removes it.
    pub(crate) fn complete_at(&mut self, pos: usize, outcome: Result<()>) {
        if let Some(&i) = self.0.indices().get(pos) {
            self.0.complete(i, outcome);
        }
    }

    /// Shows `error` to the caller for every request without releasing them (the memory may
    /// still be in use by a device job that completes them later).
    pub(crate) fn report_all(&self, error: &Error) {
        self.0.report_all(error);
    }

    /// When the batch was cancelled, completes everything as cancelled and returns `None`.
    pub(crate) fn unless_cancelled(self) -> Option<Self> {
        self.0.unless_cancelled("the HCCL transfer started").map(Pending)
    }
}
