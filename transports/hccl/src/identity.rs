//! Who this transport is: the `acl` resolver link (the other Ascend links and the options are in
//! [`ferry_ascend_identity`], which needs no FFI), the local identity the transport refuses to
//! start without, peers' identities from their `rank_info`, and the two-rank rank tables built
//! from both.

use std::sync::Arc;

use async_trait::async_trait;
use ferry_ascend_runtime::{AclQueries, AscendError};
use ferry_ascend_sys::Library;
use ferry_core::{
    Error, ErrorKind, Identity, IdentityField, RankInfo, Resolution, ResolveQuery, ResolverChain, Result,
    SegmentDescriptor, SegmentResolver,
};
use serde_json::json;

/// Name of the ACL resolver link in a resolver chain.
pub const ACL_RESOLVER_NAME: &str = ferry_ascend_identity::ACL_RESOLVER;
/// Device port published when no rank table names one (Mooncake's default).
pub const DEFAULT_DEVICE_PORT: u16 = 16666;

/// Asks the ACL runtime which physical NPU this process's user device is.
///
/// - User device: what earlier links found; else the user device whose physical id is the one
///   earlier links found (scanning the visible devices); else the local rank; else device 0
///   when exactly one device is visible. Otherwise it does not answer (it never guesses).
/// - Physical device: `aclrtGetPhyDevIdByUserDevId`, then `aclrtGetPhyDevIdByLogicDevId`.
///   When the release has neither, it does not answer (the `env` link, which parses
///   `ASCEND_RT_VISIBLE_DEVICES`, and explicit configuration come before it in the default
///   order). A user device the runtime rejects is an error naming the device and the code.
///
/// Answers only for this process. Its ACL calls run on a blocking thread, never on an async
/// worker.
#[derive(Clone)]
pub struct AclQueryResolver {
    lib: std::result::Result<Arc<Library>, String>,
}

impl std::fmt::Debug for AclQueryResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.lib {
            Ok(lib) => f.debug_struct("AclQueryResolver").field("acl", &lib.paths().acl).finish(),
            Err(why) => f.debug_struct("AclQueryResolver").field("unavailable", why).finish(),
        }
    }
}

impl AclQueryResolver {
    /// A resolver asking `lib`.
    pub fn new(lib: Arc<Library>) -> Self {
        Self { lib: Ok(lib) }
    }

    /// A resolver for a process without CANN: it answers nothing (the transport that needs the
    /// answer reports the loader's error itself).
    pub fn unavailable(why: impl Into<String>) -> Self {
        Self { lib: Err(why.into()) }
    }

