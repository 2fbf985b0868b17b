//! [`DeviceThread`]: an OS thread bound to one device that owns some state and runs closures
//! on it, in order. ACL state is per thread; this is how the rest of Ferry calls ACL and HCCL
//! without ever binding a thread it does not own (a tokio worker, a caller's thread).
//!
//! A caller whose own thread already has the device thread's context current (it called
//! `aclrtSetDevice` on the same device, as an inference engine's worker thread does) may run a
//! job itself instead, with [`DeviceThread::run_here`]: no hand-off to the device thread and no
//! wake-up back. CANN allows a context, and the streams and communicators made in it, to be
//! used from another thread provided the user orders the tasks of each stream
//! (`aclrtSetCurrentContext`, restrictions: "If thread A calls aclrtCreateContext to create a
//! context and thread B uses this context, ensure the tasks execution sequence of the two
//! threads that are in the same stream of the same context"); the state's lock and the queue
//! count below are that ordering.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_ascend_sys::Library;

use crate::device::Device;
use crate::error::{AscendError, Result};

type Job<S> = Box<dyn FnOnce(&Device, &mut S) + Send + 'static>;

/// A device thread's state that may be used from another thread whose current ACL context is
/// the device thread's ([`DeviceThread::run_here`]).
///
/// # Safety
///
/// Implementing it promises that the type's only tie to the thread that made it is the ACL
/// context: it holds ACL and HCCL handles (streams, communicators, registrations) and
/// thread-safe values, and nothing that another thread must never touch (no `Rc`, no
/// thread-local, no reference into another thread's stack). Such a value is used by one thread
/// at a time (under the device thread's lock) and only where that context is current, which is
/// how CANN lets a context's streams be used from another thread.
pub unsafe trait ContextShared {}

// SAFETY: no state at all.
unsafe impl ContextShared for () {}

/// The device thread's device and state, behind the lock that orders their users.
///
/// `Device` and `S` are not `Send`: ACL keeps the current context per thread. They are made on
/// the device thread and dropped there (the thread takes them out before it ends), and used
/// only by the device thread, or, when `S` is [`ContextShared`], by [`DeviceThread::run_here`]
/// on a thread whose current context it checked to be the device thread's (under the lock).
struct OnDevice<S>(Option<(Device, S)>);

