//! # ferry-transport-null
//!
//! The `null` transport: accepts every request the engine validated and completes it at once
//! without moving a byte. It measures the engine's own overhead (submit, validation, completion,
//! wait) and serves as the test transport where data movement is beside the point.
//!
//! Never use it to move data: a "completed" request here means only that it was valid.
#![forbid(unsafe_code)]

use std::sync::Arc;

use async_trait::async_trait;
use ferry_core::{
    Capabilities, Error, ErrorKind, OpenSegment, Result, Submission, Transport, TransportContext, TransportFactory,
};

/// Protocol name.
pub const PROTOCOL: &str = "null";

/// Factory for the `null` transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct NullTransportFactory;

#[async_trait]
impl TransportFactory for NullTransportFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    async fn create(&self, _ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        Ok(Arc::new(NullTransport))
    }
}

/// The `null` transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct NullTransport;

#[async_trait]
impl Transport for NullTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { read: true, write: true, host_memory: true, device_memory: true, ..Capabilities::default() }
    }

    fn submit(&self, _target: &Arc<OpenSegment>, submission: Submission) {
        // Every request is released, a cancelled one as cancelled (it moved nothing).
        let outcome = if submission.is_cancelled() {
            Err(Error::new(ErrorKind::Cancelled, "cancelled before the null transport saw it"))
        } else {
            Ok(())
        };
        submission.complete_all(&outcome);
    }
}
