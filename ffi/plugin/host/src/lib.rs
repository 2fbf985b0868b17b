//! # ferry-plugin-host
//!
//! Ferry's side of the transport-plugin ABI (`ferry-abi`): it finds a plugin library named
//! `libferry_transport_<protocol>.so` in the config's `plugins` list or in `FERRY_PLUGIN_DIR`
//! when a config or a peer's descriptor names a protocol that is not built in, opens it with
//! `RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE` (never unloaded), checks its ABI version and table,
//! and uses it exactly like a built-in transport ([`PluginTransport`] implements
//! `ferry_core::Transport`).
//!
//! Install [`PluginSource`] into a `TransportRegistry` (the `ferry` facade does so by default):
//!
//! ```
//! use std::sync::Arc;
//! let registry = ferry_core::TransportRegistry::new().with_source(Arc::new(ferry_plugin_host::PluginSource));
//! # let _ = registry;
//! ```
//!
//! Completion: a plugin built against ABI 1.1 that accepts the host's completion callback
//! (`set_completion_sink`) reports each finished request straight into the engine's
//! `Submission`; no thread polls it. A batch it has not finished inside `submit` gets a
//! watchdog task on the engine's runtime, which asks the plugin to cancel when the caller
//! cancels or the transfer timeout passes, and frees the plugin batch once every request was
//! reported. Any other plugin (ABI 1.0, or one that declines the callback) is polled: its batch
//! is polled once right after `submit` (a synchronous plugin is finished then, with no thread
//! hop); batches still pending are polled by one completion thread per plugin instance (named
//! [`POLL_THREAD_PREFIX`]`<protocol>`), which also cancels batches the caller cancelled or
//! that passed the transfer timeout. Either way a request the plugin still reports pending (or
//! has not reported) keeps its memory leased, whatever the caller was told.

mod loader;
mod push;
mod transport;

use std::sync::Arc;

use ferry_core::{Config, Result, TransportFactory, TransportSource};

pub use loader::{
    LoadedPlugin, PLUGIN_DIR_ENV, already_loaded, find_plugin, is_plugin_protocol_name, load_plugin, plugin_file_name,
    search_path,
};
pub use transport::{POLL_THREAD_PREFIX, PluginTransport, PluginTransportFactory};

/// The [`TransportSource`] that loads plugins on demand: the config's `plugins` entries first,
/// then each directory of `FERRY_PLUGIN_DIR`.
#[derive(Debug, Clone, Copy, Default)]
pub struct PluginSource;

impl TransportSource for PluginSource {
    fn load(&self, protocol: &str, config: &Config) -> Result<Option<Arc<dyn TransportFactory>>> {
        if !is_plugin_protocol_name(protocol) {
            return Ok(None);
        }
        if let Some(plugin) = already_loaded(protocol) {
            return Ok(Some(Arc::new(PluginTransportFactory::new(plugin))));
        }
        let Some(path) = find_plugin(protocol, &search_path(config)) else { return Ok(None) };
        let plugin = load_plugin(&path, protocol)?;
        Ok(Some(Arc::new(PluginTransportFactory::new(plugin))))
    }

    fn describe(&self, config: &Config) -> String {
        let paths = search_path(config);
        if paths.is_empty() {
            format!("no plugin directories (set {PLUGIN_DIR_ENV} or the config's `plugins`)")
        } else {
            let list: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            format!("plugins searched in: {}", list.join(", "))
        }
    }
}