    fn resolve_blocking(lib: &Library, query: &ResolveQuery, known: &Identity) -> Result<Identity> {
        let acl_err = |e: AscendError| Error::new(ErrorKind::Config, format!("the ACL runtime: {e}")).with_source(e);
        let count = lib.device_count().map_err(acl_err)?;
        let mut out = Identity::default();
        let (user, why) = match (known.user_device, known.physical_device, query.local_rank) {
            (Some(u), _, _) => (u, None),
            (None, Some(phy), _) => {
                let mut found = None;
                for u in 0..count {
                    match lib.physical_device(u) {
                        Ok((p, _)) if p == phy => {
                            found = Some(u);
                            break;
                        }
                        Ok(_) => {}
                        Err(e) if e.is_not_supported() => return Ok(out),
                        Err(e) => return Err(acl_err(e)),
                    }
                }
                let Some(u) = found else {
                    return Err(Error::config(format!(
                        "physical NPU {phy} (resolved earlier) is not among the {count} device(s) visible to this \
                         process; check ASCEND_RT_VISIBLE_DEVICES and the device the configuration names"
                    )));
                };
                (u, Some(format!("the visible device whose physical id is {phy}")))
            }
            (None, None, Some(r)) => (r, Some(format!("user device {r} = local rank {r}"))),
            (None, None, None) if count == 1 => (0, Some("user device 0, the only one visible".to_owned())),
            (None, None, None) => return Ok(out),
        };
        if user >= count {
            return Err(Error::config(format!(
                "user device {user} does not exist: the ACL runtime sees {count} device(s) (after \
                 ASCEND_RT_VISIBLE_DEVICES); expected a local rank below {count}"
            )));
        }
        if let Some(why) = why {
            out.user_device = Some(user);
            out.details.insert(IdentityField::UserDevice, why);
        }
        match lib.physical_device(user) {
            Ok((phy, call)) => {
                out.physical_device = Some(phy);
                out.details.insert(IdentityField::PhysicalDevice, format!("{call}({user}) = {phy}"));
            }
            Err(e) if e.is_not_supported() => {}
            Err(e) => {
                return Err(Error::config(format!("the ACL runtime rejects user device {user}: {e}")).with_source(e));
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl SegmentResolver for AclQueryResolver {
    fn name(&self) -> &str {
        ACL_RESOLVER_NAME
    }

    async fn resolve(&self, query: &ResolveQuery, known: &Identity) -> Result<Identity> {
        if !query.is_local() {
            return Ok(Identity::default());
        }
        let lib = match &self.lib {
            Ok(lib) => lib.clone(),
            Err(why) => {
                tracing::debug!(why = %why, "acl resolver: CANN is not loadable; not answering");
                return Ok(Identity::default());
            }
        };
        let (query, known) = (query.clone(), known.clone());
        tokio::task::spawn_blocking(move || Self::resolve_blocking(&lib, &query, &known))
            .await
            .map_err(|e| Error::new(ErrorKind::Internal, format!("the ACL resolver panicked: {e}")))?
    }
}

/// `chain` with the `acl` link `acl` added if it has none: before `hccn_conf` (which needs the
/// physical id acl may find), else last. What the transport does at start, and what `ferry
/// doctor` shows.
pub fn with_acl_link(mut chain: ResolverChain, acl: Arc<dyn SegmentResolver>) -> ResolverChain {
    if chain.names().contains(&ACL_RESOLVER_NAME) {
        return chain;
    }
    if !chain.insert_before(ferry_ascend_identity::HCCN_CONF_RESOLVER, acl.clone()) {
        chain = chain.with(acl);
    }
    chain
}

/// Name of the current-device link.
pub const CURRENT_DEVICE_RESOLVER_NAME: &str = "current_device";

/// The device the thread that builds the engine has set (`aclrtGetDevice`), mapped to its
/// physical NPU through ACL (`aclrtGetPhyDevIdByUserDevId`): how Mooncake's Ascend transports
/// and ADXL learn their card, and what vLLM and torch_npu set before they create a transfer
/// engine. It is the first link of the default chain, so a vLLM worker that sees several
/// cards, has set one and exports no `LOCAL_RANK` starts on the card it set.
///
/// ACL's current device is per thread, so the link reads it when the chain is built
/// (the [`CurrentDeviceResolverFactory`] creates it on the thread that builds the engine: the
/// caller of `build_blocking`, the C API's and Python's `initialize`, or the task polling
/// `build().await`). A thread with no device set, or a process without CANN, answers nothing.
#[derive(Debug, Clone)]
pub struct CurrentDeviceResolver {
    /// The user id and what ACL made of it, read at creation.
    device: Option<(u32, PhysicalLookup)>,
}

/// The physical id of a user device and the ACL call that answered, or why ACL could not.
type PhysicalLookup = std::result::Result<(u32, &'static str), String>;

impl CurrentDeviceResolver {
    /// Reads the calling thread's current device from `lib`.
    pub fn of_calling_thread(lib: &Library) -> Self {
        let device = match lib.current_device() {
            Ok(Some(user)) => Some((user, lib.physical_device(user).map_err(|e| e.to_string()))),
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, "current_device resolver: aclrtGetDevice failed; not answering");
                None
            }
        };
        Self { device }
    }

    /// A link that answers nothing (no CANN, or no device set).
    pub fn none() -> Self {
        Self { device: None }
    }
}

#[async_trait]
impl SegmentResolver for CurrentDeviceResolver {
    fn name(&self) -> &str {
        CURRENT_DEVICE_RESOLVER_NAME
    }

    async fn resolve(&self, query: &ResolveQuery, _known: &Identity) -> Result<Identity> {
        let mut out = Identity::default();
        let Some((user, physical)) = &self.device else { return Ok(out) };
        if !query.is_local() {
            return Ok(out);
        }
        out.user_device = Some(*user);
        out.details
            .insert(IdentityField::UserDevice, format!("aclrtGetDevice on the thread that built the engine = {user}"));
        match physical {
            Ok((phy, call)) => {
                out.physical_device = Some(*phy);
                out.details.insert(IdentityField::PhysicalDevice, format!("{call}({user}) = {phy}"));
            }
            Err(why) => {
                return Err(Error::config(format!(
                    "the ACL runtime cannot map this thread's current device {user} to a physical NPU: {why}"
                )));
            }
        }
        Ok(out)
    }
}

/// Installs the `current_device` link: it reads the device of the thread that builds the engine
/// (see [`CurrentDeviceResolver`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct CurrentDeviceResolverFactory;

impl ferry_core::ResolverFactory for CurrentDeviceResolverFactory {
    fn name(&self) -> &str {
        CURRENT_DEVICE_RESOLVER_NAME
    }

    fn create(&self, ctx: &ferry_core::ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
        let search = ferry_ascend_sys::SearchPath::from_env_with(|k| ctx.env.get(k));
        Ok(Arc::new(match Library::load_from(&search) {
            Ok(lib) => CurrentDeviceResolver::of_calling_thread(&lib),
            Err(_) => CurrentDeviceResolver::none(),
        }))
    }
}

/// Installs the `acl` link in a [`ferry_core::ResolverRegistry`] (it then takes its place in the
/// chain's order). CANN is looked up through the resolver environment's search path
/// (`FERRY_ASCEND_LIB_DIR`, ...); without CANN the link answers nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct AclResolverFactory;

impl ferry_core::ResolverFactory for AclResolverFactory {
    fn name(&self) -> &str {
        ACL_RESOLVER_NAME
    }

    fn create(&self, ctx: &ferry_core::ResolverContext<'_>) -> Result<Arc<dyn SegmentResolver>> {
        let search = ferry_ascend_sys::SearchPath::from_env_with(|k| ctx.env.get(k));
        Ok(Arc::new(match Library::load_from(&search) {
            Ok(lib) => AclQueryResolver::new(lib),
            Err(e) => AclQueryResolver::unavailable(e.to_string()),
        }))
    }
}

/// Installs every Ascend identity link in `registry`: the `rank_table`, `env` and `hccn_conf`
/// links of [`ferry_ascend_identity`] with their places in the default order, and the `acl`
/// link ([`AclResolverFactory`]), so the order is `config, hostname, rank_table, env, acl,
/// hccn_conf, port_offset`. The `ferry` facade does this with its `hccl` feature; an engine
/// built with `ferry_core`'s own builder and this transport needs it too
/// (`EngineBuilder::resolver_registry(ferry_transport_hccl::resolver_registry())`). The `acl`
/// link loads CANN from the resolver environment's search path; for a transport given its
/// library ([`HcclTransportFactory::with_library`](crate::HcclTransportFactory::with_library)),
/// install [`ferry_ascend_identity::install`] alone: the transport then inserts an `acl` link
/// on that library.
pub fn install_resolvers(registry: &mut ferry_core::ResolverRegistry) {
    ferry_ascend_identity::install(registry);
    registry.install(Arc::new(AclResolverFactory));
    // First: the device the caller set is what it means to drive.
    let first = registry.default_order().first().map(|s| s.to_string());
    registry.place_in_default_order(
        CURRENT_DEVICE_RESOLVER_NAME,
        first.as_deref(),
        Some("the HCCL transport, crate ferry-transport-hccl"),
    );
    registry.install(Arc::new(CurrentDeviceResolverFactory));
}

/// The core's links plus every Ascend link ([`install_resolvers`]).
pub fn resolver_registry() -> ferry_core::ResolverRegistry {
    let mut r = ferry_core::ResolverRegistry::with_builtin();
    install_resolvers(&mut r);
    r
}

/// This transport's resolved identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalIdentity {
    /// Segment name.
    pub segment: String,
    /// Host IP published in `rank_info.hostIp`.
    pub host_ip: String,
    /// User device id the device threads bind to.
    pub user_device: u32,
    /// Physical NPU id.
    pub physical_device: u32,
    /// Device (NIC) IP.
    pub device_ip: String,
    /// Device port.
    pub device_port: u16,
    /// Rank id published (the resolved rank, else the physical id as Mooncake does).
    pub rank: u32,
    /// Atlas A3: the device's super-pod device id and super pod id (what v1.2 rank tables
    /// between servers need), read with `aclrtGetDeviceInfo`; `None` elsewhere.
    pub super_pod: Option<SuperPod>,
}

/// An Atlas A3 device's place in its super pod (HIXL's v1.2 rank tables: `super_device_id` per
/// device, `super_pod_list` per server).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperPod {
    /// `ACL_DEV_ATTR_SUPER_POD_DEVICE_ID`.
    pub device_id: String,
    /// `ACL_DEV_ATTR_SUPER_POD_ID`.
    pub pod_id: String,
}

impl LocalIdentity {
    /// Builds the identity from a resolution; an error names what is missing, shows what was
    /// resolved and from where, and says how to supply it. Never assumes device 0.
    ///
    /// A resolution whose sources disagree about the physical or the user device is refused
    /// (the first answer would bind one card and publish another): the error shows both
    /// answers, the resolver of each and where it read them.
    pub fn from_resolution(segment: &str, host_fallback: &str, r: &Resolution) -> Result<Self> {
        Self::from_resolution_for(segment, host_fallback, r, true)
    }

