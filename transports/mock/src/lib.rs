//! # ferry-transport-mock
//!
//! A scriptable transport for unit tests of code built on Ferry — a KV connector, a scheduler,
//! anything that submits transfers — in the style of tokio-test's IO builder: say what the
//! transport does with which request, run the code under test against a real
//! [`TransferEngine`](ferry_core::TransferEngine), then look at what it submitted.
//!
//! - **Peers whose memory lives in the test.** [`MockScript::peer`] makes a remote segment
//!   (protocol `mock`) backed by a `Vec<u8>` the script owns: publish its descriptor in the
//!   engine's metadata store, and reads copy from it, writes copy into it
//!   ([`MockScript::peer_bytes`] shows what landed).
//! - **Rules**, first match wins: [`MockScript::when`] a request matches a [`When`] (the n-th
//!   request submitted, a remote range of a peer, an opcode, any), it is delayed
//!   ([`RuleBuilder::after`]) and then succeeds, fails with an error kind, stalls until the
//!   caller cancels it, or succeeds partially (moves the first bytes, then fails). A rule may
//!   apply a number of times ([`RuleBuilder::times`]). Unmatched requests succeed at once.
//! - **A record** of every request submitted, in order ([`MockScript::submitted`]).
//!
//! It goes through the same engine-minted [`Submission`] as every transport: a request is
//! released exactly once, its local memory stays leased until then, and a cancelled one is
//! completed as cancelled.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use ferry_core::{ErrorKind, InProcessMetadata, Location, MetadataStore, Opcode, TransferRequest};
//! use ferry_transport_mock::{MockScript, When};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> ferry_core::Result<()> {
//! let script = MockScript::new();
//! // A prefill peer holding 4 blocks of 16 bytes, block b filled with b.
//! let remote: Vec<u8> = (0..64).map(|i| (i / 16) as u8).collect();
//! let meta = InProcessMetadata::new();
//! let peer = script.peer("prefill", 0x10_000, remote);
//! meta.put("mooncake/ram/prefill", &peer.to_json()).await?;
//! // Block 2 fails as a timeout; everything else moves.
//! script.when(When::Remote { segment: "prefill".into(), range: 0x10_020..0x10_030 }).fail(ErrorKind::Timeout);
//!
//! let engine = ferry_core::TransferEngine::builder()
//!     .transports(ferry_core::TransportRegistry::new().with(Arc::new(script.factory())))
//!     .protocol("mock")
//!     .metadata(meta as Arc<dyn MetadataStore>)
//!     .build()
//!     .await?;
//! let mut cache = vec![0u8; 64];
//! // SAFETY: `cache` outlives the engine's use of it (the engine shuts down below).
//! unsafe { engine.register_memory(cache.as_mut_ptr() as u64, 64, Location::Cpu(0)).await? };
//! let target = engine.open_segment("prefill").await?;
//! let read = |b: u64| TransferRequest {
//!     opcode: Opcode::Read,
//!     source: cache.as_ptr() as u64 + b * 16,
//!     target,
//!     target_offset: 0x10_000 + b * 16,
//!     length: 16,
//! };
//! let batch = engine.submit(&[read(1), read(2)]).await?;
//! batch.wait(Duration::from_secs(5)).await?;
//! assert_eq!(batch.error(1).map(|e| e.kind()), Some(ErrorKind::Timeout));
//! assert!(batch.error(0).is_none());
//! assert_eq!(script.submitted().len(), 2);
//! engine.shutdown().await?;
//! assert_eq!(&cache[16..32], &[1u8; 16], "block 1 landed");
//! assert_eq!(&cache[32..48], &[0u8; 16], "block 2 did not");
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{
    BufferDesc, Capabilities, Error, ErrorKind, Opcode, OpenSegment, Result, SegmentDescriptor, Submission, Transport,
    TransportContext, TransportFactory, ValidatedRequest,
};

/// Protocol name.
pub const PROTOCOL: &str = "mock";

/// Which requests a rule applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum When {
    /// Every request.
    Any,
    /// The n-th request this script's transports were handed (0-based, counted across all
    /// batches, in submission order).
    Nth(usize),
    /// Requests of this opcode.
    Op(Opcode),
    /// Requests to peer `segment` whose remote range overlaps `range`.
    Remote {
        /// The peer's segment name.
        segment: String,
        /// Remote addresses.
        range: Range<u64>,
    },
}

/// What happens to a matching request (after the rule's delay).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Then {
    Succeed,
    Fail(ErrorKind),
    Stall,
    Partial { bytes: u64, kind: ErrorKind },
}

