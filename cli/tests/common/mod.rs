//! Helpers shared by the `ferry` binary's tests.

use std::process::Command;

/// The `ferry` binary with a clean environment: none of the variables it or its resolvers read
/// leak in from the shell running the tests.
pub(crate) fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("MOONCAKE_CONFIG_PATH").env_remove("LOCAL_RANK").env_remove("MC_FORCE_TCP");
    for (k, _) in std::env::vars() {
        let identity = ["ASCEND_RT_VISIBLE_DEVICES", "PHYSICAL_DEVICES", "ASCEND_NPU_PHY_ID"];
        if k.starts_with("FERRY_")
            || k == "MC_METADATA_CLUSTER_ID"
            || k == "DISAGGREGATED_PREFILL_RANK_TABLE_PATH"
            || identity.contains(&k.as_str())
        {
            c.env_remove(k);
        }
    }
    c
}

/// Writes `text` to `name` in a directory of this test process (`ferry-cli-<suite>-<pid>`).
#[allow(dead_code, reason = "each test binary compiles this module and uses a part of it")]
pub(crate) fn tmp_in(suite: &str, name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-cli-{suite}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}