    /// [`from_resolution`](Self::from_resolution), with the device IP required only when
    /// `need_device_ip` (direct HCCL builds rank tables from it; HIXL finds its device NICs
    /// itself). Without one the identity's `device_ip` is empty.
    pub fn from_resolution_for(
        segment: &str,
        host_fallback: &str,
        r: &Resolution,
        need_device_ip: bool,
    ) -> Result<Self> {
        let id = &r.identity;
        let explain = || {
            let text = r.to_string();
            let text = text.trim_end();
            format!("\nresolved so far (consulted {}):\n{text}", r.consulted.join(", "))
        };
        r.refuse_device_disagreements()
            .map_err(|e| Error::config(format!("ascend transport: {}{}", e.message(), explain())))?;
        let physical = id.physical_device.ok_or_else(|| {
            Error::config(format!(
                "ascend transport: cannot tell which physical NPU this process drives; set LOCAL_RANK (or \
                 FERRY_LOCAL_RANK) with ASCEND_RT_VISIBLE_DEVICES, or ASCEND_NPU_PHY_ID, or name it in the segment \
                 name (ip:port:npu_N), a rank table or the config's physical_devices{}",
                explain()
            ))
        })?;
        let user = id.user_device.ok_or_else(|| {
            Error::config(format!(
                "ascend transport: physical NPU {physical} is known but not which device id ACL uses for it (the \
                 user id after ASCEND_RT_VISIBLE_DEVICES); set LOCAL_RANK or keep the `acl` resolver in the chain{}",
                explain()
            ))
        })?;
        let device_ip = id.device_ip.clone().or_else(|| (!need_device_ip).then(String::new)).ok_or_else(|| {
            Error::config(format!(
                "ascend transport: no device IP for physical NPU {physical}; add `address_{physical}=<ip>` (or \
                 `IPv6address_{physical}=<ip>`) to /etc/hccn.conf (or the file named by hccn_conf_path / \
                 FERRY_HCCN_CONF), set it with `hccn_tool -i {physical} -ip -s address <ip> netmask <mask>` (asked \
                 when there is no hccn.conf), or use a rank table that lists it{}",
                explain()
            ))
        })?;
        Ok(Self {
            segment: segment.to_owned(),
            host_ip: id.host.clone().unwrap_or_else(|| host_fallback.to_owned()),
            user_device: user,
            physical_device: physical,
            device_ip,
            device_port: id.device_port.unwrap_or(DEFAULT_DEVICE_PORT),
            rank: id.rank.unwrap_or(physical),
            super_pod: None,
        })
    }

