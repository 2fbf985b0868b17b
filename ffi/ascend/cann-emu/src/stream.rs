//! Ordered streams, each executed by its own worker thread.
//!
//! Operations queued on a stream (`aclrtMemcpyAsync`, `HcclSend`/`HcclRecv`,
//! `HcclBatchGet`/`HcclBatchPut`) run one after the other in submission order. The calls return
//! as soon as the operation is queued. `aclrtSynchronizeStream(WithTimeout)` waits until every
//! operation queued before it finished and returns the first error one of them hit; that error
//! is then cleared. While an error is pending, later operations on the stream are skipped (the
//! stream is in error state until a synchronize reports it), like a device stream that stops at
//! a failed task. Destroying a stream discards what has not started and waits for the running
//! operation (whose own timeouts bound the wait).

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::boundary::lock;
use crate::codes::*;
use crate::handles::{self, Kind};

/// One queued operation.
pub(crate) type Task = Box<dyn FnOnce() -> EmuResult<()> + Send + 'static>;

#[derive(Debug, Default)]
struct State {
    submitted: u64,
    completed: u64,
    error: Option<EmuError>,
    closed: bool,
    /// `aclrtStreamAbort` is running: everything queued is discarded.
    aborting: bool,
    /// Counts aborts, so a synchronize that was waiting during one can tell.
    aborts: u64,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

/// A stream.
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) handle: u64,
    pub(crate) user_id: u32,
    pub(crate) context: u64,
    shared: Arc<Shared>,
    tx: Mutex<Option<Sender<Task>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

static STREAMS: LazyLock<Mutex<HashMap<u64, Arc<Stream>>>> = LazyLock::new(Default::default);

fn run_worker(shared: Arc<Shared>, rx: mpsc::Receiver<Task>) {
    while let Ok(task) = rx.recv() {
        let skip = {
            let st = lock(&shared.state);
            st.closed || st.error.is_some() || st.aborting
        };
        let result = if skip {
            Ok(())
        } else {
            catch_unwind(AssertUnwindSafe(task)).unwrap_or_else(|_| {
                Err(err(ACL_ERROR_RT_INTERNAL_ERROR, "a queued operation panicked inside the emulator"))
            })
        };
        let mut st = lock(&shared.state);
        if let Err(e) = result
            && st.error.is_none()
        {
            st.error = Some(e);
        }
        st.completed += 1;
        shared.cv.notify_all();
    }
}

impl Stream {
    /// Starts a stream on a device; `register` makes it reachable through its handle.
    pub(crate) fn spawn(user_id: u32, context: u64, register: bool) -> EmuResult<Arc<Stream>> {
        let (tx, rx) = mpsc::channel::<Task>();
        let shared = Arc::new(Shared::default());
        let worker_shared = Arc::clone(&shared);
        let handle = handles::new_handle(Kind::Stream);
        let worker = std::thread::Builder::new()
            .name(format!("cann-emu-stream-{:x}", handle & 0xffff_ffff))
            .spawn(move || run_worker(worker_shared, rx))
            .map_err(|e| err(ACL_ERROR_RT_NO_STREAM_RESOURCE, format!("cannot start a stream worker thread: {e}")))?;
        let s = Arc::new(Stream {
            handle,
            user_id,
            context,
            shared,
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        });
        if register {
            lock(&STREAMS).insert(handle, Arc::clone(&s));
        }
        Ok(s)
    }

    /// Queues `task`.
    pub(crate) fn submit(&self, task: Task) -> EmuResult<()> {
        let tx = lock(&self.tx);
        let Some(tx) = tx.as_ref() else {
            return Err(err(ACL_ERROR_INVALID_PARAM, "the stream was destroyed"));
        };
        lock(&self.shared.state).submitted += 1;
        if tx.send(task).is_err() {
            let mut st = lock(&self.shared.state);
            st.submitted -= 1;
            return Err(err(ACL_ERROR_RT_INTERNAL_ERROR, "the stream's worker thread is gone"));
        }
        Ok(())
    }

    /// `aclrtStreamQuery`: whether everything queued so far has finished (the outcome is the
    /// next synchronize's to report).
    pub(crate) fn is_complete(&self) -> bool {
        let st = lock(&self.shared.state);
        st.completed >= st.submitted
    }