// SAFETY: see `OnDevice`: the values never move to another thread (the handle shares only the
// lock around them). A state that is not `ContextShared` is only ever touched by the device
// thread; one that is may be used under the lock by a thread with the same context, which its
// `ContextShared` implementation vouches for; `Device` holds an `Arc<Library>` and an id.
unsafe impl<S> Send for OnDevice<S> {}

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
    /// The device and the state; `None` once the thread dropped them.
    state: Arc<Mutex<OnDevice<S>>>,
    /// Jobs submitted and not finished: [`run_here`](Self::run_here) never overtakes one.
    queued: Arc<AtomicUsize>,
    /// The thread's current context (`aclrtGetCurrentContext` on it), when the library has
    /// that function.
    context: Option<usize>,
    lib: Arc<Library>,
    /// How long, in microseconds, the thread polls its queue after a job before it sleeps
    /// ([`set_idle_poll`](Self::set_idle_poll)).
    idle_poll_us: Arc<AtomicU64>,
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
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Option<usize>>>();
        let thread_lib = lib.clone();
        let done = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let done2 = done.clone();
        let state = Arc::new(Mutex::new(OnDevice(None)));
        let thread_state = state.clone();
        let queued = Arc::new(AtomicUsize::new(0));
        let thread_queued = queued.clone();
        let idle_poll_us = Arc::new(AtomicU64::new(0));
        let thread_idle_poll = idle_poll_us.clone();
        let thread_name = name.clone();
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _done = SetOnDrop(done2);
                let started = Device::bind(&thread_lib, user_id).and_then(|dev| init(&dev).map(|s| (dev, s)));
                match started {
                    Ok(v) => {
                        let context = current_context(&thread_lib);
                        lock(&thread_state).0 = Some(v);
                        let _ = ready_tx.send(Ok(context));
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Some(job) = next_job(&rx, Duration::from_micros(thread_idle_poll.load(Ordering::Relaxed))) {
                    let mut held = lock(&thread_state);
                    if let Some((device, state)) = held.0.as_mut()
                        && std::panic::catch_unwind(AssertUnwindSafe(|| job(device, state))).is_err()
                    {
                        tracing::error!(thread = %thread_name, "a job on a device thread panicked; the thread goes on");
                    }
                    drop(held);
                    thread_queued.fetch_sub(1, Ordering::AcqRel);
                }
                // Dropped here, on the thread that made them.
                let gone = lock(&thread_state).0.take();
                drop(gone);
            })
            .map_err(|e| AscendError::Thread { name: name.clone(), reason: format!("cannot start: {e}") })?;
        let context = match ready_rx.recv() {
            Ok(Ok(context)) => context,
            Ok(Err(e)) => {
                let _ = handle.join();
                return Err(e);
            }
            Err(_) => {
                let _ = handle.join();
                return Err(AscendError::Thread { name, reason: "ended while starting (a panic?)".into() });
            }
        };
        Ok(Self {
            name,
            tx: Mutex::new(Some(tx)),
            handle: Mutex::new(Some(handle)),
            done,
            state,
            queued,
            context,
            lib: lib.clone(),
            idle_poll_us,
        })
    }

    /// Makes the thread poll its queue for `poll` after each job before it sleeps (zero, the
    /// default: it sleeps at once). A caller that submits one batch after another then finds
    /// it awake: waking a sleeping thread costs tens of microseconds on a virtualised host,
    /// more than a small batch. The poll yields the core between attempts (`sched_yield`), so a
    /// thread that needs the core meanwhile (the caller, an I/O thread) gets it.
    pub fn set_idle_poll(&self, poll: Duration) {
        let us = u64::try_from(poll.as_micros()).unwrap_or(u64::MAX);
        self.idle_poll_us.store(us, Ordering::Relaxed);
    }

    /// The thread's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Queues `job`; it runs after everything queued before it. Never blocks.
    pub fn submit(&self, job: impl FnOnce(&Device, &mut S) + Send + 'static) -> Result<()> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        self.queued.fetch_add(1, Ordering::AcqRel);
        let sent = match tx.as_ref() {
            Some(tx) => tx.send(Box::new(job)).is_ok(),
            None => false,
        };
        if sent {
            Ok(())
        } else {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            Err(AscendError::Thread { name: self.name.clone(), reason: "stopped".into() })
        }
    }

    /// Runs `job` on the calling thread, at once, when that thread's current context is the
    /// device thread's (it called `aclrtSetDevice` on the same device), nothing is queued on the
    /// device thread and no job is running there or elsewhere: the job then sees the same
    /// device and state as on the device thread, and no thread is woken. Gives `job` back,
    /// unrun, otherwise (the caller then [`submit`](Self::submit)s it). Never blocks, except
    /// for as long as `job` runs.
    pub fn run_here<R, F: FnOnce(&Device, &mut S) -> R>(&self, job: F) -> std::result::Result<R, F>
    where
        S: ContextShared,
    {
        let Some(context) = self.context else { return Err(job) };
        if self.queued.load(Ordering::Acquire) != 0 || current_context(&self.lib) != Some(context) {
            return Err(job);
        }
        let Ok(mut held) = self.state.try_lock() else { return Err(job) };
        // Checked again under the lock: a job submitted meanwhile waits for this one, and must
        // not be overtaken by it if it was queued first.
        if self.queued.load(Ordering::Acquire) != 0 {
            return Err(job);
        }
        match held.0.as_mut() {
            Some((device, state)) => Ok(job(device, state)),
            None => Err(job),
        }
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

/// The next job, polling `rx` for `poll` before sleeping on it, and yielding the core between
/// attempts (a spin that did not yield kept the emulated device's own threads waiting for a
/// core, on two cores); `None` once it is closed and empty.
fn next_job<J>(rx: &mpsc::Receiver<J>, poll: Duration) -> Option<J> {
    if !poll.is_zero() {
        let until = Instant::now() + poll;
        loop {
            match rx.try_recv() {
                Ok(job) => return Some(job),
                Err(mpsc::TryRecvError::Disconnected) => return None,
                Err(mpsc::TryRecvError::Empty) if Instant::now() >= until => break,
                Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
    }
    rx.recv().ok()
}

/// The lock, whoever panicked while holding it (a job's panic is caught inside it).
fn lock<S>(m: &Mutex<OnDevice<S>>) -> std::sync::MutexGuard<'_, OnDevice<S>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The calling thread's current ACL context, `None` when it has none (or the library cannot
/// say).
pub fn current_context(lib: &Library) -> Option<usize> {
    let f = lib.optional().current_context?;
    let mut ctx: ferry_ascend_sys::raw::AclrtContext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    let code = unsafe { f(&mut ctx) };
    (code == 0 && !ctx.is_null()).then_some(ctx as usize)
}

struct SetOnDrop(Arc<(Mutex<bool>, std::sync::Condvar)>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        let (lock, cv) = &*self.0;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use ferry_ascend_sys::test_support::{Emulator, emulator_lib_dir};
    use ferry_ascend_sys::{Library, SearchPath};

    use super::*;

    #[test]
    fn the_next_job_is_taken_while_polling_or_after_and_a_closed_queue_ends_the_poll() {
        let (tx, rx) = mpsc::channel::<u32>();
        tx.send(1).unwrap();
        assert_eq!(next_job(&rx, Duration::from_secs(60)), Some(1), "a queued job at once");
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(2).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            tx.send(3).unwrap();
        });
        assert_eq!(next_job(&rx, Duration::from_secs(60)), Some(2), "one sent during the poll");
        let t = Instant::now();
        assert_eq!(next_job(&rx, Duration::from_millis(1)), Some(3), "one sent after the poll: a sleeping wait");
        assert!(t.elapsed() >= Duration::from_millis(50));
        sender.join().unwrap();
        let t = Instant::now();
        assert_eq!(next_job(&rx, Duration::from_secs(60)), None, "a closed queue ends the poll");
        assert!(t.elapsed() < Duration::from_secs(30));
    }

    /// A thread that polls its queue for a long time after each job still runs jobs in order
    /// and stops at once when asked.
    #[test]
    fn a_polling_device_thread_runs_jobs_in_order_and_stops_at_once() {
        let dir = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        let worker = DeviceThread::spawn(&lib, 1, "test-poll", |_| Ok(Vec::new())).unwrap();
        worker.set_idle_poll(Duration::from_secs(60));
        for i in 0..100u32 {
            worker.submit(move |_, seen: &mut Vec<u32>| seen.push(i)).unwrap();
        }
        assert_eq!(worker.call(|_, seen| seen.clone()).unwrap(), (0..100).collect::<Vec<_>>());
        let t = Instant::now();
        assert!(worker.stop(Duration::from_secs(10)), "a polling thread stops when its queue closes");
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    /// A job runs on the caller's thread only when that thread has the device thread's context
    /// current and nothing is queued or running on the device thread; otherwise it is given
    /// back, unrun.
    #[test]
    fn a_job_runs_here_only_with_the_same_context_and_an_idle_thread() {
        let dir = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        let worker = DeviceThread::spawn(&lib, 1, "test-here", |dev| dev.create_stream()).unwrap();
        let here = std::thread::current().id();

        // No context on this thread yet: given back.
        assert_eq!(current_context(&lib), None);
        assert!(worker.run_here(|_, _| ()).is_err(), "a thread without a context runs nothing");

        // Another device's context: given back.
        let other = Device::bind(&lib, 0).unwrap();
        assert!(worker.run_here(|_, _| ()).is_err(), "device 0's context is not device 1's");

        // The same device: runs here, on the device thread's stream, with the thread's device.
        let same = Device::bind(&lib, 1).unwrap();
        let ran = worker.run_here(|dev, stream| {
            assert_eq!(std::thread::current().id(), here);
            assert_eq!(dev.current().unwrap(), 1);
            let buf = dev.alloc(64).unwrap();
            buf.write(0, b"here").unwrap();
            stream.synchronize(Some(Duration::from_secs(5))).unwrap();
            let mut out = [0u8; 4];
            buf.read(0, &mut out).unwrap();
            out
        });
        assert_eq!(ran.ok(), Some(*b"here"));

        // A job running on the device thread: given back (never two users of the stream).
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        worker
            .submit(move |_, _| {
                started_tx.send(()).unwrap();
                let _ = release_rx.recv();
            })
            .unwrap();
        started_rx.recv().unwrap();
        assert!(worker.run_here(|_, _| ()).is_err(), "the device thread is busy");
        // Queued behind it: still given back once the first ends, until the queue is empty.
        let (queued_tx, queued_rx) = mpsc::channel();
        worker.submit(move |_, _| queued_tx.send(()).unwrap()).unwrap();
        release_tx.send(()).unwrap();
        queued_rx.recv().unwrap();
        // The queue count drops right after the job: wait for it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while worker.queued.load(Ordering::Acquire) != 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(worker.run_here(|_, _| ()).is_ok(), "idle again");

        // Stopped: the state is gone with the thread.
        assert!(worker.stop(Duration::from_secs(5)));
        assert!(worker.run_here(|_, _| ()).is_err(), "a stopped thread's state is gone");
        drop((other, same));
    }
}
