//! # ferry-transport-tcp-plugin
//!
//! The `tcp` transport (`ferry-transport-tcp`) under another protocol name, `tcp_plugin`, built
//! as `libferry_transport_tcp_plugin.so`: a plugin that really crosses processes, for tests
//! that run a plugin in two processes (`cli/tests/plugin_two_process.rs`). Its wire, options and
//! descriptor fields are the `tcp` transport's; only the protocol name differs, so that a build
//! with `tcp` compiled in still loads it through the plugin host rather than using its own.

use std::sync::Arc;

use async_trait::async_trait;
use ferry_core::{
    Capabilities, OpenSegment, PeerHandle, Result, SegmentDescriptor, Submission, Transport, TransportContext,
    TransportFactory,
};
use ferry_transport_tcp::{TcpTransport, TcpTransportFactory};

/// Protocol name.
pub const PROTOCOL: &str = "tcp_plugin";

/// What the transport declares: the `tcp` transport's (host memory, across processes).
pub const CAPABILITIES: Capabilities = Capabilities {
    read: true,
    write: true,
    notifications: false,
    host_memory: true,
    device_memory: false,
    cross_process: true,
};

ferry_plugin::declare_plugin!(protocol = "tcp_plugin", factory = TcpPluginFactory, capabilities = CAPABILITIES);

/// Factory of the `tcp_plugin` transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpPluginFactory;

#[async_trait]
impl TransportFactory for TcpPluginFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    fn options(&self) -> &'static [ferry_core::OptionSpec] {
        TcpTransportFactory.options()
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        Ok(Arc::new(TcpPlugin(TcpTransport::start(ctx).await?)))
    }
}

/// The `tcp` transport of one engine, serving the `tcp_plugin` protocol.
#[derive(Debug)]
pub struct TcpPlugin(TcpTransport);

#[async_trait]
impl Transport for TcpPlugin {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    fn publish(&self, descriptor: &mut SegmentDescriptor) {
        self.0.publish(descriptor)
    }

    async fn open(&self, target: &SegmentDescriptor) -> Result<PeerHandle> {
        self.0.open(target).await
    }

    fn submit(&self, target: &Arc<OpenSegment>, submission: Submission) {
        self.0.submit(target, submission)
    }

    async fn shutdown(&self) {
        self.0.shutdown().await
    }
}
