//! The `env` link: the physical NPU (`ASCEND_NPU_PHY_ID`, `PHYSICAL_DEVICES`) and the user
//! device (`ASCEND_RT_VISIBLE_DEVICES`, whose entries are logical ids) from the environment.

use std::fmt;

use async_trait::async_trait;

pub use ferry_core::DEVICE_ID_LIMIT;
use ferry_core::{Environment, Error, Identity, IdentityField, ResolveQuery, Result, SegmentResolver};

/// CANN's device-visibility variable: comma-separated logical device ids; the process's user
/// device `i` is the `i`-th entry.
pub const VISIBLE_DEVICES_ENV: &str = "ASCEND_RT_VISIBLE_DEVICES";
/// vllm-ascend's list of physical devices, indexed by local rank.
pub const PHYSICAL_DEVICES_ENV: &str = "PHYSICAL_DEVICES";
/// SGLang's physical NPU id of this process.
pub const NPU_PHY_ID_ENV: &str = "ASCEND_NPU_PHY_ID";

/// Why CANN stops reading `ASCEND_RT_VISIBLE_DEVICES` at an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VisibleEntryProblem {
    /// Nothing between two commas (or the whole value is empty).
    Empty,
    /// The entry contains whitespace (`"4, 5"`).
    Whitespace,
    /// The entry is not a decimal number.
    NotANumber,
    /// The entry is not below the device-id limit.
    OutOfRange {
        /// The limit ([`DEVICE_ID_LIMIT`]).
        limit: u32,
    },
    /// The id appeared earlier in the list.
    Duplicate,
    /// The id is smaller than the one before it (entries must ascend).
    NotAscending {
        /// The entry before it.
        previous: u32,
    },
}

impl fmt::Display for VisibleEntryProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VisibleEntryProblem::Empty => f.write_str("is empty"),
            VisibleEntryProblem::Whitespace => f.write_str("contains whitespace"),
            VisibleEntryProblem::NotANumber => f.write_str("is not a device id (a whole number)"),
            VisibleEntryProblem::OutOfRange { limit } => write!(f, "is out of range (device ids are below {limit})"),
            VisibleEntryProblem::Duplicate => f.write_str("repeats an earlier entry"),
            VisibleEntryProblem::NotAscending { previous } => {
                write!(f, "is smaller than the entry before it ({previous}); entries must ascend")
            }
        }
    }
}

/// Where and why the parse of `ASCEND_RT_VISIBLE_DEVICES` stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisibleDevicesProblem {
    /// 0-based index of the offending entry.
    pub index: usize,
    /// The entry as written.
    pub entry: String,
    /// What is wrong with it.
    pub reason: VisibleEntryProblem,
}

/// `ASCEND_RT_VISIBLE_DEVICES` read with CANN's rules: comma separated, ascending, no repeats,
/// and parsing stops at the first bad entry (the entries before it stay visible to CANN).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisibleDevices {
    /// The ids CANN uses (the entries before the first bad one).
    pub ids: Vec<u32>,
    /// The first bad entry, if any.
    pub problem: Option<VisibleDevicesProblem>,
}

/// Parses an `ASCEND_RT_VISIBLE_DEVICES` value the way CANN does (see [`VisibleDevices`]);
/// ids must be below `limit`.
pub fn parse_visible_devices(value: &str, limit: u32) -> VisibleDevices {
    let mut ids: Vec<u32> = Vec::new();
    for (index, entry) in value.split(',').enumerate() {
        let reason = if entry.is_empty() {
            Some(VisibleEntryProblem::Empty)
        } else if entry.contains(char::is_whitespace) {
            Some(VisibleEntryProblem::Whitespace)
        } else if !entry.bytes().all(|b| b.is_ascii_digit()) {
            Some(VisibleEntryProblem::NotANumber)
        } else {
            match entry.parse::<u32>() {
                Ok(id) if id >= limit => Some(VisibleEntryProblem::OutOfRange { limit }),
                Err(_) => Some(VisibleEntryProblem::OutOfRange { limit }),
                Ok(id) if ids.contains(&id) => Some(VisibleEntryProblem::Duplicate),
                Ok(id) => match ids.last() {
                    Some(&previous) if id < previous => Some(VisibleEntryProblem::NotAscending { previous }),
                    _ => {
                        ids.push(id);
                        None
                    }
                },
            }
        };
        if let Some(reason) = reason {
            return VisibleDevices {
                ids,
                problem: Some(VisibleDevicesProblem { index, entry: entry.to_owned(), reason }),
            };
        }
    }
    VisibleDevices { ids, problem: None }
}