    /// Waits for everything queued so far; `None` waits forever. Returns the first async error.
    pub(crate) fn synchronize(&self, timeout: Option<Duration>) -> EmuResult<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = lock(&self.shared.state);
        let target = st.submitted;
        let aborts = st.aborts;
        while st.completed < target {
            if st.aborts != aborts {
                return Err(err(ACL_ERROR_RT_STREAM_ABORT, "the stream was aborted while this synchronize waited"));
            }
            match deadline {
                None => st = self.shared.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(err(
                            ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
                            format!(
                                "stream synchronize timed out after {} ms with {} operation(s) still running or queued",
                                timeout.unwrap_or_default().as_millis(),
                                target - st.completed
                            ),
                        ));
                    }
                    st = self.shared.cv.wait_timeout(st, d - now).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
        match st.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `aclrtStreamAbort`: discards what has not started and waits for the running operation
    /// (the emulator cannot cut a running one short; each is bounded by its own timeouts). A
    /// synchronize waiting meanwhile returns `ACL_ERROR_RT_STREAM_ABORT` (107023); afterwards the
    /// stream is empty and normal again, its pending error cleared (runtime `Stream::StreamAbort`
    /// restores the normal state; see docs/ascend.md).
    pub(crate) fn abort(&self) {
        let mut st = lock(&self.shared.state);
        st.aborting = true;
        st.aborts += 1;
        self.shared.cv.notify_all();
        let target = st.submitted;
        while st.completed < target {
            st = self.shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.aborting = false;
        st.error = None;
    }

    /// Discards what has not started, waits for the running operation, stops the worker.
    pub(crate) fn shutdown(&self) {
        lock(&self.shared.state).closed = true;
        lock(&self.tx).take();
        if let Some(w) = lock(&self.worker).take()
            && w.thread().id() != std::thread::current().id()
        {
            let _ = w.join();
        }
    }
}

/// The stream behind a non-NULL `aclrtStream`.
pub(crate) fn lookup(ptr: *const c_void) -> Option<Arc<Stream>> {
    let h = handles::from_ptr(Kind::Stream, ptr)?;
    lock(&STREAMS).get(&h).cloned()
}

/// `aclrtDestroyStream`.
pub(crate) fn destroy(ptr: *const c_void) -> EmuResult<()> {
    let s = handles::from_ptr(Kind::Stream, ptr)
        .and_then(|h| lock(&STREAMS).remove(&h))
        .ok_or_else(|| err(ACL_ERROR_INVALID_PARAM, format!("{ptr:p} is not a live stream")))?;
    s.shutdown();
    Ok(())
}

/// Destroys every registered stream created in `context`.
pub(crate) fn destroy_streams_of_context(context: u64) {
    let dead: Vec<Arc<Stream>> = {
        let mut all = lock(&STREAMS);
        let ids: Vec<u64> = all.values().filter(|s| s.context == context).map(|s| s.handle).collect();
        ids.iter().filter_map(|id| all.remove(id)).collect()
    };
    for s in dead {
        s.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    #[test]
    fn tasks_run_in_order_and_the_first_error_is_reported_once() {
        let s = Stream::spawn(0, 0, false).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..50u32 {
            let log = Arc::clone(&log);
            s.submit(Box::new(move || {
                if i % 7 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                lock(&log).push(i);
                Ok(())
            }))
            .unwrap();
        }
        s.synchronize(None).unwrap();
        assert_eq!(*lock(&log), (0..50).collect::<Vec<_>>());

        let ran = Arc::new(AtomicU64::new(0));
        s.submit(Box::new(|| Err(err(ACL_ERROR_RT_LINK_ERROR, "first")))).unwrap();
        s.submit(Box::new(|| Err(err(ACL_ERROR_RT_TASK_TIMEOUT, "second")))).unwrap();
        let r = Arc::clone(&ran);
        s.submit(Box::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }))
        .unwrap();
        let e = s.synchronize(None).unwrap_err();
        assert_eq!((e.code, e.message.as_str()), (ACL_ERROR_RT_LINK_ERROR, "first"));
        assert_eq!(ran.load(Ordering::SeqCst), 0, "operations after a failure are skipped");
        s.synchronize(None).unwrap();
        s.shutdown();
    }

    #[test]
    fn synchronize_with_a_timeout_gives_up_and_a_panic_becomes_an_error() {
        let s = Stream::spawn(0, 0, false).unwrap();
        s.submit(Box::new(|| {
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        }))
        .unwrap();
        let e = s.synchronize(Some(Duration::from_millis(20))).unwrap_err();
        assert_eq!(e.code, ACL_ERROR_RT_STREAM_SYNC_TIMEOUT);
        s.synchronize(None).unwrap();
        s.submit(Box::new(|| panic!("boom"))).unwrap();
        assert_eq!(s.synchronize(None).unwrap_err().code, ACL_ERROR_RT_INTERNAL_ERROR);
        s.shutdown();
        assert!(s.submit(Box::new(|| Ok(()))).is_err());
    }
}
