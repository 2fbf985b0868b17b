//! Engines built from mooncake.json files: what works, and the errors a bad file gets.

use std::path::PathBuf;

use ferry::{Config, ErrorKind, InProcessMetadata};
use ferry_test_support::builder;

fn write(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test]
async fn an_unknown_protocol_names_the_file_the_line_and_what_is_installed() {
    let p = write("rdma.json", "{\n  \"local_hostname\": \"10.0.0.2:17000\",\n  \"protocol\": \"rdma\"\n}\n");
    let cfg = Config::from_file(&p).unwrap();
    let e = builder(&InProcessMetadata::new()).config(cfg).build().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let m = e.message();
    assert!(m.contains(&p.display().to_string()), "{m}");
    assert!(m.contains("`protocol` at line 3 column 3"), "{m}");
    // Every installed protocol is listed (sorted; which ones depends on the features built).
    assert!(m.contains("installed: ascend, local, null, tcp"), "{m}");
}

#[tokio::test]
async fn a_store_style_file_builds_an_engine_named_by_local_hostname() {
    let p = write(
        "store.json",
        r#"{"local_hostname": "127.0.0.1:17500", "protocol": "local", "global_segment_size": "1GB",
            "local_buffer_size": 1048576, "master_server_address": "127.0.0.1:50051"}"#,
    );
    let cfg = Config::from_file(&p).unwrap();
    let e = builder(&InProcessMetadata::new()).config(cfg).build().await.unwrap();
    assert_eq!(e.segment_name(), "127.0.0.1:17500");
    assert_eq!(e.config().global_segment_size.unwrap().0, 1 << 30);
}

#[tokio::test]
async fn a_connector_style_file_needs_a_role_and_a_metadata_backend_that_is_built_in() {
    let p = write(
        "connector.json",
        r#"{"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13004",
            "metadata_server": "127.0.0.1:2379", "metadata_backend": "etcd", "protocol": "local"}"#,
    );
    let path = p.display().to_string();
    let no_role = Config::discover_with(|k| (k == "MOONCAKE_CONFIG_PATH").then(|| path.clone())).unwrap();
    let e = ferry::builder().config(no_role).build().await.unwrap_err();
    assert!(e.message().contains("FERRY_ROLE"), "{e}");
    let with_role = Config::discover_with(|k| match k {
        "MOONCAKE_CONFIG_PATH" => Some(path.clone()),
        "FERRY_ROLE" => Some("prefill".into()),
        _ => None,
    })
    .unwrap();
    assert_eq!(with_role.local_segment_name().unwrap().as_deref(), Some("127.0.0.1:13003"));
    // A build without the etcd backend says so instead of hanging or guessing.
    let e = ferry::builder()
        .config(with_role.clone())
        .metadata_registry(ferry::MetadataRegistry::new())
        .build()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("etcd metadata backend is not built"), "{e}");
    // A build with it, and nothing listening there: the endpoint is named.
    if ferry::default_metadata().kinds().contains(&"etcd") {
        let e = ferry::builder().config(with_role).build().await.unwrap_err();
        assert!(e.message().contains("127.0.0.1:2379"), "{e}");
    }
}

#[test]
fn malformed_and_partial_files_are_config_errors() {
    for (name, text, needle) in [
        ("trunc.json", "{\"protocol\": \"tcp\"", "not valid JSON"),
        ("type.json", "{\"transfer_timeout_ms\": \"soon\"}", "transfer_timeout_ms"),
        ("array.json", "[1, 2]", "line 1"),
        ("empty.json", "", "not valid JSON"),
    ] {
        let p = write(name, text);
        let e = Config::from_file(&p).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{name}");
        assert!(e.message().contains(name) && e.message().contains(needle), "{name}: {e}");
    }
    let e = Config::from_file("/nonexistent/ferry.json").unwrap_err();
    assert!(e.message().contains("/nonexistent/ferry.json"), "{e}");
}