    /// The `rank_info` published in the descriptor.
    pub fn rank_info(&self, host_port: u16) -> RankInfo {
        RankInfo {
            rank_id: u64::from(self.rank),
            host_ip: self.host_ip.clone(),
            host_port: u64::from(host_port),
            device_logic_id: u64::from(self.user_device),
            device_phy_id: u64::from(self.physical_device),
            device_type: 0,
            device_ip: self.device_ip.clone(),
            device_port: u64::from(self.device_port),
            pid: u64::from(std::process::id()),
            super_device_id: self.super_pod.as_ref().map(|s| s.device_id.clone()),
            super_pod_id: self.super_pod.as_ref().map(|s| s.pod_id.clone()),
            endpoints: Vec::new(),
            extra: Default::default(),
        }
    }

    /// This side as a rank-table member.
    pub fn member(&self) -> RankMember {
        RankMember {
            segment: self.segment.clone(),
            server: self.host_ip.clone(),
            device_id: self.physical_device,
            device_ip: self.device_ip.clone(),
            device_port: self.device_port,
            super_pod: self.super_pod.clone(),
        }
    }
}

/// What this transport needs of a peer, read from its descriptor's `rank_info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    /// Segment name.
    pub segment: String,
    /// Control channel host.
    pub host_ip: String,
    /// Control channel port.
    pub host_port: u16,
    /// Rank-table member.
    pub member: RankMember,
}