impl VisibleDevices {
    /// The ids, or an error naming the variable, its value, the bad entry and what CANN makes
    /// of it: Ferry does not use a list CANN would only partly honour.
    pub fn into_result(self, value: &str) -> Result<Vec<u32>> {
        match self.problem {
            None => Ok(self.ids),
            Some(p) => {
                let cann = if self.ids.is_empty() {
                    "CANN stops parsing there and would see no device".to_owned()
                } else {
                    format!("CANN stops parsing there and would use only {:?}", self.ids)
                };
                let entry = if value.is_empty() {
                    "the value is empty".to_owned()
                } else {
                    format!("entry {} ({:?}) {}", p.index, p.entry, p.reason)
                };
                Err(Error::config(format!(
                    "{VISIBLE_DEVICES_ENV}={value:?}: {entry}; {cann}. Expected comma-separated ascending \
                     device ids below {DEVICE_ID_LIMIT} without spaces or repeats, e.g. \"4,5\""
                )))
            }
        }
    }
}

/// Parses a comma-separated list of physical device ids (`PHYSICAL_DEVICES`); `var` names the
/// source in errors. Spaces around entries are allowed (Python's `int` allows them); empty,
/// non-numeric, out-of-range or repeated entries are errors.
pub fn parse_device_list(var: &str, value: &str) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (i, raw) in value.split(',').enumerate() {
        let id = parse_device_id(raw.trim()).map_err(|why| {
            Error::config(format!(
                "{var}={value:?}: entry {i} ({raw:?}) {why}; expected comma-separated physical device ids, e.g. \"4,5\""
            ))
        })?;
        if ids.contains(&id) {
            return Err(Error::config(format!("{var}={value:?}: device {id} is listed twice")));
        }
        ids.push(id);
    }
    Ok(ids)
}

fn parse_device_id(s: &str) -> std::result::Result<u32, String> {
    if s.is_empty() {
        return Err("is empty".into());
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err("is not a whole number".into());
    }
    match s.parse::<u32>() {
        Ok(id) if id < DEVICE_ID_LIMIT => Ok(id),
        _ => Err(format!("is out of range (device ids are below {DEVICE_ID_LIMIT})")),
    }
}

/// The `env` link: this process's physical NPU (and user device) from the environment.
///
/// - `ASCEND_NPU_PHY_ID=<phy>`: the physical id itself.
/// - `PHYSICAL_DEVICES=<phy>,<phy>,...`: entry `local_rank` (the only entry when there is one).
/// - `ASCEND_RT_VISIBLE_DEVICES=<id>,<id>,...` (CANN's rules, see [`parse_visible_devices`]):
///   the **user device** only. Its entries are *logical* ids (CANN's environment reference),
///   which equal physical ids on bare metal only, so this link never claims a physical device
///   from them: the `acl` link maps the user device through the runtime. The user device is
///   what an earlier link resolved; else, when an earlier link resolved the physical device, its
///   position in the list when the list names it (true on bare metal; inside a container the
///   link does not answer and `acl` finds the visible device of that physical id); else the
///   local rank (each rank sets the device of its own index, as vLLM does); else 0 when only one
///   device is visible.
///
/// So a decode rank 0 whose rank table names physical card 4, with all eight cards visible
/// (`ASCEND_RT_VISIBLE_DEVICES=0,1,...,7`), gets user device 4 (not 0, which is card 0); with
/// `ASCEND_RT_VISIBLE_DEVICES=4,5,6,7` it gets user device 0.
///
/// Variables that disagree are an error naming both. A malformed variable is an error naming
/// it and its value, as is a user device or rank with no entry; when the index is unknown
/// (no rank, several entries) the variable does not answer. Peers are not its to answer.
#[derive(Debug, Clone, Default)]
pub struct EnvResolver {
    env: Environment,
}

