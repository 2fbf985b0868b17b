//! The transport in one process on the emulated CANN: the `acl` resolver, the identity it
//! publishes, and the control channel's answers to bad or stale requests (every address is
//! checked against the live memory registry before a device touches it).

use std::sync::Arc;
use std::time::Duration;

use ferry_ascend_runtime::{DeviceThread, RootInfo};
use ferry_ascend_sys::test_support::{Emulator, TempDir, emulator_lib_dir};
use ferry_ascend_sys::{Library, SearchPath};
use ferry_core::{
    Config, Identity, IdentityField, InProcessMetadata, Location, MetadataStore, ResolveQuery, SegmentResolver,
    TransferEngine, TransportRegistry,
};
use ferry_transport_hccl::wire::{self, Reply, Request, WireOp};
use ferry_transport_hccl::{AclQueryResolver, HcclTransportFactory};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(5);

fn emulator() -> (TempDir, Arc<Library>) {
    let dir = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
    let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
    (dir, lib)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acl_resolver_maps_user_devices_to_physical_ones_and_never_guesses() {
    let (_dir, lib) = emulator();
    let acl = AclQueryResolver::new(lib);
    let local = |rank| ResolveQuery::local(Some("10.0.0.1:1".into()), rank);
    let known = |user, phy| Identity { user_device: user, physical_device: phy, ..Identity::default() };

    let id = acl.resolve(&local(None), &known(Some(3), None)).await.unwrap();
    assert_eq!(id.physical_device, Some(3));
    assert!(id.details[&IdentityField::PhysicalDevice].contains("aclrtGetPhyDevIdByUserDevId(3)"), "{id:?}");
    assert_eq!(id.user_device, None, "an earlier link's answer is not repeated");

    let id = acl.resolve(&local(None), &known(None, Some(5))).await.unwrap();
    assert_eq!((id.user_device, id.physical_device), (Some(5), Some(5)), "found by scanning the visible devices");

    let id = acl.resolve(&local(Some(2)), &Identity::default()).await.unwrap();
    assert_eq!((id.user_device, id.physical_device), (Some(2), Some(2)));
    assert!(id.details[&IdentityField::UserDevice].contains("local rank 2"));

    // Eight visible devices and nothing to choose by: no answer rather than device 0.
    assert!(acl.resolve(&local(None), &Identity::default()).await.unwrap().is_empty());
    // Peers are not its to answer.
    let peer = ResolveQuery::peer("10.0.0.2:1", None, None);
    assert!(acl.resolve(&peer, &known(Some(1), None)).await.unwrap().is_empty());

    let e = acl.resolve(&local(Some(99)), &Identity::default()).await.unwrap_err();
    assert!(e.message().contains("user device 99 does not exist"), "{e}");
    let e = acl.resolve(&local(None), &known(None, Some(42))).await.unwrap_err();
    assert!(e.message().contains("physical NPU 42"), "{e}");

    let unavailable = AclQueryResolver::unavailable("no CANN here");
    assert!(unavailable.resolve(&local(Some(1)), &Identity::default()).await.unwrap().is_empty());
}

async fn engine(lib: Arc<Library>, conf: &TempDir) -> TransferEngine {
    engine_named(lib, conf, "127.0.0.1:7").await.unwrap()
}

async fn engine_named(lib: Arc<Library>, conf: &TempDir, name: &str) -> ferry_core::Result<TransferEngine> {
    let path = conf.path().join("hccn.conf");
    std::fs::write(&path, "address_0=127.41.0.1\naddress_1=127.41.0.2\n").unwrap();
    let json =
        format!(r#"{{"protocol": "hccl", "local_rank": 1, "hccn_conf_path": {:?}}}"#, path.display().to_string());
    let cfg = Config::from_json_str(&json, None).unwrap();
    TransferEngine::builder()
        .config(cfg)
        .segment_name(name)
        .transports(TransportRegistry::new().with(Arc::new(HcclTransportFactory::with_library(lib))))
        // The Ascend links but `acl`: the transport inserts its own, on the library it was given.
        .resolver_registry(ferry_transport_hccl::ascend_identity::registry())
        .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
        .transfer_timeout(T)
        .build()
        .await
}

async fn ask(port: u16, req: &Request) -> Reply {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    wire::write_frame(&mut s, req).await.unwrap();
    wire::read_frame(&mut s, T).await.unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_channel_refuses_what_it_cannot_honour() {
    let (_dir, lib) = emulator();
    let conf = TempDir::new("ferry-hccn").unwrap();
    let e = engine(lib.clone(), &conf).await;
    assert_eq!(e.primary_protocol(), "ascend", "`hccl` is an alias");
    let buf = vec![7u8; 4096];
    // SAFETY: `buf` outlives the engine (shut down below) and is only read meanwhile.
    unsafe { e.register_memory(buf.as_ptr() as u64, 4096, Location::Cpu(0)).await }.unwrap();
    let d = e.local_descriptor();
    let rank = d.rank_info.clone().unwrap();
    assert_eq!((rank.device_phy_id, rank.device_logic_id, rank.device_ip.as_str()), (1, 1, "127.41.0.2"));
    assert_eq!(rank.host_ip, "127.0.0.1");
    assert_eq!(rank.pid, u64::from(std::process::id()));
    let port = u16::try_from(rank.host_port).unwrap();

    // A table that names another device for this rank.
    let table = r#"{"server_list":[{"device":[{"device_id":"0","device_ip":"127.41.0.1","rank_id":"0"},
        {"device_id":"3","device_ip":"127.41.0.4","rank_id":"1"}]}]}"#;
    let req = Request::InitOneSided {
        from: "127.0.0.1:8".into(),
        instance: None,
        host_ip: "127.0.0.1".into(),
        host_port: 1,
        epoch: 1,
        rank_table: table.into(),
        your_rank: 1,
        buffers: None,
    };
    let Reply::Error { message } = ask(port, &req).await else { panic!("accepted a foreign rank table") };
    assert!(message.contains("physical NPU 1"), "{message}");

    // Garbage root info.
    let req = Request::InitTwoSided { from: "127.0.0.1:8".into(), epoch: 1, root_info: "zz".into() };
    assert!(matches!(ask(port, &req).await, Reply::Error { .. }));

    // A transfer over a communicator that was never built.
    let op = WireOp { write: false, addr: buf.as_ptr() as u64, len: 16 };
    let req = Request::Transfer { from: "127.0.0.1:8".into(), epoch: 3, ops: vec![op] };
    let Reply::Error { message } = ask(port, &req).await else { panic!("stale epoch accepted") };
    assert!(message.contains("epoch 3"), "{message}");

    // With a communicator being built, addresses outside registered memory are refused one by
    // one, before any device call.
    let root =
        DeviceThread::spawn(&lib, 0, "test-root", |_| Ok(())).unwrap().call(|d, _| RootInfo::new(d)).unwrap().unwrap();
    let req = Request::InitTwoSided { from: "127.0.0.1:8".into(), epoch: 4, root_info: wire::hex(&root.to_bytes()) };
    assert_eq!(ask(port, &req).await, Reply::Accepted { epoch: 4, buffers: None });
    let outside =
        [WireOp { write: true, addr: buf.as_ptr() as u64 + 4000, len: 200 }, WireOp { write: false, addr: 64, len: 8 }];
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let req = Request::Transfer { from: "127.0.0.1:8".into(), epoch: 4, ops: outside.to_vec() };
    wire::write_frame(&mut s, &req).await.unwrap();
    let Reply::Admitted { rejected } = wire::read_frame(&mut s, T).await.unwrap().unwrap() else { panic!() };
    assert_eq!(rejected.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 1]);
    assert!(rejected[0].1.contains("past the end"), "{rejected:?}");
    assert_eq!(wire::read_frame::<_, Reply>(&mut s, T).await.unwrap().unwrap(), Reply::Done { error: None });
    assert!(buf.iter().all(|&b| b == 7), "nothing was written");

    // A frame longer than the limit closes the connection.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    let closed = wire::read_frame::<_, Reply>(&mut s, T).await;
    assert!(matches!(closed, Ok(None) | Err(_)), "{closed:?}");

    e.shutdown().await.unwrap();
    drop(buf);
}

