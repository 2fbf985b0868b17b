//! `ferry doctor`: validates a config and prints what Ferry resolved from it, field by field,
//! with where each value came from and which resolver answered each identity field (and how:
//! which variable, file entry or segment-name part).
//!
//! Sources that disagree about the device (physical or user id) are a problem. Every option the
//! transports and metadata backends built in declare (`TransportFactory::options`:
//! `tcp_lanes`, `hccl_retries`, ...; `MetadataRegistry::options`: the P2P handshake's) is read
//! and checked whatever the protocol, as its crate reads it, and printed with its effective
//! value and where it came from; an invalid one is a problem. Whether peer authentication is on,
//! and where its secret came from, has a line of its own; the secret itself is never printed. With the `ascend`
//! protocol it also runs the transport's own start-up check (`LocalIdentity::from_resolution`:
//! physical id, user id and device IP all known) on the chain the transport will use (its `acl`
//! link inserted when a `resolvers` list omits it).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ferry::transports::hccl;
use ferry::transports::hccl::ascend_identity::{self as ascend, AscendOptions};
use ferry::{
    Config, Environment, FieldSource, MetadataServer, OptionValue, ResolveQuery, ResolverContext, ResolverFactory,
    TransportFactory,
};

/// Options of `ferry doctor`.
#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Config file (default: $MOONCAKE_CONFIG_PATH, else the embedded default).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// This process's local rank (default: $FERRY_LOCAL_RANK, else $LOCAL_RANK, else the
    /// config's `local_rank`).
    #[arg(long)]
    local_rank: Option<u32>,
    /// Also resolve the identity of this peer segment (`ip:port[:npu_N]`).
    #[arg(long)]
    peer: Option<String>,
    /// Count every warning (a config field nothing in this build reads, most often a misspelt
    /// one) as a problem: exit non-zero.
    #[arg(long)]
    strict: bool,
}

fn source(cfg: &Config, field: &str) -> String {
    match cfg.source_of(field) {
        Some(FieldSource::Api) | None => "default".to_owned(),
        Some(s) => s.to_string(),
    }
}

/// One declared option's line: its effective value and where it came from, or its default; an
/// invalid value is shown as set (a secret never: only where it came from) and its error added
/// to `problems`.
fn option_line(cfg: &Config, env: &Environment, v: OptionValue, problems: &mut Vec<String>) -> String {
    let shown = match v.setting {
        Ok(Some(s)) => format!("{} [{}]", s.value, s.source),
        Ok(None) => format!("{} [default]", v.spec.default),
        Err(e) => {
            problems.push(e.message().to_owned());
            match cfg.option_text(v.spec, env) {
                Some(s) if ferry_peer_auth::options::is_secret(v.spec) => {
                    format!("(hidden) [{}] INVALID (see below)", s.source)
                }
                Some(s) => format!("{} [{}] INVALID (see below)", s.value, s.source),
                None => "INVALID (see below)".to_owned(),
            }
        }
    };
    format!("  {:<18} = {shown}", v.spec.key)
}