impl PeerIdentity {
    /// Reads a peer's `rank_info`; an error names the segment and the missing field.
    pub fn from_descriptor(d: &SegmentDescriptor) -> Result<Self> {
        let bad = |what: &str| Error::invalid(format!("segment `{}` publishes no usable rank_info: {what}", d.name));
        let r = d.rank_info.as_ref().ok_or_else(|| bad("the field is absent"))?;
        if r.host_ip.is_empty() {
            return Err(bad("hostIp is empty"));
        }
        if r.device_ip.is_empty() {
            return Err(bad("deviceIp is empty"));
        }
        let host_port =
            u16::try_from(r.host_port).ok().filter(|p| *p != 0).ok_or_else(|| bad("hostPort is not a port"))?;
        let device_port = u16::try_from(r.device_port).map_err(|_| bad("devicePort is not a port"))?;
        let device_id = u32::try_from(r.device_phy_id).map_err(|_| bad("devicePhyId is out of range"))?;
        let super_pod = match (&r.super_device_id, &r.super_pod_id) {
            (Some(d), Some(p)) => Some(SuperPod { device_id: d.clone(), pod_id: p.clone() }),
            _ => None,
        };
        Ok(Self {
            segment: d.name.clone(),
            host_ip: r.host_ip.clone(),
            host_port,
            member: RankMember {
                segment: d.name.clone(),
                server: r.host_ip.clone(),
                device_id,
                device_ip: r.device_ip.clone(),
                device_port,
                super_pod,
            },
        })
    }
}

/// One rank of a two-rank table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankMember {
    /// Segment name (tie-breaker of the order).
    pub segment: String,
    /// Server id (the host IP).
    pub server: String,
    /// Physical device id.
    pub device_id: u32,
    /// Device IP.
    pub device_ip: String,
    /// Device port.
    pub device_port: u16,
    /// Atlas A3: its place in its super pod.
    pub super_pod: Option<SuperPod>,
}

/// A two-rank HCCL rank table (the JSON string HCCL takes), and each member's rank: v1.2 with
/// `super_device_id` and `super_pod_list` when both members are Atlas A3 devices (HCCL needs
/// them between servers there: HIXL's `RankTableGeneratorV2`), else v1.0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairTable {
    /// The table.
    pub json: String,
    /// Rank of the first argument of [`PairTable::build`].
    pub rank_a: u32,
    /// Rank of the second.
    pub rank_b: u32,
}

