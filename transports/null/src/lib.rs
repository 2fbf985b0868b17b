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
use ferry_core::{Batch, Capabilities, OpenSegment, Result, Transport, TransportContext, TransportFactory};

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

    fn submit(&self, _target: &Arc<OpenSegment>, batch: &Arc<Batch>, indices: &[u32]) -> Result<()> {
        for &i in indices {
            if !batch.is_cancelled() {
                batch.complete(i as usize, Ok(()));
            }
        }
        Ok(())
    }
}
