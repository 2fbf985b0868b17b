//! [`DeviceThread`]: an OS thread bound to one device that owns some state and runs closures
//! on it, in order. ACL state is per thread; this is how the rest of Ferry calls ACL and HCCL
//! without ever binding a thread it does not own (a tokio worker, a caller's thread).

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_ascend_sys::Library;

use crate::device::Device;
use crate::error::{AscendError, Result};

type Job<S> = Box<dyn FnOnce(&Device, &mut S) + Send + 'static>;

/// A thread bound to one device (`aclrtSetDevice` ran on it) that owns a state `S` made on it,
/// and runs submitted closures against the [`Device`] and the state, one at a time, in
/// submission order. `S` need not be `Send`: it is created, used and dropped on the thread, so
/// it can hold [`Stream`](crate::Stream)s and [`Communicator`](crate::Communicator)s.
///
/// Dropping the handle (or [`stop`](Self::stop)) closes the queue: the thread runs what is
/// queued, drops the state (tearing its resources down on the right thread), and exits.
pub struct DeviceThread<S: 'static> {
    name: String,
    tx: Mutex<Option<mpsc::Sender<Job<S>>>>,
    handle: Mutex<Option<JoinHandle<()>>>,
    done: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl<S: 'static> std::fmt::Debug for DeviceThread<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceThread").field("name", &self.name).finish()
    }
}

impl<S: 'static> DeviceThread<S> {
    /// Starts a thread named `name`, binds it to user device `user_id` and builds the state
    /// with `init`; returns once both succeeded (or with their error).
    pub fn spawn(
        lib: &Arc<Library>,
        user_id: u32,
        name: impl Into<String>,
        init: impl FnOnce(&Device) -> Result<S> + Send + 'static,
    ) -> Result<Self> {
        let name = name.into();
        let (tx, rx) = mpsc::channel::<Job<S>>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let lib = lib.clone();
        let done = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let done2 = done.clone();
        let thread_name = name.clone();
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _done = SetOnDrop(done2);
                let started = Device::bind(&lib, user_id).and_then(|dev| init(&dev).map(|s| (dev, s)));
                let (device, mut state) = match started {
                    Ok(v) => {
                        let _ = ready_tx.send(Ok(()));
                        v
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Ok(job) = rx.recv() {
                    if std::panic::catch_unwind(AssertUnwindSafe(|| job(&device, &mut state))).is_err() {
                        tracing::error!(thread = %thread_name, "a job on a device thread panicked; the thread goes on");
                    }
                }
                drop(state);
            })
            .map_err(|e| AscendError::Thread { name: name.clone(), reason: format!("cannot start: {e}") })?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = handle.join();
                return Err(e);
            }
            Err(_) => {
                let _ = handle.join();
                return Err(AscendError::Thread { name, reason: "ended while starting (a panic?)".into() });
            }
        }
        Ok(Self { name, tx: Mutex::new(Some(tx)), handle: Mutex::new(Some(handle)), done })
    }

    /// The thread's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Queues `job`; it runs after everything queued before it. Never blocks.
    pub fn submit(&self, job: impl FnOnce(&Device, &mut S) + Send + 'static) -> Result<()> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let sent = match tx.as_ref() {
            Some(tx) => tx.send(Box::new(job)).is_ok(),
            None => false,
        };
        if sent { Ok(()) } else { Err(AscendError::Thread { name: self.name.clone(), reason: "stopped".into() }) }
    }

    /// Runs `f` on the thread and waits for its result (for callers that may block).
    pub fn call<R: Send + 'static>(&self, f: impl FnOnce(&Device, &mut S) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = mpsc::channel();
        self.submit(move |d, s| {
            let _ = tx.send(f(d, s));
        })?;
        rx.recv().map_err(|_| AscendError::Thread {
            name: self.name.clone(),
            reason: "the job did not finish (it panicked?)".into(),
        })
    }

    /// Closes the queue and waits up to `timeout` for the thread to finish what is queued and
    /// drop its state. Returns false when it is still busy (it then finishes on its own: a
    /// device call may block for HCCL's own timeouts).
    pub fn stop(&self, timeout: Duration) -> bool {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (lock, cv) = &*self.done;
        let deadline = Instant::now() + timeout;
        let mut finished = lock.lock().unwrap_or_else(|p| p.into_inner());
        while !*finished {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            finished = cv.wait_timeout(finished, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(finished);
        if let Some(h) = self.handle.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
        true
    }
}

impl<S: 'static> Drop for DeviceThread<S> {
    fn drop(&mut self) {
        // Never block in drop: the thread ends by itself once its queue is empty.
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

struct SetOnDrop(Arc<(Mutex<bool>, std::sync::Condvar)>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        let (lock, cv) = &*self.0;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
    }
}