pub(crate) async fn run(args: DoctorArgs) -> Result<std::process::ExitCode> {
    let env = |k: &str| std::env::var(k).ok();
    let loaded = match &args.config {
        Some(path) => Config::from_file(path).and_then(|mut c| c.apply_env(env).map(|_| c)),
        None => Config::discover_with(env),
    };
    let cfg = match loaded {
        Ok(mut c) => {
            if let Some(r) = args.local_rank {
                c.set_local_rank(r);
            }
            c
        }
        Err(e) => {
            println!("config: INVALID");
            println!("  {}", e.message());
            return Ok(std::process::ExitCode::FAILURE);
        }
    };
    let mut problems: Vec<String> = Vec::new();
    let transports = ferry::default_transports();
    let metadata = ferry::default_metadata();

    match cfg.path() {
        Some(p) => println!("config:           {} ({} style)", p.display(), cfg.style()),
        None => println!("config:           embedded default (no file; set MOONCAKE_CONFIG_PATH or --config)"),
    }

    match cfg.local_segment_name() {
        Ok(Some(name)) => {
            let port = match (cfg.base_port_for_role(), cfg.local_rank()) {
                (Ok(Some(base)), Some(rank)) => format!("; port = base_port {base} + local rank {rank}"),
                _ => String::new(),
            };
            println!(
                "segment name:     {name}  [{}{port}]",
                source(&cfg, "local_hostname").replace("default", "role URL")
            )
        }
        Ok(None) => println!("segment name:     (generated at start: ferry-<pid>-<n>)"),
        Err(e) => problems.push(e.message().to_owned()),
    }

    let protocol = cfg.protocol();
    let built_in = transports.find(protocol).is_some();
    // The configured transport when a plugin serves it, for its declared options.
    let mut plugin: Option<std::sync::Arc<dyn TransportFactory>> = None;
    // The ascend transport (or its alias) refuses to start without a complete, consistent
    // identity: check what it would check.
    let ascend = transports.find(protocol).is_some_and(|f| f.protocol() == hccl::PROTOCOL);
    match transports.for_config(&cfg) {
        Ok(f) if built_in => println!(
            "protocol:         {} [{}] -> transport `{}` (built in)",
            protocol,
            source(&cfg, "protocol"),
            f.protocol()
        ),
        Ok(f) => {
            println!(
                "protocol:         {} [{}] -> transport `{}` (plugin {}, loaded and version-checked)",
                protocol,
                source(&cfg, "protocol"),
                f.protocol(),
                ferry_plugin_host::already_loaded(f.protocol())
                    .map(|p| p.path().display().to_string())
                    .unwrap_or_else(|| "?".into())
            );
            plugin = Some(f);
        }
        Err(e) => problems.push(e.message().to_owned()),
    }
    let plugin_paths = ferry_plugin_host::search_path(&cfg);
    if plugin_paths.is_empty() {
        println!("plugin search:    none (set {} or the config's `plugins`)", ferry_plugin_host::PLUGIN_DIR_ENV);
    } else {
        let list: Vec<String> = plugin_paths.iter().map(|p| p.display().to_string()).collect();
        println!("plugin search:    {}", list.join(", "));
    }
    let companions: Vec<&str> = transports.companions().map(|f| f.protocol()).filter(|p| *p != protocol).collect();
    if !companions.is_empty() && cfg.local_transport() {
        println!("also installed:   {} (tried first for same-process peers)", companions.join(", "));
    } else if !companions.is_empty() {
        println!(
            "left out:         {} (local_transport false [{}]: peers in this process are reached through {protocol})",
            companions.join(", "),
            source(&cfg, "local_transport")
        );
    }
    println!("transports built: {}", transports.protocols().join(", "));

    match cfg.metadata() {
        Ok(server) => {
            let detail = match &server {
                MetadataServer::Embedded => "in-process store (no server)".to_owned(),
                MetadataServer::P2pHandshake => "P2P handshake (descriptors fetched from peers)".to_owned(),
                MetadataServer::Http(u) => format!("HTTP {u}"),
                MetadataServer::Etcd(eps) => format!("etcd {}", eps.join(", ")),
                MetadataServer::Redis(u) => format!("Redis {u}"),
                other => format!("{other:?}"),
            };
            println!("metadata:         {detail} [{}]", source(&cfg, "metadata_server"));
            if !metadata.kinds().contains(&server.kind()) {
                problems.push(format!(
                    "metadata backend `{}` is not built into this binary (available: {})",
                    server.kind(),
                    metadata.kinds().join(", ")
                ));
            }
            println!("control channel:  {}", control_channel(&cfg, &server, &metadata));
        }
        Err(e) => problems.push(e.message().to_owned()),
    }
    let keys = ferry::MetadataKeys::new(cfg.cluster_id());
    println!("key prefix:       {} [{}]", keys.prefix(), source(&cfg, "cluster_id"));
    println!("transfer timeout: {:?} [{}]", cfg.transfer_timeout(), source(&cfg, "transfer_timeout_ms"));
    if let Some(d) = &cfg.device_name {
        println!("device_name:      {d:?}");
    }
    if let Some(m) = &cfg.master_server_address {
        println!("master (store):   {m} (read; not used by the transfer engine)");
    }
    let env = Environment::process();
    // Every option the transports of this build (and a plugin serving the protocol) declare,
    // as each transport reads it.
    // Then the options of the metadata backends and the control channel built in.
    let factories: Vec<_> = transports.factories().chain(plugin.as_ref()).collect();
    let mut declared: Vec<&'static str> = Vec::new();
    let mut lines: Vec<String> = Vec::new();
    let readings = factories.iter().flat_map(|f| f.read_options(&cfg, &env)).chain(metadata.read_options(&cfg, &env));
    for v in readings {
        if !declared.contains(&v.spec.key) {
            declared.push(v.spec.key);
            lines.push(option_line(&cfg, &env, v, &mut problems));
        }
    }
    if !lines.is_empty() {
        println!("options:          (declared by the transports and metadata backends built in)");
        for line in lines {
            println!("{line}");
        }
    }
    let specs = factories.iter().flat_map(|f| f.options()).chain(metadata.options());
    let unknown = cfg.unknown_field_warnings(specs);
    if !unknown.is_empty() {
        let keys: Vec<&str> = unknown.iter().map(|u| u.key.as_str()).collect();
        println!("unknown fields:   {} (kept, not used)", keys.join(", "));
    }
    let warnings: Vec<String> = unknown.iter().map(ToString::to_string).collect();
    authentication(&cfg, &env, &mut problems);

    match cfg.local_rank() {
        Some(r) => {
            let from = match cfg.source_of("local_rank") {
                Some(FieldSource::Api) => "--local-rank".to_owned(),
                _ => source(&cfg, "local_rank"),
            };
            println!("local rank:       {r} [{from}]")
        }
        None => println!("local rank:       unknown (set LOCAL_RANK or FERRY_LOCAL_RANK, or --local-rank)"),
    }
    // The rank table the `rank_table` link reads (from its option or vllm-ascend's variable),
    // and what it holds.
    match ascend::RankTableResolver::from_config(&cfg, &env) {
        Ok(rank_table) => {
            if let Some(p) = rank_table.path() {
                let form = match ascend::RankTable::load(p) {
                    Ok(t) => format!("{}, {} device(s)", t.form(), t.entries().len()),
                    Err(_) => "unreadable or invalid, see below".to_owned(),
                };
                println!("rank table:       {} ({form}) [{}]", p.display(), rank_table.set_by());
            }
        }
        // A bad `rank_table_path` is reported with the options above.
        Err(e) if !problems.iter().any(|p| p == e.message()) => problems.push(e.message().to_owned()),
        Err(_) => {}
    }

    // The resolvers of this build: the core's links and the HCCL transport's `acl`.
    let registry = ferry::default_resolvers();
    match registry.build_chain(&cfg, &env) {
        Ok(mut chain) => {
            let mut skipped = match chain.skipped() {
                [] => String::new(),
                s => format!("; not in this build: {}", s.join(", ")),
            };
            if ascend && !chain.names().contains(&hccl::ACL_RESOLVER_NAME) {
                // The transport inserts the `acl` link when the chain lacks it (before
                // `hccn_conf`, else last): show and resolve the chain it will use.
                match hccl::AclResolverFactory.create(&ResolverContext::new(&cfg, &env)) {
                    Ok(acl) => {
                        chain = hccl::with_acl_link(chain, acl);
                        skipped = format!(
                            "{skipped}; `{}` inserted by the {} transport, which always consults it",
                            hccl::ACL_RESOLVER_NAME,
                            hccl::PROTOCOL
                        );
                    }
                    Err(e) => problems.push(e.message().to_owned()),
                }
            }
            let order = if cfg.resolvers.is_some() {
                format!("[{}]", source(&cfg, "resolvers"))
            } else {
                "[default order]".into()
            };
            println!("identity (resolver chain: {} {order}{skipped}):", chain.names().join(" -> "));
            let local_segment = cfg.local_segment_name().ok().flatten();
            let mut queries = vec![("", ResolveQuery::local(local_segment.clone(), cfg.local_rank()))];
            if let Some(peer) = &args.peer {
                queries.push((peer.as_str(), ResolveQuery::peer(peer.clone(), local_segment, cfg.local_rank())));
            }
            let mut backends: Option<hccl::Backends> = None;
            for (peer, query) in queries {
                if !peer.is_empty() {
                    println!("peer {peer}:");
                    if let Some(b) = &backends {
                        print_peer_route(&cfg, b, peer).await;
                    }
                }
                match chain.resolve(&query).await {
                    Ok(res) => {
                        for line in res.to_string().lines() {
                            println!("  {line}");
                        }
                        let whose = if peer.is_empty() { String::new() } else { format!("peer {peer}: ") };
                        let refused = if ascend && peer.is_empty() {
                            let segment = query.local_segment.as_deref().unwrap_or("(generated at start)");
                            // HIXL finds its NICs itself: the device IP is needed only without it.
                            let need_ip = AscendOptions::from_config(&cfg, &env)
                                .map(|o| o.backend(protocol) != ascend::AscendBackend::Hixl)
                                .unwrap_or(true)
                                && hccl::probe_backends(
                                    ascend::AscendBackend::Auto,
                                    &hccl::sys::SearchPath::from_env(),
                                    true,
                                )
                                .hixl
                                .is_err();
                            hccl::LocalIdentity::from_resolution_for(segment, "127.0.0.1", &res, need_ip).err()
                        } else {
                            res.refuse_device_disagreements().err()
                        };
                        if ascend && peer.is_empty() {
                            let asked = AscendOptions::from_config(&cfg, &env)
                                .map(|o| o.backend(protocol))
                                .unwrap_or_else(|_| ascend::AscendBackend::for_protocol(protocol));
                            let b = hccl::probe_backends(
                                asked,
                                &hccl::sys::SearchPath::from_env(),
                                res.identity.device_ip.is_some(),
                            );
                            print_backends(&b, protocol);
                            backends = Some(b);
                        }
                        if let Some(e) = refused {
                            // The explanation is printed above; keep the problem to its point.
                            let message = e.message().split("\nresolved so far").next().unwrap_or_default();
                            problems.push(format!("{whose}{message}"));
                        }
                    }
                    Err(e) => {
                        println!("  FAILED (see status below)");
                        problems.push(e.message().to_owned());
                    }
                }
            }
        }
        Err(e) => problems.push(e.message().to_owned()),
    }

    if args.strict {
        problems.extend(warnings.iter().map(|w| format!("{w} (an error with --strict)")));
    }
    if problems.is_empty() && (warnings.is_empty() || args.strict) {
        println!("status:           OK");
        Ok(std::process::ExitCode::SUCCESS)
    } else if problems.is_empty() {
        println!("status:           OK, {} warning(s) (errors with --strict)", warnings.len());
        for w in &warnings {
            println!("  - warning: {w}");
        }
        Ok(std::process::ExitCode::SUCCESS)
    } else {
        println!("status:           {} problem(s)", problems.len());
        for p in &problems {
            println!("  - {p}");
        }
        Ok(std::process::ExitCode::FAILURE)
    }
}