impl PairTable {
    /// Builds the table for `a` and `b`. The order is deterministic — by (server, device id,
    /// segment name) — so both sides build the same table whichever one starts. Members on the
    /// same server share one `server_list` entry.
    pub fn build(a: &RankMember, b: &RankMember) -> Self {
        let key = |m: &RankMember| (m.server.clone(), m.device_id, m.segment.clone());
        let a_first = key(a) <= key(b);
        let ordered = if a_first { [a, b] } else { [b, a] };
        let a3 = ordered.iter().all(|m| m.super_pod.is_some());
        let mut servers: Vec<(String, Vec<serde_json::Value>, Option<String>)> = Vec::new();
        for (rank, m) in ordered.iter().enumerate() {
            let mut dev = json!({
                "device_id": m.device_id.to_string(),
                "device_ip": m.device_ip,
                "device_port": m.device_port.to_string(),
                "rank_id": rank.to_string(),
            });
            if let (true, Some(sp)) = (a3, &m.super_pod) {
                dev["super_device_id"] = json!(sp.device_id);
            }
            let pod = m.super_pod.as_ref().filter(|_| a3).map(|sp| sp.pod_id.clone());
            match servers.iter_mut().find(|(s, _, _)| *s == m.server) {
                Some((_, devs, _)) => devs.push(dev),
                None => servers.push((m.server.clone(), vec![dev], pod)),
            }
        }
        // `host_ip` must be a literal IP address (HCCL refuses a host name with HCCL_E_PARA) and
        // is optional: given only when the server's name is one.
        let server_list: Vec<serde_json::Value> = servers
            .iter()
            .map(|(s, devs, _)| match s.parse::<std::net::IpAddr>() {
                Ok(_) => json!({"server_id": s, "host_ip": s, "device": devs}),
                Err(_) => json!({"server_id": s, "device": devs}),
            })
            .collect();
        let mut table = json!({
            "status": "completed",
            "version": if a3 { "1.2" } else { "1.0" },
            "server_count": server_list.len().to_string(),
            "server_list": server_list,
        });
        if a3 {
            let mut pods: Vec<(String, Vec<serde_json::Value>)> = Vec::new();
            for (s, _, pod) in &servers {
                let pod = pod.clone().unwrap_or_default();
                match pods.iter_mut().find(|(p, _)| *p == pod) {
                    Some((_, list)) => list.push(json!({"server_id": s})),
                    None => pods.push((pod, vec![json!({"server_id": s})])),
                }
            }
            table["super_pod_list"] =
                pods.into_iter().map(|(p, list)| json!({"super_pod_id": p, "server_list": list})).collect();
        }
        let (rank_a, rank_b) = if a_first { (0, 1) } else { (1, 0) };
        Self { json: table.to_string(), rank_a, rank_b }
    }

