//! The C++ entry points Ferry resolves, by their Itanium-mangled names.
//!
//! The names were derived by compiling Ferry's own declarations of the two classes with g++ and
//! reading them back with `nm` (the test `tests/mangled_names.rs` does that again on every run,
//! from `tests/fixtures/declarations.cpp`); the `adxl::` ones are also the names the
//! `mooncake-transfer-engine-npu` wheel imports (`docs/research/hixl-interop-facts.md` §1.2).

/// One C++ entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Symbol {
    /// The Itanium-mangled name looked up with `dlsym`.
    pub mangled: &'static str,
    /// The function, as errors name it (`hixl::Hixl::Connect`).
    pub name: &'static str,
    /// The full demangled signature.
    pub signature: &'static str,
    /// Whether the API is unusable without it (the others are optional, like Mooncake's weak
    /// symbols).
    pub required: bool,
}

const fn req(mangled: &'static str, name: &'static str, signature: &'static str) -> Symbol {
    Symbol { mangled, name, signature, required: true }
}

const fn opt(mangled: &'static str, name: &'static str, signature: &'static str) -> Symbol {
    Symbol { mangled, name, signature, required: false }
}

/// `ge::AscendString`'s constructor and `operator<` (in `libmetadef.so`), used by both APIs.
pub const ASCEND_STRING: [Symbol; 2] = [
    req("_ZN2ge12AscendStringC1EPKc", "ge::AscendString::AscendString", "ge::AscendString::AscendString(char const*)"),
    req(
        "_ZNK2ge12AscendStringltERKS0_",
        "ge::AscendString::operator<",
        "ge::AscendString::operator<(ge::AscendString const&) const",
    ),
];

/// Index of each engine entry point in [`HIXL`] and [`ADXL`].
pub(crate) mod idx {
    pub(crate) const CTOR: usize = 0;
    pub(crate) const DTOR: usize = 1;
    pub(crate) const INITIALIZE: usize = 2;
    pub(crate) const FINALIZE: usize = 3;
    pub(crate) const REGISTER_MEM: usize = 4;
    pub(crate) const DEREGISTER_MEM: usize = 5;
    pub(crate) const CONNECT: usize = 6;
    pub(crate) const DISCONNECT: usize = 7;
    pub(crate) const TRANSFER_SYNC: usize = 8;
    pub(crate) const TRANSFER_ASYNC: usize = 9;
    pub(crate) const GET_TRANSFER_STATUS: usize = 10;
    pub(crate) const GET_CAPABILITY: usize = 11;
}

/// `hixl::Hixl` (`libcann_hixl.so`, CANN >= 8.5): constructor, destructor, Initialize, Finalize,
/// RegisterMem, DeregisterMem, Connect, Disconnect, TransferSync (required), TransferAsync,
/// GetTransferStatus, GetCapability (optional).
pub const HIXL: [Symbol; 12] = [
    req("_ZN4hixl4HixlC1Ev", "hixl::Hixl::Hixl", "hixl::Hixl::Hixl()"),
    req("_ZN4hixl4HixlD1Ev", "hixl::Hixl::~Hixl", "hixl::Hixl::~Hixl()"),
    req(
        "_ZN4hixl4Hixl10InitializeERKN2ge12AscendStringERKSt3mapIS2_S2_St4lessIS2_ESaISt4pairIS3_S2_EEE",
        "hixl::Hixl::Initialize",
        "hixl::Hixl::Initialize(ge::AscendString const&, std::map<ge::AscendString, ge::AscendString> const&)",
    ),
    req("_ZN4hixl4Hixl8FinalizeEv", "hixl::Hixl::Finalize", "hixl::Hixl::Finalize()"),
    req(
        "_ZN4hixl4Hixl11RegisterMemERKNS_7MemDescENS_7MemTypeERPv",
        "hixl::Hixl::RegisterMem",
        "hixl::Hixl::RegisterMem(hixl::MemDesc const&, hixl::MemType, void*&)",
    ),
    req("_ZN4hixl4Hixl13DeregisterMemEPv", "hixl::Hixl::DeregisterMem", "hixl::Hixl::DeregisterMem(void*)"),
    req(
        "_ZN4hixl4Hixl7ConnectERKN2ge12AscendStringEi",
        "hixl::Hixl::Connect",
        "hixl::Hixl::Connect(ge::AscendString const&, int)",
    ),
    req(
        "_ZN4hixl4Hixl10DisconnectERKN2ge12AscendStringEi",
        "hixl::Hixl::Disconnect",
        "hixl::Hixl::Disconnect(ge::AscendString const&, int)",
    ),
    req(
        "_ZN4hixl4Hixl12TransferSyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EEi",
        "hixl::Hixl::TransferSync",
        "hixl::Hixl::TransferSync(ge::AscendString const&, hixl::TransferOp, std::vector<hixl::TransferOpDesc> const&, int)",
    ),
    opt(
        "_ZN4hixl4Hixl13TransferAsyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EERKNS_12TransferArgsERPv",
        "hixl::Hixl::TransferAsync",
        "hixl::Hixl::TransferAsync(ge::AscendString const&, hixl::TransferOp, std::vector<hixl::TransferOpDesc> const&, hixl::TransferArgs const&, void*&)",
    ),
    opt(
        "_ZN4hixl4Hixl17GetTransferStatusERKPvRNS_14TransferStatusE",
        "hixl::Hixl::GetTransferStatus",
        "hixl::Hixl::GetTransferStatus(void* const&, hixl::TransferStatus&)",
    ),
    opt(
        "_ZN4hixl4Hixl13GetCapabilityENS_11FeatureTypeERi",
        "hixl::Hixl::GetCapability",
        "hixl::Hixl::GetCapability(hixl::FeatureType, int&) [static]",
    ),
];