/// Whether peer authentication is on, with where its secret came from and any warning about it
/// (never the secret); an invalid setting is a problem (reported once with the options).
fn authentication(cfg: &Config, env: &Environment, problems: &mut Vec<String>) {
    match ferry_peer_auth::options::read(cfg, env) {
        Ok(None) => println!(
            "authentication:   off: anyone who reaches the data and handshake ports is served, as by Mooncake \
             (set auth_secret_file or FERRY_AUTH_SECRET_FILE to require a shared secret; see docs/security.md)"
        ),
        Ok(Some(loaded)) => {
            println!(
                "authentication:   on ({}): secret from {} ({} bytes); data and handshake connections without it \
                 are refused, Mooncake peers included",
                ferry_peer_auth::SCHEME,
                loaded.secret.source(),
                loaded.secret.len()
            );
            for w in loaded.warnings {
                println!("  warning:        {w}");
            }
        }
        Err(e) => {
            println!("authentication:   INVALID (see below)");
            if !problems.iter().any(|p| p == e.message()) {
                problems.push(e.message().to_owned());
            }
        }
    }
}

/// The Ascend backends this node would run: one line each, saying why.
fn print_backends(b: &hccl::Backends, protocol: &str) {
    println!("ascend backend:   {} [from ascend_backend / FERRY_ASCEND_BACKEND, else protocol {protocol}]", b.asked);
    match &b.hixl {
        Ok(h) => println!(
            "  HIXL:           on: {h}; peers publishing rank_info.endpoints (Mooncake ascend_direct nodes, Ferry nodes with HIXL) are reached through it"
        ),
        Err(why) => println!("  HIXL:           off: {why}"),
    }
    match (&b.hccl, &b.hixl) {
        (Ok(()), Ok(_)) => {
            println!("  direct HCCL:    on, for peers publishing deviceIp/hostPort and no HIXL endpoint")
        }
        (Ok(()), Err(_)) => println!("  direct HCCL:    on, for every peer (fallback: HIXL is off)"),
        (Err(why), _) => println!("  direct HCCL:    off: {why}"),
    }
}