#[derive(Debug, Clone)]
struct Rule {
    when: When,
    then: Then,
    after: Duration,
    /// Applications left (`None`: unlimited).
    times: Option<usize>,
}

/// One request as the transport was handed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitted {
    /// Its number among all requests this script saw (0-based).
    pub seq: usize,
    /// The peer's segment name.
    pub segment: String,
    /// Read or write.
    pub opcode: Opcode,
    /// Local address.
    pub local: u64,
    /// Remote address.
    pub remote: u64,
    /// Bytes.
    pub len: u64,
}

/// A peer whose memory the script owns.
#[derive(Debug)]
struct Peer {
    base: u64,
    bytes: Vec<u8>,
}

#[derive(Debug, Default)]
struct State {
    rules: Vec<Rule>,
    submitted: Vec<Submitted>,
    peers: HashMap<String, Peer>,
}

/// The script shared by a test and the transports its [`factory`](Self::factory) creates.
/// Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct MockScript {
    state: Arc<Mutex<State>>,
}

/// A rule being written: [`after`](Self::after) and [`times`](Self::times) refine it; `succeed`,
/// `fail`, `stall` or `partial` adds it to the script.
#[derive(Debug)]
#[must_use = "a rule is added by succeed, fail, stall or partial"]
pub struct RuleBuilder<'a> {
    script: &'a MockScript,
    when: When,
    after: Duration,
    times: Option<usize>,
}

impl RuleBuilder<'_> {
    /// Delays the outcome by `delay` (a stall starts after it).
    pub fn after(mut self, delay: Duration) -> Self {
        self.after = delay;
        self
    }

    /// Applies the rule to the first `n` matching requests only.
    pub fn times(mut self, n: usize) -> Self {
        self.times = Some(n);
        self
    }

    fn add(self, then: Then) {
        let rule = Rule { when: self.when, then, after: self.after, times: self.times };
        self.script.lock().rules.push(rule);
    }

    /// The request moves its bytes and succeeds.
    pub fn succeed(self) {
        self.add(Then::Succeed);
    }

    /// The request fails with `kind`, moving nothing.
    pub fn fail(self, kind: ErrorKind) {
        self.add(Then::Fail(kind));
    }

    /// The request never finishes on its own: it is completed (as cancelled) once the caller
    /// cancels its batch.
    pub fn stall(self) {
        self.add(Then::Stall);
    }

    /// The request moves its first `bytes` bytes, then fails with `kind`.
    pub fn partial(self, bytes: u64, kind: ErrorKind) {
        self.add(Then::Partial { bytes, kind });
    }
}

impl MockScript {
    /// An empty script: every request succeeds at once.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A factory of transports following this script.
    pub fn factory(&self) -> MockTransportFactory {
        MockTransportFactory { script: self.clone() }
    }