impl EnvResolver {
    /// Reads `env`.
    pub fn new(env: Environment) -> Self {
        Self { env }
    }
}

#[async_trait]
impl SegmentResolver for EnvResolver {
    fn name(&self) -> &str {
        "env"
    }

    async fn resolve(&self, query: &ResolveQuery, known: &Identity) -> Result<Identity> {
        if !query.is_local() {
            return Ok(Identity::default());
        }
        let rank = query.local_rank;
        let mut claims: Vec<(u32, String)> = Vec::new();
        let mut out = Identity::default();

        if let Some(v) = self.env.get_nonempty(NPU_PHY_ID_ENV) {
            let id = parse_device_id(v.trim()).map_err(|why| {
                Error::config(format!("{NPU_PHY_ID_ENV}={v:?} {why}; expected the physical NPU id, e.g. \"5\""))
            })?;
            claims.push((id, format!("{NPU_PHY_ID_ENV}={v:?}")));
        }

        if let Some(v) = self.env.get_nonempty(PHYSICAL_DEVICES_ENV) {
            let list = parse_device_list(PHYSICAL_DEVICES_ENV, &v)?;
            let index = match rank {
                Some(r) => Some((r, format!("local rank {r}"))),
                None if list.len() == 1 => Some((0, "its only entry".to_owned())),
                None => None,
            };
            if let Some((i, why)) = index {
                let id = *list.get(i as usize).ok_or_else(|| {
                    Error::config(format!(
                        "{PHYSICAL_DEVICES_ENV}={v:?} has no entry for local rank {i} ({} entries); expected one \
                         physical device id per local rank",
                        list.len()
                    ))
                })?;
                claims.push((id, format!("{PHYSICAL_DEVICES_ENV}={v:?} entry {i} ({why})")));
            } else {
                tracing::debug!("{PHYSICAL_DEVICES_ENV}={v:?} lists several devices and the local rank is unknown");
            }
        }

        if let Some(v) = self.env.get(VISIBLE_DEVICES_ENV) {
            let ids = parse_visible_devices(&v, DEVICE_ID_LIMIT).into_result(&v)?;
            let user = match (known.user_device, known.physical_device, rank) {
                (Some(u), _, _) => Some((u, format!("user device {u}"))),
                // The physical device is already known (a rank table, the segment name, the
                // config): the user device is its position in the list, whatever the rank.
                // On bare metal logical ids are physical ids: the user device is the physical
                // device's position in the list. Inside a container they are not; when the list
                // lacks it this link does not answer and the `acl` link finds the visible device
                // of that physical id (and were the position wrong, `acl`'s mapping disagrees and
                // the identity is refused, never used).
                (None, Some(phy), _) => match ids.iter().position(|&id| id == phy) {
                    Some(position) => {
                        let u = position as u32;
                        Some((
                            u,
                            format!(
                                "user device {u}, the position of {phy} (the physical device resolved earlier, read \
                                 as a logical id: true on bare metal)"
                            ),
                        ))
                    }
                    None => None,
                },
                (None, None, Some(r)) => Some((r, format!("user device {r} = local rank {r}"))),
                (None, None, None) if ids.len() == 1 => Some((0, "user device 0, the only one visible".to_owned())),
                (None, None, None) => None,
            };
            if let Some((u, why)) = user {
                // The entries are *logical* ids (CANN's environment reference: "Device ID为昇腾AI处
                // 理器的逻辑ID"): physical only on bare metal, so this link never claims a
                // physical device from them; the `acl` link asks the runtime.
                let logical = *ids.get(u as usize).ok_or_else(|| {
                    Error::config(format!(
                        "{VISIBLE_DEVICES_ENV}={v:?} makes {} device(s) visible, so {why} does not exist; expected \
                         one visible device per local rank (or set {NPU_PHY_ID_ENV})",
                        ids.len()
                    ))
                })?;
                if known.user_device.is_none() {
                    out.user_device = Some(u);
                    out.details.insert(
                        IdentityField::UserDevice,
                        format!("{why}; {VISIBLE_DEVICES_ENV}={v:?} entry {u} is its logical id {logical}"),
                    );
                }
            } else {
                tracing::debug!("{VISIBLE_DEVICES_ENV}={v:?} lists several devices and the local rank is unknown");
            }
        }

        if let Some((first, first_src)) = claims.first() {
            if let Some((other, other_src)) = claims.iter().find(|(id, _)| id != first) {
                return Err(Error::config(format!(
                    "the environment disagrees about this process's physical NPU: {first_src} says {first}, \
                     {other_src} says {other}; expected them to name the same device"
                )));
            }
            out.physical_device = Some(*first);
            out.details.insert(IdentityField::PhysicalDevice, first_src.clone());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn env(pairs: &[(&str, &str)]) -> EnvResolver {
        EnvResolver::new(Environment::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))))
    }

    async fn local(r: &EnvResolver, rank: Option<u32>) -> Result<Identity> {
        r.resolve(&ResolveQuery::local(Some("10.0.0.1:1".into()), rank), &Identity::default()).await
    }

    #[test]
    fn visible_devices_follow_canns_rules() {
        let p = |s| parse_visible_devices(s, DEVICE_ID_LIMIT);
        assert_eq!(p("4,5"), VisibleDevices { ids: vec![4, 5], problem: None });
        assert_eq!(p("0"), VisibleDevices { ids: vec![0], problem: None });
        let stop = |s, ids: Vec<u32>, index, reason| {
            let got = p(s);
            assert_eq!(got.ids, ids, "{s}");
            let problem = got.problem.unwrap();
            assert_eq!((problem.index, problem.reason), (index, reason), "{s}");
        };
        stop("4, 5", vec![4], 1, VisibleEntryProblem::Whitespace);
        stop(" 4", vec![], 0, VisibleEntryProblem::Whitespace);
        stop("5,4", vec![5], 1, VisibleEntryProblem::NotAscending { previous: 5 });
        stop("4,4", vec![4], 1, VisibleEntryProblem::Duplicate);
        stop("1,3,1", vec![1, 3], 2, VisibleEntryProblem::Duplicate);
        stop("4,99,5", vec![4], 1, VisibleEntryProblem::OutOfRange { limit: DEVICE_ID_LIMIT });
        stop("4,99999999999", vec![4], 1, VisibleEntryProblem::OutOfRange { limit: DEVICE_ID_LIMIT });
        stop("4,x", vec![4], 1, VisibleEntryProblem::NotANumber);
        stop("4,-5", vec![4], 1, VisibleEntryProblem::NotANumber);
        stop("4,,5", vec![4], 1, VisibleEntryProblem::Empty);
        stop("4,", vec![4], 1, VisibleEntryProblem::Empty);
        stop("", vec![], 0, VisibleEntryProblem::Empty);
    }

    #[test]
    fn visible_device_errors_name_variable_value_entry_and_canns_view() {
        let e = parse_visible_devices("4, 5", DEVICE_ID_LIMIT).into_result("4, 5").unwrap_err();
        let m = e.message();
        assert!(
            m.contains("ASCEND_RT_VISIBLE_DEVICES=\"4, 5\"") && m.contains("entry 1 (\" 5\") contains whitespace"),
            "{m}"
        );
        assert!(m.contains("would use only [4]") && m.contains("e.g. \"4,5\""), "{m}");
        let e = parse_visible_devices("", DEVICE_ID_LIMIT).into_result("").unwrap_err();
        assert!(e.message().contains("the value is empty") && e.message().contains("would see no device"), "{e}");
    }

    #[tokio::test]
    async fn container_case_visible_devices_and_local_rank() {
        // The entries are logical ids: the link answers the user device and never a physical
        // one (inside a container logical 4 may be any card; the `acl` link asks the runtime).
        let r = env(&[(VISIBLE_DEVICES_ENV, "4,5")]);
        let id = local(&r, Some(1)).await.unwrap();
        assert_eq!((id.physical_device, id.user_device), (None, Some(1)));
        assert_eq!(
            id.details[&IdentityField::UserDevice],
            "user device 1 = local rank 1; ASCEND_RT_VISIBLE_DEVICES=\"4,5\" entry 1 is its logical id 5"
        );
        let id = local(&r, Some(0)).await.unwrap();
        assert_eq!((id.physical_device, id.user_device), (None, Some(0)));
        // The user device an earlier link found wins over the local rank.
        let known = Identity { user_device: Some(0), ..Identity::default() };
        let id = r.resolve(&ResolveQuery::local(None, Some(1)), &known).await.unwrap();
        assert!(id.is_empty(), "{id:?}");
        // Unknown index with several entries: no answer (and no guess).
        assert!(local(&r, None).await.unwrap().is_empty());
        // One visible device needs no index.
        let id = local(&env(&[(VISIBLE_DEVICES_ENV, "6")]), None).await.unwrap();
        assert_eq!((id.physical_device, id.user_device), (None, Some(0)));
    }

    #[tokio::test]
    async fn a_physical_device_resolved_earlier_sets_the_user_device_to_its_position() {
        let earlier = |phy: u32| {
            Identity { physical_device: Some(phy), ..Identity::default() }
                .with_detail(IdentityField::PhysicalDevice, "ranktable.json decode_device_list[0]")
        };
        // Decode rank 0 on a node where every card is visible: the rank table says card 4, so the
        // user device is 4 (entry 4), not the local rank's 0 (which is card 0).
        let all = env(&[(VISIBLE_DEVICES_ENV, "0,1,2,3,4,5,6,7")]);
        let id = all.resolve(&ResolveQuery::local(None, Some(0)), &earlier(4)).await.unwrap();
        assert_eq!((id.physical_device, id.user_device), (None, Some(4)));
        assert!(
            id.details[&IdentityField::UserDevice].starts_with(
                "user device 4, the position of 4 (the physical device resolved earlier, read as a logical id"
            ),
            "{id:?}"
        );
        // Without a local rank too: the position needs none.
        let id = all.resolve(&ResolveQuery::local(None, None), &earlier(7)).await.unwrap();
        assert_eq!(id.user_device, Some(7));
        // Bare metal showing cards 4 and 5: card 5 is user device 1 whatever the local rank says.
        let some = env(&[(VISIBLE_DEVICES_ENV, "4,5")]);
        let id = some.resolve(&ResolveQuery::local(None, Some(0)), &earlier(5)).await.unwrap();
        assert_eq!(id.user_device, Some(1));
        // A card the list does not name (in a container the list holds logical ids): no answer
        // here; the `acl` link finds the visible device of that physical id.
        let id = some.resolve(&ResolveQuery::local(None, Some(0)), &earlier(6)).await.unwrap();
        assert!(id.is_empty(), "{id:?}");
        // Variables that name physical cards still answer, and disagree with the earlier link in
        // the chain (which refuses the identity).
        let mixed = env(&[(VISIBLE_DEVICES_ENV, "4,5"), (NPU_PHY_ID_ENV, "4")]);
        let id = mixed.resolve(&ResolveQuery::local(None, Some(0)), &earlier(5)).await.unwrap();
        assert_eq!((id.physical_device, id.user_device), (Some(4), Some(1)));
    }

    #[tokio::test]
    async fn bad_environment_is_an_error_naming_variable_and_value() {
        for (var, value, rank, needle) in [
            (VISIBLE_DEVICES_ENV, "4, 5", Some(0), "contains whitespace"),
            (VISIBLE_DEVICES_ENV, "5,4", Some(0), "entries must ascend"),
            (VISIBLE_DEVICES_ENV, "4,4", Some(0), "repeats"),
            (VISIBLE_DEVICES_ENV, "4,77", Some(0), "out of range"),
            (VISIBLE_DEVICES_ENV, "", Some(0), "the value is empty"),
            (VISIBLE_DEVICES_ENV, "4,5", Some(2), "does not exist"),
            (VISIBLE_DEVICES_ENV, "5", Some(1), "does not exist"),
            (PHYSICAL_DEVICES_ENV, "4,x", Some(0), "not a whole number"),
            (PHYSICAL_DEVICES_ENV, "4,4", Some(0), "listed twice"),
            (PHYSICAL_DEVICES_ENV, "4,5", Some(3), "no entry for local rank 3"),
            (PHYSICAL_DEVICES_ENV, "4,100", Some(0), "out of range"),
            (NPU_PHY_ID_ENV, "five", None, "not a whole number"),
            (NPU_PHY_ID_ENV, "64", None, "out of range"),
        ] {
            let e = local(&env(&[(var, value)]), rank).await.unwrap_err();
            assert_eq!(e.kind(), ferry_core::ErrorKind::Config);
            let m = e.message();
            assert!(m.contains(&format!("{var}={value:?}")) && m.contains(needle), "{var}={value}: {m}");
        }
    }

    #[tokio::test]
    async fn variables_agree_or_fail_and_peers_are_not_answered() {
        let r = env(&[(NPU_PHY_ID_ENV, "5"), (VISIBLE_DEVICES_ENV, "4,5"), (PHYSICAL_DEVICES_ENV, "4, 5")]);
        let id = local(&r, Some(1)).await.unwrap();
        assert_eq!(id.physical_device, Some(5));
        assert_eq!(id.details[&IdentityField::PhysicalDevice], "ASCEND_NPU_PHY_ID=\"5\"");
        let e = local(&r, Some(0)).await.unwrap_err();
        assert!(e.message().contains("ASCEND_NPU_PHY_ID=\"5\" says 5") && e.message().contains("says 4"), "{e}");
        let id = local(&env(&[(PHYSICAL_DEVICES_ENV, "2,3")]), Some(1)).await.unwrap();
        assert_eq!((id.physical_device, id.user_device), (Some(3), None));
        let q = ResolveQuery::peer("10.0.0.2:1", None, Some(1));
        assert!(r.resolve(&q, &Identity::default()).await.unwrap().is_empty());
        assert!(local(&env(&[]), Some(1)).await.unwrap().is_empty());
        assert!(local(&env(&[(NPU_PHY_ID_ENV, ""), (PHYSICAL_DEVICES_ENV, "")]), Some(1)).await.unwrap().is_empty());
    }

    proptest! {
        #[test]
        fn visible_parse_never_panics_and_keeps_a_valid_prefix(value in "[0-9, a-z-]{0,24}") {
            let got = parse_visible_devices(&value, DEVICE_ID_LIMIT);
            prop_assert!(got.ids.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(got.ids.iter().all(|&id| id < DEVICE_ID_LIMIT));
            let entries: Vec<&str> = value.split(',').collect();
            match &got.problem {
                None => prop_assert_eq!(got.ids.len(), entries.len()),
                Some(p) => {
                    prop_assert_eq!(p.index, got.ids.len());
                    prop_assert_eq!(p.entry.as_str(), entries[p.index]);
                    prop_assert!(got.clone().into_result(&value).is_err());
                }
            }
        }

        #[test]
        fn visible_round_trips(set in proptest::collection::btree_set(0u32..DEVICE_ID_LIMIT, 1..16)) {
            let ids: Vec<u32> = set.into_iter().collect();
            let text = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
            prop_assert_eq!(parse_visible_devices(&text, DEVICE_ID_LIMIT), VisibleDevices { ids, problem: None });
        }

        #[test]
        fn device_list_never_panics_and_round_trips(
            value in ".{0,24}",
            set in proptest::collection::btree_set(0u32..DEVICE_ID_LIMIT, 1..16),
        ) {
            let _ = parse_device_list(PHYSICAL_DEVICES_ENV, &value);
            let ids: Vec<u32> = set.into_iter().rev().collect();
            let text = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
            prop_assert_eq!(parse_device_list(PHYSICAL_DEVICES_ENV, &text).unwrap(), ids);
        }
    }
}
