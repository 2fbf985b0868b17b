//! The `config` link: identity stated outright in the config.

use async_trait::async_trait;

use super::{Identity, IdentityField, ResolveQuery, SegmentResolver};
use crate::config::Config;
use crate::error::Result;

/// The `config` link: this process's physical NPU from the config's `physical_devices` list,
/// entry `local_rank` (the only entry when there is one). Answers nothing without the field;
/// with it, a rank with no entry (or an unknown rank and several entries), an id not below
/// [`DEVICE_ID_LIMIT`](super::DEVICE_ID_LIMIT) or one listed twice is an error naming the
/// field. Peers are not its to answer.
#[derive(Debug, Clone)]
pub struct ExplicitResolver {
    config: Config,
}

impl ExplicitResolver {
    /// Uses `physical_devices`, indexed by local rank.
    pub fn new(physical_devices: Vec<u32>) -> Self {
        let mut config = Config::default();
        config.physical_devices = Some(physical_devices);
        Self { config }
    }

    /// Uses the config's `physical_devices`.
    pub fn from_config(config: &Config) -> Self {
        Self { config: config.clone() }
    }
}

#[async_trait]
impl SegmentResolver for ExplicitResolver {
    fn name(&self) -> &str {
        "config"
    }

    async fn resolve(&self, query: &ResolveQuery, _known: &Identity) -> Result<Identity> {
        let Some(list) = self.config.physical_devices.as_ref().filter(|_| query.is_local()) else {
            return Ok(Identity::default());
        };
        self.config.check_physical_devices()?;
        let field = |msg: String| self.config.field_error("physical_devices", &msg);
        let (index, why) = match query.local_rank {
            Some(r) => (r as usize, format!("local rank {r}")),
            None if list.len() == 1 => (0, "its only entry".to_owned()),
            None => {
                return Err(field(format!(
                    "lists {} devices {list:?} but the local rank is unknown: set LOCAL_RANK or FERRY_LOCAL_RANK",
                    list.len()
                )));
            }
        };
        let phy = *list.get(index).ok_or_else(|| {
            field(format!("{list:?} has no entry for local rank {index}; expected one physical NPU id per local rank"))
        })?;
        Ok(Identity { physical_device: Some(phy), ..Identity::default() }).map(|id| {
            id.with_detail(IdentityField::PhysicalDevice, format!("physical_devices {list:?} entry {index} ({why})"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn indexes_by_local_rank() {
        let r = ExplicitResolver::new(vec![4, 5, 6, 7]);
        let id = r.resolve(&ResolveQuery::local(None, Some(2)), &Identity::default()).await.unwrap();
        assert_eq!(id.physical_device, Some(6));
        assert!(r.resolve(&ResolveQuery::peer("h:1", None, Some(2)), &Identity::default()).await.unwrap().is_empty());
        let e = r.resolve(&ResolveQuery::local(None, Some(4)), &Identity::default()).await.unwrap_err();
        assert!(e.message().contains("`physical_devices`") && e.message().contains("local rank 4"), "{e}");
        let e = r.resolve(&ResolveQuery::local(None, None), &Identity::default()).await.unwrap_err();
        assert!(e.message().contains("local rank is unknown"), "{e}");
        let one = ExplicitResolver::new(vec![3]);
        assert_eq!(
            one.resolve(&ResolveQuery::local(None, None), &Identity::default()).await.unwrap().physical_device,
            Some(3)
        );
        // Lists built in code are checked as a parsed config's are.
        for (list, needle) in [
            (vec![4, 64], "entry 1 (64) is out of range (device ids are below 64)"),
            (vec![4, 5, 4], "device 4 is listed twice (entries 0 and 2)"),
            (vec![], "is empty"),
        ] {
            let r = ExplicitResolver::new(list);
            let e = r.resolve(&ResolveQuery::local(None, Some(0)), &Identity::default()).await.unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Config);
            assert!(e.message().contains("`physical_devices`") && e.message().contains(needle), "{e}");
        }
        let none = ExplicitResolver::from_config(&Config::default());
        assert!(none.resolve(&ResolveQuery::local(None, Some(0)), &Identity::default()).await.unwrap().is_empty());
    }
}