    /// A rule for the requests matching `when` (rules are tried in the order they were added).
    pub fn when(&self, when: When) -> RuleBuilder<'_> {
        RuleBuilder { script: self, when, after: Duration::ZERO, times: None }
    }

    /// A remote segment named `name` whose memory is `bytes` at address `base`, and the
    /// descriptor to publish for it (protocol `mock`, one buffer).
    pub fn peer(&self, name: &str, base: u64, bytes: Vec<u8>) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new(name, PROTOCOL);
        d.buffers.push(BufferDesc {
            addr: base,
            length: bytes.len() as u64,
            name: "cpu:0".into(),
            device_id: None,
            extra: Default::default(),
        });
        self.lock().peers.insert(name.to_owned(), Peer { base, bytes });
        d
    }

    /// The memory of peer `name` now (what writes left there).
    pub fn peer_bytes(&self, name: &str) -> Option<Vec<u8>> {
        self.lock().peers.get(name).map(|p| p.bytes.clone())
    }

    /// Every request handed to this script's transports so far, in order.
    pub fn submitted(&self) -> Vec<Submitted> {
        self.lock().submitted.clone()
    }

    /// Records request `v` to `segment` and picks what happens to it.
    fn decide(&self, segment: &str, v: &ValidatedRequest) -> (Then, Duration) {
        let mut state = self.lock();
        let seq = state.submitted.len();
        let r = &v.request;
        state.submitted.push(Submitted {
            seq,
            segment: segment.to_owned(),
            opcode: r.opcode,
            local: r.source,
            remote: r.target_offset,
            len: r.length,
        });
        let hit = |w: &When| match w {
            When::Any => true,
            When::Nth(n) => *n == seq,
            When::Op(op) => *op == r.opcode,
            When::Remote { segment: s, range } => {
                s == segment && r.target_offset < range.end && range.start < r.target_offset.saturating_add(r.length)
            }
        };
        for rule in state.rules.iter_mut() {
            if rule.times == Some(0) || !hit(&rule.when) {
                continue;
            }
            if let Some(t) = rule.times.as_mut() {
                *t -= 1;
            }
            return (rule.then.clone(), rule.after);
        }
        (Then::Succeed, Duration::ZERO)
    }

    /// Moves up to `limit` bytes of the request `i` of `s` between its local memory and peer
    /// `segment`'s memory.
    fn copy(&self, segment: &str, s: &Submission, i: u32, limit: u64) -> Result<()> {
        let r = s.request(i).request;
        let mut state = self.lock();
        let peer = state.peers.get_mut(segment).ok_or_else(|| {
            Error::unreachable(format!("no mock peer named `{segment}` (make one with MockScript::peer)"))
        })?;
        let offset =
            r.target_offset.checked_sub(peer.base).filter(|o| o.saturating_add(r.length) <= peer.bytes.len() as u64);
        let Some(offset) = offset else {
            return Err(Error::out_of_bounds(format!(
                "mock peer `{segment}`: {:#x}+{} is outside its memory {:#x}+{}",
                r.target_offset,
                r.length,
                peer.base,
                peer.bytes.len()
            )));
        };
        let (offset, len) = (offset as usize, r.length.min(limit) as usize);
        let remote = &mut peer.bytes[offset..offset + len];
        let local = r.source as usize as *mut u8;
        match r.opcode {
            // SAFETY: `s` holds request `i`, so its local range lies in memory registered with
            // the engine (registration is the owner's promise that it stays valid) and leased
            // until the request is released, which happens only after this copy; `len` is at
            // most the request's length. The remote side is the script's own vector.
            Opcode::Read => unsafe { std::ptr::copy_nonoverlapping(remote.as_ptr(), local, len) },
            // SAFETY: as above, reading instead of writing.
            Opcode::Write => unsafe { std::ptr::copy_nonoverlapping(local.cast_const(), remote.as_mut_ptr(), len) },
        }
        Ok(())
    }

    /// The outcome of `then` for request `i` of `s` now (`None` for a stall: it waits for the
    /// caller's cancel).
    fn outcome(&self, segment: &str, s: &Submission, i: u32, then: &Then) -> Option<Result<()>> {
        if s.is_cancelled() {
            return Some(Err(Error::new(ErrorKind::Cancelled, "cancelled before the mock transport finished it")));
        }
        Some(match *then {
            Then::Succeed => self.copy(segment, s, i, u64::MAX),
            Then::Fail(kind) => Err(Error::new(kind, "scripted failure (mock transport)")),
            Then::Partial { bytes, kind } => self.copy(segment, s, i, bytes).and_then(|()| {
                Err(Error::new(kind, format!("scripted failure after {bytes} byte(s) (mock transport)")))
            }),
            Then::Stall => return None,
        })
    }

    /// Carries out `then` for the one request of `s`, after `after`.
    async fn run(self, segment: String, mut s: Submission, then: Then, after: Duration) {
        if !after.is_zero() {
            tokio::time::sleep(after).await;
        }
        let Some(&i) = s.indices().first() else { return };
        let outcome = loop {
            if let Some(o) = self.outcome(&segment, &s, i, &then) {
                break o;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        s.complete(i, outcome);
    }
}

/// Creates [`MockTransport`]s following one [`MockScript`].
#[derive(Debug, Clone)]
pub struct MockTransportFactory {
    script: MockScript,
}

#[async_trait]
impl TransportFactory for MockTransportFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        Ok(Arc::new(MockTransport { script: self.script.clone(), runtime: ctx.runtime.clone() }))
    }
}

/// The `mock` transport of one engine.
#[derive(Debug)]
pub struct MockTransport {
    script: MockScript,
    runtime: tokio::runtime::Handle,
}

#[async_trait]
impl Transport for MockTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { read: true, write: true, host_memory: true, cross_process: true, ..Capabilities::default() }
    }

    fn submit(&self, target: &Arc<OpenSegment>, submission: Submission) {
        let segment = target.name().to_owned();
        for mut one in submission.into_each() {
            let Some(&i) = one.indices().first() else { continue };
            let (then, after) = self.script.decide(&segment, one.request(i));
            // Inline when there is nothing to wait for, as a memcpy transport would.
            let now = if after.is_zero() { self.script.outcome(&segment, &one, i, &then) } else { None };
            match now {
                Some(outcome) => one.complete(i, outcome),
                None => {
                    self.runtime.spawn(self.script.clone().run(segment.clone(), one, then, after));
                }
            }
        }
    }
}
