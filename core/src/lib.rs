//! # ferry-core
//!
//! The device-free heart of Ferry, a KV-cache transfer engine for disaggregated LLM serving.
//! This crate holds no sockets, no FFI and no device code, and never dereferences a pointer: its
//! only `unsafe` items are the registration functions, whose contract (the memory is valid until
//! unregistered) is what the transports rely on, and [`HostAllocation::new`], whose contract
//! (the memory is the allocation's to free) is what callers of
//! [`TransferEngine::allocate_host_memory`] rely on; its only `unsafe` code is that function's
//! fallback allocator ([`HostAllocation::zeroed`], the process allocator). It defines the traits everything else
//! plugs into and the engine that ties them together.
//!
//! - [`Transport`]: moves bytes between local registered memory and a remote segment.
//! - [`MetadataStore`]: the key/value store where segment descriptors are published.
//! - [`ControlChannel`]: how engines reach each other beside the store (notifications, probes,
//!   the RPC port); the P2P handshake is a store and a channel at once.
//! - [`SegmentResolver`]: turns names and the environment into identities, as a
//!   [`ResolverChain`] that explains which link answered; the core holds the generic links
//!   (explicit config, `ip:port[:npu_N]` names, port offset), transports bring their devices'.
//!
//! Around them: [`TransferEngine`] (memory registry, segment cache, transport table, metadata
//! store and control channel, resolver chain), the KV-block API ([`KvLayout`], [`BlockTransfer`]), Mooncake's
//! descriptor and config formats, segment names ([`SegmentName`]), options declared by
//! transports ([`OptionSpec`]), and one [`Error`] type with stable [`ErrorKind`]s.
//!
//! The crate root re-exports what engine users and transport, store and resolver authors
//! name; what the engine uses internally (the built-in resolver links and their order, the
//! KV-block planner, the descriptor field that carries published KV layouts) stays in its
//! module ([`resolver`], [`kv`]).
//!
//! Most users depend on the `ferry` facade crate instead, which pre-installs the transports
//! compiled in.
#![deny(unsafe_code)]

pub mod batch;
pub mod config;
pub mod control;
pub mod descriptor;
pub mod engine;
pub mod environment;
pub mod error;
pub mod field_docs;
pub mod host_memory;
mod json_fields;
pub mod kv;
pub mod memory;
pub mod metadata;
pub mod metrics;
pub mod options;
pub mod resolver;
pub mod segment;
pub mod segment_name;
pub mod transport;
mod wait_model;

pub use batch::{
    Batch, BatchStatus, Opcode, RequestStatus, SegmentHandle, Submission, TransferRequest, ValidatedRequest,
};
pub use config::{BasePort, ByteSize, Config, ConfigStyle, FieldSource, MetadataServer, Role};
pub use control::{ControlChannel, NoControlChannel, Notification};
pub use descriptor::{BufferDesc, MetadataKeys, RankInfo, RpcMeta, SegmentDescriptor};
pub use engine::{BlockBatch, EngineBuilder, EngineService, KvLayoutId, ServiceGuard, TransferEngine, WeakEngine};
pub use environment::Environment;
pub use error::{Error, ErrorKind, Result};
pub use field_docs::{CORE_FIELDS, FieldDoc};
pub use host_memory::{HOST_ALIGNMENT, HostAllocation};
pub use kv::{BlockRun, BlockSlice, BlockTransfer, KvLayout, KvRegion, layer_regions};
pub use memory::{Location, MemoryRegistry, Region, RegisteredMemory};
pub use metadata::{
    ControlChannelFactory, InProcessMetadata, MetadataConnection, MetadataFactory, MetadataRegistry, MetadataStore,
    WatchEvent,
};
pub use metrics::{EngineStats, LatencyBucket, LatencyStats, TransferStats};
pub use options::{OptionSpec, OptionValue, Setting, UnknownField};
// The built-in resolver links (`ExplicitResolver`, ...) and their order stay in
// [`resolver`]: users name links in the config, and write their own with these.
pub use resolver::{
    Answer, Identity, IdentityField, Resolution, ResolveQuery, ResolveTarget, ResolverChain, ResolverContext,
    ResolverFactory, ResolverRegistry, SegmentResolver,
};
pub use segment::OpenSegment;
pub use segment_name::{DEVICE_ID_LIMIT, SegmentName, SegmentNameError};
pub use transport::{
    Capabilities, DescriptorSource, MemoryPromise, PeerHandle, Transport, TransportContext, TransportFactory,
    TransportRegistry, TransportSource,
};