#[tokio::test]
async fn the_tcp_transport_reads_its_own_fields_and_refuses_values_out_of_range() {
    let p = write("tcp-lanes.json", "{\n  \"protocol\": \"tcp\",\n  \"tcp_lanes\": 65\n}\n");
    let cfg = Config::from_file(&p).unwrap();
    assert_eq!(cfg.unknown_fields(), ["tcp_lanes"], "the core does not know the transport's fields");
    assert!(cfg.undeclared_fields(ferry::declared_options()).is_empty(), "the tcp transport declares it");
    let e = builder(&InProcessMetadata::new()).segment_name("127.0.0.1:1").config(cfg).build().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let m = e.message();
    assert!(
        m.contains(&p.display().to_string())
            && m.contains("field `tcp_lanes` at line 3 column 3: is 65; expected 1 to 64 connections per peer"),
        "{m}"
    );

    let p = write("tcp-port.json", r#"{"protocol": "tcp", "tcp_lanes": 2, "tcp_data_port": 0}"#);
    let cfg = Config::from_file(&p).unwrap();
    let e = builder(&InProcessMetadata::new()).segment_name("127.0.0.1:1").config(cfg).build().await.unwrap();
    let endpoint = ferry::transports::tcp::TcpEndpoint::from_descriptor(&e.local_descriptor()).unwrap().unwrap();
    assert_ne!(endpoint.port, 0, "port 0 is any free port, and the bound one is published");
    e.shutdown().await.unwrap();
}

/// Every option a transport built in declares has one row in docs/configuration.md, naming its
/// variable; the variable appears in no other row.
#[test]
fn every_declared_option_is_documented_once_in_the_configuration_docs() {
    let docs = include_str!("../docs/configuration.md");
    let options = ferry::declared_options();
    assert!(options.iter().any(|o| o.key == "tcp_lanes") && options.iter().any(|o| o.key == "hccl_retries"));
    for o in options {
        let rows: Vec<&str> = docs.lines().filter(|l| l.starts_with(&format!("| `{}` |", o.key))).collect();
        assert_eq!(rows.len(), 1, "docs/configuration.md has one row for `{}`: {rows:?}", o.key);
        if let Some(var) = o.env {
            assert!(rows[0].contains(&format!("`{var}`")), "the row of `{}` names {var}: {}", o.key, rows[0]);
            let elsewhere = docs.lines().filter(|l| l.starts_with('|') && l.contains(&format!("`{var}`"))).count();
            assert_eq!(elsewhere, 1, "{var} is documented in the row of `{}` alone", o.key);
        }
    }
}

/// `local_transport: false` leaves the same-process shortcut out of an engine: it is not
/// installed beside the protocol, nor brought back for a peer whose descriptor names `local`.
#[tokio::test]
async fn local_transport_false_leaves_the_same_process_transport_out() {
    let meta = InProcessMetadata::new();
    let on = builder(&meta).config(Config::from_json_str(r#"{"protocol": "null"}"#, None).unwrap());
    let on = on.segment_name("on").build().await.unwrap();
    assert_eq!(on.protocols(), vec!["local", "null"]);
    let p = write("no-local.json", r#"{"protocol": "null", "local_transport": false}"#);
    let off = builder(&meta).config(Config::from_file(&p).unwrap()).segment_name("off").build().await.unwrap();
    assert_eq!(off.protocols(), vec!["null"]);
    // A peer whose only transport is `local` (the embedded default's protocol).
    let local_only = builder(&meta).segment_name("local-only").build().await.unwrap();
    assert_eq!(local_only.local_descriptor().protocol, "local");
    on.open_segment("local-only").await.expect("the shortcut reaches it");
    let e = off.open_segment("local-only").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    let m = e.message();
    assert!(m.contains("segment `local-only`") && m.contains("`local_transport` is false"), "{m}");
    assert!(m.contains(&format!("config field `local_transport` in {}", p.display())), "{m}");
    assert_eq!(off.protocols(), vec!["null"], "nothing was added");
    for e in [on, off, local_only] {
        e.shutdown().await.unwrap();
    }
}
