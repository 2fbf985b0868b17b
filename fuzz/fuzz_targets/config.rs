//! `Config::from_json_str`, the decoder of `mooncake.json` (and what reads its fields: the
//! accessors engines call, the TCP transport's options, the handshake timeout).
//!
//! Holds: parsing never panics, whatever the text; a parsed config's accessors return values or
//! errors, never panic; a parsed config serializes to JSON that parses again and serializes to
//! the same text.

#![no_main]

use std::path::Path;

use ferry_core::{Config, Environment};
use ferry_transport_tcp::TcpOptions;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let cfg = match Config::from_json_str(text, Some(Path::new("/fuzz/mooncake.json"))) {
        Ok(c) => c,
        Err(e) => {
            assert!(e.message().starts_with("config /fuzz/mooncake.json"), "errors name the file: {e}");
            return;
        }
    };
    let _ = (cfg.metadata(), cfg.local_segment_name(), cfg.transfer_timeout(), cfg.protocol(), cfg.style());
    let _ = (cfg.plugin_paths(), cfg.unknown_fields(), cfg.base_port_for_role(), cfg.cluster_id());
    for rank in [None, Some(0), Some(1), Some(1023)] {
        let _ = cfg.port_for_rank(rank);
    }
    let env = Environment::empty();
    let _ = TcpOptions::from_config(&cfg, &env);
    let _ = ferry_metadata_p2p::handshake_timeout(&cfg, &env);
    let mut fixed = cfg.clone();
    let _ = fixed.fix_segment_name();

    let json = serde_json::to_string(&cfg).expect("a config serializes");
    let again = Config::from_json_str(&json, None).unwrap_or_else(|e| panic!("{json} does not parse again: {e}"));
    assert_eq!(serde_json::to_string(&again).unwrap(), json, "a round trip changes nothing");
});