    /// A communicator name both sides derive the same way: a hash of the table and the epoch
    /// (fits HCCL's 128-byte name).
    pub fn comm_name(&self, epoch: u64) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.json.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("ferry-{h:016x}-e{epoch}")
    }

    /// Checks that rank `rank` of `json` is `me` (a target checks the table an initiator sent).
    pub fn check_member(json: &str, rank: u32, me: &RankMember) -> std::result::Result<(), String> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("rank table is not JSON: {e}"))?;
        let servers = v["server_list"].as_array().ok_or("rank table has no server_list")?;
        let want = rank.to_string();
        for s in servers {
            for d in s["device"].as_array().into_iter().flatten() {
                if d["rank_id"].as_str() == Some(want.as_str()) {
                    let id = d["device_id"].as_str().unwrap_or("");
                    let ip = d["device_ip"].as_str().unwrap_or("");
                    return if id == me.device_id.to_string() && ip == me.device_ip {
                        Ok(())
                    } else {
                        Err(format!(
                            "rank {rank} of the rank table is device {id} at {ip}, but this engine is physical NPU {} at {}",
                            me.device_id, me.device_ip
                        ))
                    };
                }
            }
        }
        Err(format!("rank table has no rank {rank}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(seg: &str, server: &str, dev: u32) -> RankMember {
        RankMember {
            segment: seg.into(),
            server: server.into(),
            device_id: dev,
            device_ip: format!("192.168.1.{dev}"),
            device_port: 16666,
            super_pod: None,
        }
    }

    #[test]
    fn both_sides_build_the_same_table() {
        let p = member("10.0.0.1:17000", "10.0.0.1", 4);
        let d = member("10.0.0.2:17100", "10.0.0.2", 0);
        let from_p = PairTable::build(&p, &d);
        let from_d = PairTable::build(&d, &p);
        assert_eq!(from_p.json, from_d.json);
        assert_eq!((from_p.rank_a, from_p.rank_b), (0, 1));
        assert_eq!((from_d.rank_a, from_d.rank_b), (1, 0));
        assert_eq!(from_p.comm_name(3), from_d.comm_name(3));
        assert_ne!(from_p.comm_name(3), from_p.comm_name(4));
        let v: serde_json::Value = serde_json::from_str(&from_p.json).unwrap();
        assert_eq!(v["server_count"], "2");
        assert_eq!(v["server_list"][0]["device"][0]["device_id"], "4");
        assert_eq!(v["server_list"][1]["device"][0]["rank_id"], "1");
        assert!(PairTable::check_member(&from_p.json, 1, &d).is_ok());
        let e = PairTable::check_member(&from_p.json, 0, &d).unwrap_err();
        assert!(e.contains("physical NPU 0"), "{e}");
    }

    #[test]
    fn atlas_a3_members_get_a_v12_table_and_names_no_host_ip() {
        let sp = |d: &str| Some(SuperPod { device_id: d.into(), pod_id: "3".into() });
        let a = RankMember { super_pod: sp("100"), ..member("10.0.0.1:1", "10.0.0.1", 4) };
        let b = RankMember { super_pod: sp("105"), ..member("node-b:2", "node-b", 5) };
        let t = PairTable::build(&a, &b);
        let v: serde_json::Value = serde_json::from_str(&t.json).unwrap();
        assert_eq!(v["version"], "1.2");
        assert_eq!(v["server_list"][0]["device"][0]["super_device_id"], "100");
        assert_eq!(v["server_list"][1]["device"][0]["super_device_id"], "105");
        assert_eq!(v["server_list"][0]["host_ip"], "10.0.0.1");
        assert!(v["server_list"][1].get("host_ip").is_none(), "a host name is never a host_ip: {v}");
        assert_eq!(v["super_pod_list"][0]["super_pod_id"], "3");
        assert_eq!(v["super_pod_list"][0]["server_list"].as_array().unwrap().len(), 2);
        // One member without super-pod ids: v1.0, no A3 fields.
        let t = PairTable::build(&a, &member("x:1", "10.0.0.9", 1));
        let v: serde_json::Value = serde_json::from_str(&t.json).unwrap();
        assert_eq!(v["version"], "1.0");
        assert!(v.get("super_pod_list").is_none() && v["server_list"][0]["device"][0].get("super_device_id").is_none());
    }

    #[test]
    fn one_server_holds_both_devices_of_a_host() {
        let a = member("h:1", "10.0.0.1", 5);
        let b = member("h:2", "10.0.0.1", 4);
        let t = PairTable::build(&a, &b);
        let v: serde_json::Value = serde_json::from_str(&t.json).unwrap();
        assert_eq!(v["server_count"], "1");
        assert_eq!(v["server_list"][0]["device"].as_array().unwrap().len(), 2);
        assert_eq!(v["server_list"][0]["device"][0]["device_id"], "4", "ordered by device id");
        assert_eq!((t.rank_a, t.rank_b), (1, 0));
    }

    #[test]
    fn a_missing_identity_is_refused_with_what_was_resolved() {
        let r = Resolution {
            identity: Identity { host: Some("10.0.0.1".into()), port: Some(17000), ..Identity::default() },
            consulted: vec!["hostname".into(), "env".into(), "acl".into()],
            ..Resolution::default()
        };
        let e = LocalIdentity::from_resolution("10.0.0.1:17000", "127.0.0.1", &r).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("cannot tell which physical NPU"), "{e}");
        assert!(e.message().contains("consulted hostname, env, acl"), "{e}");
        let r = Resolution {
            identity: Identity { physical_device: Some(4), user_device: Some(0), ..Identity::default() },
            ..Resolution::default()
        };
        let e = LocalIdentity::from_resolution("x", "127.0.0.1", &r).unwrap_err();
        assert!(e.message().contains("address_4="), "{e}");
    }

    /// The resolution of the built-in chain for `config` and `env` at local rank `rank`.
    async fn resolve(config: &str, env: &[(&str, &str)], rank: u32) -> Resolution {
        let mut config = ferry_core::Config::from_json_str(config, None).unwrap();
        config.set_local_rank(rank);
        let env = ferry_core::Environment::from_pairs(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let chain = ferry_ascend_identity::registry().build_chain(&config, &env).unwrap();
        chain.resolve(&ResolveQuery::local(config.local_segment_name().unwrap(), Some(rank))).await.unwrap()
    }

    #[tokio::test]
    async fn a_card_named_earlier_is_bound_by_its_position_among_the_visible_cards() {
        let dir = std::env::temp_dir().join(format!("ferry-hccl-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let hccn = dir.join("hccn.conf");
        std::fs::write(&hccn, "address_4=29.0.0.5\naddress_5=29.0.0.6\n").unwrap();
        let config = format!(r#"{{"local_hostname": "10.0.0.5:17000:npu_4", "hccn_conf_path": {:?}}}"#, hccn);
        // Every card visible: card 4 is user device 4, whatever the local rank (0 here).
        let r = resolve(&config, &[("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")], 0).await;
        let me = LocalIdentity::from_resolution("10.0.0.5:17000:npu_4", "127.0.0.1", &r).unwrap();
        assert_eq!((me.physical_device, me.user_device, me.device_ip.as_str()), (4, 4, "29.0.0.5"));
        // A container showing cards 4 and 5: card 4 is user device 0.
        let r = resolve(&config, &[("ASCEND_RT_VISIBLE_DEVICES", "4,5")], 1).await;
        let me = LocalIdentity::from_resolution("10.0.0.5:17000:npu_4", "127.0.0.1", &r).unwrap();
        assert_eq!((me.physical_device, me.user_device), (4, 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn sources_that_disagree_about_the_device_are_refused_with_both_answers() {
        // The segment name says card 3, the environment card 2: neither is picked.
        let r = resolve(r#"{"local_hostname": "10.0.0.5:17000:npu_3"}"#, &[("ASCEND_NPU_PHY_ID", "2")], 0).await;
        assert_eq!(r.identity.physical_device, Some(3));
        let e = LocalIdentity::from_resolution("10.0.0.5:17000:npu_3", "127.0.0.1", &r).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let m = e.message();
        assert!(m.starts_with("ascend transport: the identity sources disagree about the device"), "{m}");
        assert!(
            m.contains(
                "physical_device: `hostname` says 3 (`npu_3` in segment name \"10.0.0.5:17000:npu_3\"), but \
                        `env` says 2 (ASCEND_NPU_PHY_ID=\"2\")"
            ),
            "{m}"
        );
        assert!(m.contains("resolved so far (consulted config, hostname, rank_table, env"), "{m}");

        // A user device the ACL runtime maps elsewhere than an earlier link (the reviewer's
        // case before the env link's fix: env bound card 0, the rank table said card 4).
        let answer = |field, value: &str, resolver: &str, detail: &str| ferry_core::Answer {
            field,
            value: value.into(),
            resolver: resolver.into(),
            detail: detail.into(),
        };
        let r = Resolution {
            identity: Identity {
                physical_device: Some(4),
                user_device: Some(0),
                device_ip: Some("29.0.0.5".into()),
                ..Identity::default()
            },
            answers: vec![
                answer(IdentityField::PhysicalDevice, "4", "rank_table", "rt.json decode_device_list[0]"),
                answer(IdentityField::UserDevice, "0", "env", "user device 0 = local rank 0"),
                answer(IdentityField::DeviceIp, "29.0.0.5", "rank_table", "rt.json decode_device_list[0]"),
            ],
            disagreements: vec![
                answer(IdentityField::PhysicalDevice, "0", "env", "ASCEND_RT_VISIBLE_DEVICES=\"0,1\" entry 0"),
                answer(IdentityField::UserDevice, "4", "acl", "the visible device whose physical id is 4"),
            ],
            consulted: vec!["rank_table".into(), "env".into(), "acl".into()],
        };
        let m = LocalIdentity::from_resolution("x", "127.0.0.1", &r).unwrap_err().message().to_owned();
        assert!(
            m.contains("physical_device: `rank_table` says 4 (rt.json decode_device_list[0]), but `env` says 0"),
            "{m}"
        );
        assert!(
            m.contains(
                "user_device: `env` says 0 (user device 0 = local rank 0), but `acl` says 4 (the visible device"
            ),
            "{m}"
        );
        // Without the disagreements the same identity is accepted.
        let agreed = Resolution { disagreements: Vec::new(), ..r };
        assert_eq!(LocalIdentity::from_resolution("x", "127.0.0.1", &agreed).unwrap().user_device, 0);
    }

    #[test]
    fn peers_without_rank_info_are_named() {
        let d = SegmentDescriptor::new("10.0.0.9:1", "ascend");
        let e = PeerIdentity::from_descriptor(&d).unwrap_err();
        assert!(e.message().contains("10.0.0.9:1") && e.message().contains("absent"), "{e}");
    }
}