/// A two-rank table in which rank 1 is the engine of [`engine`] (physical NPU 1 at 127.41.0.2).
const TABLE_WITH_ME: &str = r#"{"server_list":[{"device":[{"device_id":"0","device_ip":"127.41.0.1","rank_id":"0"},
    {"device_id":"1","device_ip":"127.41.0.2","rank_id":"1"}]}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_believed_only_from_the_host_they_name_and_epochs_only_one_ahead() {
    let (_dir, lib) = emulator();
    let conf = TempDir::new("ferry-hccn").unwrap();
    let e = engine(lib, &conf).await;
    let port = u16::try_from(e.local_descriptor().rank_info.unwrap().host_port).unwrap();
    let refused = |reply: Reply, what: &str| match reply {
        Reply::Error { message } => assert!(message.contains(what), "{message}"),
        other => panic!("accepted ({other:?}); expected an error saying {what:?}"),
    };

    // A name on another host (its requests come from 127.0.0.1): never believed, so it cannot
    // tear down that peer's communicator.
    let forged = Request::Transfer { from: "10.9.9.9:8".into(), epoch: 0, ops: vec![] };
    refused(ask(port, &forged).await, "cannot speak for `10.9.9.9:8`");
    let forged = Request::InitTwoSided { from: "10.9.9.9:8".into(), epoch: 1, root_info: "00".repeat(4108) };
    refused(ask(port, &forged).await, "cannot speak for");
    let nameless = Request::Transfer { from: "someone".into(), epoch: 0, ops: vec![] };
    refused(ask(port, &nameless).await, "not a segment name of the form host:port");
    let elsewhere = Request::InitOneSided {
        from: "127.0.0.1:8".into(),
        instance: None,
        host_ip: "10.9.9.9".into(),
        host_port: 8,
        epoch: 1,
        rank_table: TABLE_WITH_ME.into(),
        your_rank: 1,
        buffers: None,
    };
    refused(ask(port, &elsewhere).await, "cannot publish host IP 10.9.9.9");

    // An epoch far ahead is not taken (no overflow, no communicator built at u64::MAX): the
    // answer is the next epoch this side accepts.
    let far = Request::InitOneSided {
        from: "127.0.0.1:8".into(),
        instance: Some("x".into()),
        host_ip: "127.0.0.1".into(),
        host_port: 8,
        epoch: u64::MAX,
        rank_table: TABLE_WITH_ME.into(),
        your_rank: 1,
        buffers: None,
    };
    assert_eq!(ask(port, &far).await, Reply::Stale { epoch: 1 });

    // New peers are limited: one connection naming ever new peers is refused past the limit,
    // with a message that says so; known peers are still served.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut limited_at = None;
    for n in 0..(ferry_transport_hccl::MAX_PEERS as u32 + 8) {
        let req = Request::Transfer { from: format!("127.0.0.1:{}", 20_000 + n), epoch: 9, ops: vec![] };
        wire::write_frame(&mut s, &req).await.unwrap();
        let Reply::Error { message } = wire::read_frame(&mut s, T).await.unwrap().unwrap() else { panic!() };
        if message.contains("the limit") {
            limited_at = Some(n);
            break;
        }
        assert!(message.contains("no two-sided communicator of epoch 9"), "{message}");
    }
    let n = limited_at.expect("no peer limit");
    assert!(n as usize <= ferry_transport_hccl::MAX_PEERS && n as usize + 2 >= ferry_transport_hccl::MAX_PEERS, "{n}");
    let known = Request::Transfer { from: "127.0.0.1:20000".into(), epoch: 9, ops: vec![] };
    refused(ask(port, &known).await, "no two-sided communicator of epoch 9");
    e.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_host_to_publish_the_transport_refuses_to_start() {
    let (_dir, lib) = emulator();
    let conf = TempDir::new("ferry-hccn").unwrap();
    let e = engine_named(lib, &conf, "kv-engine:x").await.unwrap_err();
    let text = e.to_string();
    assert!(text.contains("rank_info.hostIp") && text.contains("local_hostname"), "{text}");
    assert!(text.contains("kv-engine:x"), "names the segment name: {text}");
}

/// The control channel listens on the host IP it publishes (`rank_info.hostIp`), not on every
/// address of the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_channel_listens_on_the_published_host() {
    let (_dir, lib) = emulator();
    let conf = TempDir::new("ferry-hccn").unwrap();
    let e = engine(lib, &conf).await;
    let info = e.local_descriptor().rank_info.unwrap();
    assert_eq!(info.host_ip, "127.0.0.1");
    let port = u16::try_from(info.host_port).unwrap();
    assert!(TcpStream::connect(("127.0.0.1", port)).await.is_ok());
    assert!(TcpStream::connect(("127.0.0.2", port)).await.is_err(), "the control channel listens on every address");
}
