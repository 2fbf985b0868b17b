//! # ferry-ascend-runtime
//!
//! Safe Rust over Huawei Ascend's ACL runtime and HCCL, as loaded at run time by
//! [`ferry_ascend_sys`]: devices, streams, buffers, communicators and device threads. The
//! `unsafe` of calling C lives here, next to what each call needs of its memory; every type of
//! this crate owns its ACL or HCCL resource and releases it when dropped.
//!
//! - [`AclQueries`]: process-wide calls on a loaded [`Library`] (`aclInit` once, the device
//!   count, user → logical → physical device ids, the SoC, Atlas A3 super-pod ids).
//! - [`Device`] (a thread bound with `aclrtSetDevice`), [`Stream`], [`DeviceBuffer`],
//!   [`HostBuffer`]: ACL state is per thread, so device objects are not `Send` and live on the
//!   thread that made them.
//! - [`RootInfo`], [`Communicator`] (two-sided and one-sided) and [`GlobalMem`]: HCCL.
//! - [`DeviceThread`]: a bound OS thread that owns state and runs closures on it, the way the
//!   rest of Ferry calls ACL and HCCL without binding a thread it does not own.
//! - [`AscendError`] keeps the failing call's name and code with the runtime's text.
//!
//! Everything here has been exercised against Ferry's emulated CANN only, never on an NPU.
//!
//! [`Library`]: ferry_ascend_sys::Library

mod device;
mod error;
mod hccl;
mod query;
mod worker;

pub use device::{Device, DeviceBuffer, Drained, HostBuffer, PointerKind, Stream};
pub use error::{AscendError, Result};
pub use hccl::{Communicator, GlobalMem, MemKind, OneSidedOp, RootInfo};
pub use query::AclQueries;
pub use worker::{ContextShared, DeviceThread, current_context};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ferry_ascend_sys::test_support::{Emulator, emulator_lib_dir};
    use ferry_ascend_sys::{ACL_ERROR_INVALID_DEVICE, Library, SearchPath};

    use super::*;
    use crate::error::Checks;

    #[test]
    fn the_emulator_runs_on_a_device_thread() {
        let dir = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        assert!(lib.device_count().unwrap() >= 2);
        assert_eq!(lib.physical_device(1).unwrap().0, 1, "outside a container user id = physical id");
        let err = lib.physical_device(4096).unwrap_err();
        assert_eq!(err.code(), Some(ACL_ERROR_INVALID_DEVICE), "{err}");
        let err = Device::bind(&lib, 4096).unwrap_err();
        assert_eq!(err.call(), Some("aclrtSetDevice"));

        let worker = DeviceThread::spawn(&lib, 1, "test-dev1", |dev| dev.create_stream()).unwrap();
        let got = worker
            .call(|dev, stream| {
                assert_eq!(dev.current().unwrap(), 1, "the thread is bound to user device 1");
                let buf = dev.alloc(4096).unwrap();
                buf.write(100, b"ferry").unwrap();
                stream.synchronize(Some(Duration::from_secs(5))).unwrap();
                // The emulator has aclrtStreamAbort: draining aborts (an idle stream here).
                assert!(dev.library().capabilities().stream_abort);
                assert!(stream.abort(), "the abort succeeded");
                assert!(matches!(stream.drain(), Drained::Aborted));
                stream.synchronize(Some(Duration::from_secs(5))).unwrap();
                let mut out = [0u8; 5];
                buf.read(100, &mut out).unwrap();
                assert!(buf.write(4095, b"xy").is_err(), "writes past the end are refused");
                out
            })
            .unwrap();
        assert_eq!(&got, b"ferry");
        assert!(worker.stop(Duration::from_secs(5)));
        assert!(worker.submit(|_, _| {}).is_err(), "a stopped thread takes no jobs");
    }

    #[test]
    fn one_sided_calls_on_the_legacy_emulator_are_not_supported() {
        let dir = emulator_lib_dir(Emulator::Legacy).unwrap_or_else(|e| panic!("{e}"));
        let lib = Library::load_from(&SearchPath::only(dir.path())).unwrap();
        let Err(err) = lib.one_sided("HcclBatchGet") else { panic!("one-sided calls are present") };
        assert!(err.is_not_supported(), "{err}");
        assert!(err.to_string().contains("HcclBatchGet"), "{err}");
    }
}
