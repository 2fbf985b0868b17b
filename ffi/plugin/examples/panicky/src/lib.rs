//! # ferry-transport-panicky
//!
//! A deliberately broken transport plugin, protocol `panicky`, for the plugin host's tests:
//! instances are created, register memory, publish and open targets normally, but
//! [`submit`](ferry_core::Transport::submit) panics with [`PANIC_MESSAGE`]. Through the plugin
//! ABI the SDK's shim catches the panic, answers `FERRY_E_INTERNAL` and logs the message
//! through the host, which fails the batch and keeps running.

use std::sync::Arc;

use async_trait::async_trait;
use ferry_core::{Capabilities, OpenSegment, Result, Submission, Transport, TransportContext, TransportFactory};

/// Protocol name.
pub const PROTOCOL: &str = "panicky";

/// What `submit` panics with (a host test can look for it in its logs).
pub const PANIC_MESSAGE: &str = "panicky transport: submit panics on purpose";

ferry_plugin::declare_plugin!(protocol = "panicky", factory = PanickyTransportFactory, capabilities = CAPABILITIES,);

/// What the transport declares: reads and writes of host memory.
pub const CAPABILITIES: Capabilities = Capabilities {
    read: true,
    write: true,
    notifications: false,
    host_memory: true,
    device_memory: false,
    cross_process: false,
};

/// Factory of the `panicky` transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct PanickyTransportFactory;

#[async_trait]
impl TransportFactory for PanickyTransportFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    async fn create(&self, _ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        Ok(Arc::new(PanickyTransport))
    }
}

/// The `panicky` transport: everything works except `submit`.
#[derive(Debug)]
pub struct PanickyTransport;

#[async_trait]
impl Transport for PanickyTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn submit(&self, _target: &Arc<OpenSegment>, _submission: Submission) {
        panic!("{PANIC_MESSAGE}");
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::{CStr, c_char, c_void};
    use std::sync::Mutex;

    use ferry_plugin::ferry_abi::*;

    use super::*;

    unsafe extern "C" fn record(ctx: *mut c_void, _level: u32, message: *const c_char) {
        // SAFETY: `ctx` is the test's `Mutex<Vec<String>>`, alive until destroy returned;
        // `message` is valid NUL-terminated UTF-8 during the call.
        let (lines, message) = unsafe { (&*ctx.cast::<Mutex<Vec<String>>>(), CStr::from_ptr(message)) };
        lines.lock().unwrap().push(message.to_string_lossy().into_owned());
    }

    #[test]
    fn submit_panics_into_an_internal_error_and_the_instance_lives_on() {
        // SAFETY: the entry returns a static table for this major version.
        let api = unsafe { &*ferry_transport_plugin_entry(FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR) };
        // SAFETY: the table's protocol is a static NUL-terminated string.
        assert_eq!(unsafe { CStr::from_ptr(api.protocol) }, c"panicky");
        assert_eq!(api.capabilities, FERRY_CAP_READ | FERRY_CAP_WRITE | FERRY_CAP_HOST_MEMORY);
        let lines = Mutex::new(Vec::<String>::new());
        let host = FerryHostServices {
            struct_size: std::mem::size_of::<FerryHostServices>() as u64,
            abi_major: FERRY_PLUGIN_ABI_MAJOR,
            abi_minor: FERRY_PLUGIN_ABI_MINOR,
            ctx: (&lines as *const Mutex<Vec<String>>).cast_mut().cast(),
            log: Some(record),
        };
        let buf = [0u8; 64];
        let mut inst = std::ptr::null_mut();
        let mut target = std::ptr::null_mut();
        let mut batch = std::ptr::null_mut();
        let request = FerryTransferRequest {
            opcode: FERRY_OPCODE_READ,
            flags: 0,
            target: 1,
            local_addr: buf.as_ptr() as u64,
            remote_addr: 0x1000,
            length: 8,
        };
        // SAFETY: valid pointers throughout; `host`, `lines` and `buf` outlive the instance.
        unsafe {
            let code = (api.create.unwrap())(&host, c"panicky-a".as_ptr(), c"{}".as_ptr(), &mut inst);
            assert_eq!(code, FERRY_OK);
            let code = (api.register_memory.unwrap())(inst, buf.as_ptr() as u64, 64, c"cpu:0".as_ptr());
            assert_eq!(code, FERRY_OK);
            let desc = c"{\"name\":\"peer\",\"protocol\":\"panicky\",\"buffers\":[{\"addr\":4096,\"length\":64}]}";
            assert_eq!((api.open_target.unwrap())(inst, desc.as_ptr(), &mut target), FERRY_OK);
            for _ in 0..2 {
                assert_eq!((api.submit.unwrap())(inst, target, &request, 1, &mut batch), FERRY_E_INTERNAL);
                assert!(batch.is_null());
            }
            // Still alive: memory comes and goes as before.
            assert_eq!((api.unregister_memory.unwrap())(inst, buf.as_ptr() as u64, 64), FERRY_OK);
            (api.close_target.unwrap())(inst, target);
            (api.shutdown.unwrap())(inst);
            (api.destroy.unwrap())(inst);
        }
        let lines = lines.into_inner().unwrap();
        let panics = lines.iter().filter(|l| l.contains("submit panicked") && l.contains(PANIC_MESSAGE)).count();
        assert_eq!(panics, 2, "{lines:?}");
    }
}