/// What carries an engine's notifications and probes with `server` (the store's own channel,
/// the registry's beside it, or none), and on which port.
fn control_channel(cfg: &Config, server: &MetadataServer, metadata: &ferry::MetadataRegistry) -> String {
    let port = match cfg.rpc_port {
        Some(p) => format!("RPC port {p} [{}]", source(cfg, "rpc_port")),
        None => "a free RPC port in 15000..17000 (published in the rpc entry)".to_owned(),
    };
    match (server, metadata.channel_name()) {
        (MetadataServer::Embedded, _) => {
            "none: the in-process store runs no listener (notifications and probes answer unsupported)".to_owned()
        }
        (MetadataServer::P2pHandshake, _) => {
            "the P2P handshake itself (peers reached at their names' ports)".to_owned()
        }
        (_, Some(name)) => format!("{name} beside the store, on {port}"),
        (_, None) => "none built into this binary (notifications and probes answer unsupported)".to_owned(),
    }
}

/// Which backend reaches `peer` (its descriptor read from the metadata service), and why.
async fn print_peer_route(cfg: &Config, b: &hccl::Backends, peer: &str) {
    // Only to read: the metadata client's own listeners (the P2P handshake's RPC port) bind
    // loopback, not the configured host (which may be another machine's address).
    let mut probe = cfg.clone();
    probe.local_hostname = Some("127.0.0.1".into());
    probe.base_port = None;
    let desc = async {
        // The store alone: no control channel is started beside it.
        let metadata = ferry::default_metadata().connect_store(&probe).await?;
        let key = ferry::MetadataKeys::new(cfg.cluster_id()).segment(peer);
        let bytes =
            metadata.get(&key).await?.ok_or_else(|| ferry::Error::not_found(format!("no descriptor at {key}")))?;
        ferry::SegmentDescriptor::from_json(&key, &bytes)
    };
    match tokio::time::timeout(std::time::Duration::from_secs(5), desc).await {
        Ok(Ok(d)) => match b.for_peer(&d) {
            Ok((backend, why)) => println!("  reached via:    {backend}: {why}"),
            Err(why) => println!("  reached via:    nothing: {why}"),
        },
        Ok(Err(e)) => println!("  reached via:    unknown: its descriptor could not be read ({})", e.message()),
        Err(_) => println!("  reached via:    unknown: the metadata service did not answer within 5 s"),
    }
}
