//! Services started beside an engine once it is built and stopped with it (the facade's
//! Prometheus endpoint is one): the core starts and stops them, and knows nothing of what they
//! do (it has no sockets).

use super::*;

/// Something an [`EngineBuilder`] starts beside the engine it built (given with
/// [`EngineBuilder::service`]) and the engine stops at [`TransferEngine::shutdown`] or when its
/// last handle is dropped. The facade's metrics endpoint (`metrics_addr`) is one.
#[async_trait::async_trait]
pub trait EngineService: Send + Sync {
    /// Short name, for logs and errors.
    fn name(&self) -> &str;

    /// Starts the service for `engine`, when its config asks for it (`Ok(None)` otherwise). It
    /// should keep a [`WeakEngine`] ([`TransferEngine::downgrade`]) rather than the engine: a
    /// clone would keep the engine alive as long as the service. An error fails the build (the
    /// engine is shut down first).
    async fn start(&self, engine: &TransferEngine) -> Result<Option<ServiceGuard>>;
}

/// A running service: stopped (its `stop` run once) when dropped.
#[must_use = "dropping the guard stops the service"]
pub struct ServiceGuard {
    stop: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for ServiceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServiceGuard")
    }
}

impl ServiceGuard {
    /// A guard that runs `stop` when dropped. `stop` must not block (it may run inside a
    /// runtime, or in the engine's drop): signal the service, don't wait for it.
    pub fn new(stop: impl FnOnce() + Send + 'static) -> Self {
        Self { stop: Some(Box::new(stop)) }
    }
}

impl Drop for ServiceGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop();
        }
    }
}

/// A handle to an engine that does not keep it alive ([`TransferEngine::downgrade`]).
#[derive(Clone, Debug)]
pub struct WeakEngine(Weak<EngineInner>);

impl WeakEngine {
    /// The engine, while any [`TransferEngine`] handle of it is alive.
    pub fn upgrade(&self) -> Option<TransferEngine> {
        self.0.upgrade().map(|inner| TransferEngine { inner })
    }
}

impl TransferEngine {
    /// A handle that does not keep the engine alive (for services and callbacks).
    pub fn downgrade(&self) -> WeakEngine {
        WeakEngine(Arc::downgrade(&self.inner))
    }
}
