//! [`Pending`]: requests of one batch that this transport accepted and must complete exactly
//! once each, whatever path they take (dropping one completes the rest with an internal error).

use std::sync::Arc;

use ferry_core::{Batch, Error, ErrorKind, Result};

/// Requests of `batch` not completed yet.
pub(crate) struct Pending {
    batch: Arc<Batch>,
    indices: Vec<u32>,
}

impl Pending {
    pub(crate) fn new(batch: Arc<Batch>, indices: Vec<u32>) -> Self {
        Self { batch, indices }
    }

    pub(crate) fn batch(&self) -> &Arc<Batch> {
        &self.batch
    }

    pub(crate) fn indices(&self) -> &[u32] {
        &self.indices
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// Splits off the first `n` requests.
    pub(crate) fn take_front(&mut self, n: usize) -> Pending {
        let n = n.min(self.indices.len());
        let rest = self.indices.split_off(n);
        let front = std::mem::replace(&mut self.indices, rest);
        Pending { batch: self.batch.clone(), indices: front }
    }

    /// `self` followed by `rest` (both of the same batch).
    pub(crate) fn append(mut self, mut rest: Pending) -> Pending {
        self.indices.append(&mut rest.indices);
        self
    }

    /// Completes (and releases) every request with `outcome`.
    pub(crate) fn complete_all(mut self, outcome: &Result<()>) {
        for i in std::mem::take(&mut self.indices) {
            self.batch.complete(i as usize, dup(outcome));
        }
    }

    /// Completes request at position `pos` of [`indices`](Self::indices) and removes it.
    pub(crate) fn complete_at(&mut self, pos: usize, outcome: Result<()>) {
        let i = self.indices.remove(pos);
        self.batch.complete(i as usize, outcome);
    }

    /// Shows `error` to the caller for every request without releasing them (the memory may
    /// still be in use by a device job that completes them later).
    pub(crate) fn report_all(&self, error: &Error) {
        for &i in &self.indices {
            self.batch.report_outcome(i as usize, Err(error.duplicate()));
        }
    }

    /// When the batch was cancelled, completes everything as cancelled and returns `None`.
    pub(crate) fn unless_cancelled(self) -> Option<Self> {
        if self.batch.is_cancelled() {
            self.complete_all(&Err(Error::new(ErrorKind::Cancelled, "cancelled before the HCCL transfer started")));
            None
        } else {
            Some(self)
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.indices.is_empty() {
            tracing::error!(count = self.indices.len(), "hccl transport dropped requests without an outcome");
            let e = Error::new(ErrorKind::Internal, "the hccl transport lost track of this request");
            for i in std::mem::take(&mut self.indices) {
                self.batch.complete(i as usize, Err(e.duplicate()));
            }
        }
    }
}

/// Copies an outcome (errors share their cause).
pub(crate) fn dup(r: &Result<()>) -> Result<()> {
    match r {
        Ok(()) => Ok(()),
        Err(e) => Err(e.duplicate()),
    }
}