/// `adxl::AdxlEngine` (`libllm_datadist.so`, CANN 8.3 on; deprecated), in the order of [`HIXL`].
pub const ADXL: [Symbol; 12] = [
    req("_ZN4adxl10AdxlEngineC1Ev", "adxl::AdxlEngine::AdxlEngine", "adxl::AdxlEngine::AdxlEngine()"),
    req("_ZN4adxl10AdxlEngineD1Ev", "adxl::AdxlEngine::~AdxlEngine", "adxl::AdxlEngine::~AdxlEngine()"),
    req(
        "_ZN4adxl10AdxlEngine10InitializeERKN2ge12AscendStringERKSt3mapIS2_S2_St4lessIS2_ESaISt4pairIS3_S2_EEE",
        "adxl::AdxlEngine::Initialize",
        "adxl::AdxlEngine::Initialize(ge::AscendString const&, std::map<ge::AscendString, ge::AscendString> const&)",
    ),
    req("_ZN4adxl10AdxlEngine8FinalizeEv", "adxl::AdxlEngine::Finalize", "adxl::AdxlEngine::Finalize()"),
    req(
        "_ZN4adxl10AdxlEngine11RegisterMemERKNS_7MemDescENS_7MemTypeERPv",
        "adxl::AdxlEngine::RegisterMem",
        "adxl::AdxlEngine::RegisterMem(adxl::MemDesc const&, adxl::MemType, void*&)",
    ),
    req(
        "_ZN4adxl10AdxlEngine13DeregisterMemEPv",
        "adxl::AdxlEngine::DeregisterMem",
        "adxl::AdxlEngine::DeregisterMem(void*)",
    ),
    req(
        "_ZN4adxl10AdxlEngine7ConnectERKN2ge12AscendStringEi",
        "adxl::AdxlEngine::Connect",
        "adxl::AdxlEngine::Connect(ge::AscendString const&, int)",
    ),
    req(
        "_ZN4adxl10AdxlEngine10DisconnectERKN2ge12AscendStringEi",
        "adxl::AdxlEngine::Disconnect",
        "adxl::AdxlEngine::Disconnect(ge::AscendString const&, int)",
    ),
    req(
        "_ZN4adxl10AdxlEngine12TransferSyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EEi",
        "adxl::AdxlEngine::TransferSync",
        "adxl::AdxlEngine::TransferSync(ge::AscendString const&, adxl::TransferOp, std::vector<adxl::TransferOpDesc> const&, int)",
    ),
    opt(
        "_ZN4adxl10AdxlEngine13TransferAsyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EERKNS_12TransferArgsERPv",
        "adxl::AdxlEngine::TransferAsync",
        "adxl::AdxlEngine::TransferAsync(ge::AscendString const&, adxl::TransferOp, std::vector<adxl::TransferOpDesc> const&, adxl::TransferArgs const&, void*&)",
    ),
    opt(
        "_ZN4adxl10AdxlEngine17GetTransferStatusERKPvRNS_14TransferStatusE",
        "adxl::AdxlEngine::GetTransferStatus",
        "adxl::AdxlEngine::GetTransferStatus(void* const&, adxl::TransferStatus&)",
    ),
    opt(
        "_ZN4adxl10AdxlEngine13GetCapabilityENS_11FeatureTypeERi",
        "adxl::AdxlEngine::GetCapability",
        "adxl::AdxlEngine::GetCapability(adxl::FeatureType, int&) [static]",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_tables_follow_the_index_order_and_differ_only_in_the_class() {
        for (h, a) in HIXL.iter().zip(ADXL.iter()) {
            assert_eq!(h.required, a.required, "{} / {}", h.name, a.name);
            let method = |s: &Symbol| s.name.rsplit("::").next().unwrap().to_owned();
            let (mh, ma) = (method(h), method(a));
            if mh.trim_start_matches('~') != "Hixl" {
                assert_eq!(mh, ma);
            }
            assert!(h.mangled.starts_with("_ZN4hixl4Hixl"), "{}", h.mangled);
            assert!(a.mangled.starts_with("_ZN4adxl10AdxlEngine"), "{}", a.mangled);
        }
        assert!(HIXL[idx::CTOR].mangled.ends_with("C1Ev") && HIXL[idx::DTOR].mangled.ends_with("D1Ev"));
        assert_eq!(HIXL[idx::INITIALIZE].name, "hixl::Hixl::Initialize");
        assert_eq!(HIXL[idx::FINALIZE].name, "hixl::Hixl::Finalize");
        assert_eq!(HIXL[idx::REGISTER_MEM].name, "hixl::Hixl::RegisterMem");
        assert_eq!(HIXL[idx::DEREGISTER_MEM].name, "hixl::Hixl::DeregisterMem");
        assert_eq!(HIXL[idx::CONNECT].name, "hixl::Hixl::Connect");
        assert_eq!(HIXL[idx::DISCONNECT].name, "hixl::Hixl::Disconnect");
        assert_eq!(HIXL[idx::TRANSFER_SYNC].name, "hixl::Hixl::TransferSync");
        assert_eq!(HIXL[idx::TRANSFER_ASYNC].name, "hixl::Hixl::TransferAsync");
        assert_eq!(HIXL[idx::GET_TRANSFER_STATUS].name, "hixl::Hixl::GetTransferStatus");
        assert_eq!(HIXL[idx::GET_CAPABILITY].name, "hixl::Hixl::GetCapability");
        let required: Vec<&str> = ADXL.iter().filter(|s| s.required).map(|s| s.name).collect();
        assert_eq!(required.len(), 9, "C1, D1 and the seven required members: {required:?}");
    }
}
