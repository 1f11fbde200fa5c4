//! `cuInit`, the driver version, device queries and error strings: answered locally, from what the server
//! described at connect (every device attribute is fetched once, in the hello).

use std::ffi::{CString, c_char, c_void};
use std::sync::OnceLock;

use gleam_protocol::types::{CUresult, ERROR_NAMES};

use crate::{put, state};

/// The driver version reported before a session exists: NVIDIA's 580 driver is CUDA 13.0.
pub const OFFLINE_DRIVER_VERSION: i32 = 13000;

// Attributes whose features the shim does not provide across the network, so it reports them absent
// (a program then takes the paths Gleam supports).
const PAGEABLE_MEMORY_ACCESS: u32 = 88;
const COMPUTE_CAPABILITY_MAJOR: u32 = 75;
const COMPUTE_CAPABILITY_MINOR: u32 = 76;
// Mirrored memory (`crate::hostmem`): managed memory and concurrent access are the server's (its copy is
// managed memory); mapping and registering host memory need the server to map host memory; registered
// memory has its own device address; the host never reaches the device's memory directly.
const CAN_MAP_HOST_MEMORY: u32 = 19;
const CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: u32 = 91;
const HOST_REGISTER_SUPPORTED: u32 = 99;
const PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES: u32 = 100;
const DIRECT_MANAGED_MEM_ACCESS_FROM_HOST: u32 = 101;
const READ_ONLY_HOST_REGISTER_SUPPORTED: u32 = 113;

/// `cuDeviceGetAttribute` of device `dev`, with the overrides above.
pub fn attribute(dev: i32, attrib: u32) -> Result<i32, CUresult> {
    match attrib {
        PAGEABLE_MEMORY_ACCESS
        | CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
        | PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES
        | DIRECT_MANAGED_MEM_ACCESS_FROM_HOST => {
            state::device(dev)?;
            Ok(0)
        }
        HOST_REGISTER_SUPPORTED | READ_ONLY_HOST_REGISTER_SUPPORTED => {
            server_attribute(dev, CAN_MAP_HOST_MEMORY)
        }
        CAN_MAP_HOST_MEMORY if !crate::hostmem::pinned_mirrored() => {
            state::device(dev)?;
            Ok(0)
        }
        _ => server_attribute(dev, attrib),
    }
}

/// What the serving device itself says (no override).
pub fn server_attribute(dev: i32, attrib: u32) -> Result<i32, CUresult> {
    let info = state::device(dev)?;
    usize::try_from(attrib)
        .ok()
        .filter(|&i| i > 0)
        .and_then(|i| info.attributes.get(i).copied())
        .ok_or(CUresult::INVALID_VALUE)
}

/// Copies `text` into a caller buffer of `len` bytes, truncating and always NUL-terminating.
unsafe fn put_str(out: *mut c_char, len: i32, text: &str) -> Result<(), CUresult> {
    if out.is_null() || len <= 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: the caller's buffer holds `len` bytes; we write n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast::<u8>(), n);
        *out.add(n) = 0;
    }
    Ok(())
}

/// NUL-terminated names and descriptions with static lifetime, for `cuGetErrorName`/`String`.
fn error_strings() -> &'static [(u32, CString, CString)] {
    static STRINGS: OnceLock<Vec<(u32, CString, CString)>> = OnceLock::new();
    STRINGS.get_or_init(|| {
        ERROR_NAMES
            .iter()
            .map(|&(code, name)| {
                let text = describe(code).map_or_else(
                    || {
                        name.trim_start_matches("CUDA_ERROR_")
                            .replace('_', " ")
                            .to_lowercase()
                    },
                    str::to_owned,
                );
                (
                    code,
                    CString::new(name).unwrap_or_default(),
                    CString::new(text).unwrap_or_default(),
                )
            })
            .collect()
    })
}

fn describe(code: u32) -> Option<&'static str> {
    Some(match code {
        0 => "no error",
        1 => "invalid argument",
        2 => "out of memory",
        3 => "initialization error",
        4 => "driver shutting down",
        46 => "CUDA-capable device(s) is/are busy or unavailable",
        100 => "no CUDA-capable device is detected",
        101 => "invalid device ordinal",
        200 => "device kernel image is invalid",
        201 => "invalid device context",
        209 => "no kernel image is available for execution on the device",
        218 => "a PTX JIT compilation failed",
        400 => "invalid resource handle",
        500 => "named symbol not found",
        600 => "device not ready",
        700 => "an illegal memory access was encountered",
        701 => "too many resources requested for launch",
        719 => "unspecified launch failure",
        801 => "operation not supported",
        999 => "unknown error",
        _ => return None,
    })
}

pub unsafe fn cuInit(flags: u32) -> Result<(), CUresult> {
    if flags != 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    state::init()
}

pub unsafe fn cuDriverGetVersion(version: *mut i32) -> Result<(), CUresult> {
    let v =
        state::session_if_up().map_or(OFFLINE_DRIVER_VERSION, |s| s.client.hello().driver_version);
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put(version, v) }
}

pub unsafe fn cuDeviceGet(device: *mut i32, ordinal: i32) -> Result<(), CUresult> {
    state::device(ordinal)?;
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put(device, ordinal) }
}

pub unsafe fn cuDeviceGetCount(count: *mut i32) -> Result<(), CUresult> {
    let session = state::session()?;
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put(count, session.client.hello().devices.len() as i32) }
}

pub unsafe fn cuDeviceGetName(name: *mut c_char, len: i32, dev: i32) -> Result<(), CUresult> {
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put_str(name, len, &state::device(dev)?.name) }
}

pub unsafe fn cuDeviceGetUuid(uuid: *mut c_void, dev: i32) -> Result<(), CUresult> {
    // SAFETY: a CUuuid (16 bytes) out-pointer, NULL refused by `put`.
    unsafe { put(uuid.cast::<[u8; 16]>(), state::device(dev)?.uuid) }
}

pub unsafe fn cuDeviceGetUuid_v2(uuid: *mut c_void, dev: i32) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { put(uuid.cast::<[u8; 16]>(), state::device(dev)?.uuid) }
}

pub unsafe fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) -> Result<(), CUresult> {
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put(bytes, state::device(dev)?.total_mem as usize) }
}

pub unsafe fn cuDeviceGetAttribute(value: *mut i32, attrib: u32, dev: i32) -> Result<(), CUresult> {
    let v = attribute(dev, attrib)?;
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put(value, v) }
}

pub unsafe fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: i32, dev: i32) -> Result<(), CUresult> {
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put_str(bus_id, len, &state::device(dev)?.pci_bus_id) }
}

pub unsafe fn cuDeviceGetByPCIBusId(dev: *mut i32, bus_id: *const c_char) -> Result<(), CUresult> {
    if bus_id.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the caller's NUL-terminated string (NULL refused above).
    let wanted = unsafe { std::ffi::CStr::from_ptr(bus_id) }
        .to_str()
        .ok()
        .and_then(PciAddress::parse)
        .ok_or(CUresult::INVALID_VALUE)?;
    let session = state::session()?;
    let ordinal = session
        .client
        .hello()
        .devices
        .iter()
        .position(|d| PciAddress::parse(&d.pci_bus_id).is_some_and(|a| wanted.names(&a)))
        .ok_or(CUresult::INVALID_DEVICE)?;
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(dev, ordinal as i32) }
}

/// A PCI address as `cuDeviceGetByPCIBusId` takes it: `[domain]:[bus]:[device].[function]`,
/// `[domain]:[bus]:[device]` or `[bus]:[device].[function]`, in hexadecimal.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
struct PciAddress {
    domain: u32,
    bus: u32,
    device: u32,
    function: Option<u32>,
}

impl PciAddress {
    fn parse(text: &str) -> Option<Self> {
        let hex = |s: &str| u32::from_str_radix(s.trim(), 16).ok();
        let parts: Vec<&str> = text.trim().split(':').collect();
        let (domain, bus, rest) = match parts[..] {
            [domain, bus, rest] => (hex(domain)?, hex(bus)?, rest),
            [bus, rest] if rest.contains('.') => (0, hex(bus)?, rest),
            _ => return None,
        };
        let (device, function) = match rest.split_once('.') {
            Some((device, function)) => (hex(device)?, Some(hex(function)?)),
            None => (hex(rest)?, None),
        };
        Some(Self {
            domain,
            bus,
            device,
            function,
        })
    }

    /// Whether this (possibly partial) address names the device at `full`.
    fn names(&self, full: &PciAddress) -> bool {
        (self.domain, self.bus, self.device) == (full.domain, full.bus, full.device)
            && self.function.unwrap_or(0) == full.function.unwrap_or(0)
    }
}

pub unsafe fn cuDeviceComputeCapability(
    major: *mut i32,
    minor: *mut i32,
    dev: i32,
) -> Result<(), CUresult> {
    let (ma, mi) = (
        attribute(dev, COMPUTE_CAPABILITY_MAJOR)?,
        attribute(dev, COMPUTE_CAPABILITY_MINOR)?,
    );
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put(major, ma)? };
    // SAFETY: the caller's out-pointer or buffer (NULL is refused).
    unsafe { put(minor, mi) }
}

pub unsafe fn cuDeviceGetProperties(prop: *mut c_void, dev: i32) -> Result<(), CUresult> {
    // CUdevprop: maxThreadsPerBlock, maxThreadsDim[3], maxGridSize[3], sharedMemPerBlock,
    // totalConstantMemory, SIMDWidth, memPitch, regsPerBlock, clockRate, textureAlign = attributes 1..=14.
    let mut out = [0i32; 14];
    for (i, slot) in out.iter_mut().enumerate() {
        *slot = attribute(dev, i as u32 + 1)?;
    }
    // SAFETY: a CUdevprop (14 ints) out-pointer, NULL refused by `put`.
    unsafe { put(prop.cast::<[i32; 14]>(), out) }
}

pub unsafe fn cuGetErrorName(error: u32, text: *mut *const c_char) -> Result<(), CUresult> {
    if text.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    match error_strings().iter().find(|(code, _, _)| *code == error) {
        // SAFETY: the caller's out-pointer, checked non-NULL.
        Some((_, name, _)) => unsafe { put(text, name.as_ptr()) },
        None => {
            // SAFETY: the caller's out-pointer or buffer (NULL is refused).
            unsafe { put(text, std::ptr::null())? };
            Err(CUresult::INVALID_VALUE)
        }
    }
}

pub unsafe fn cuGetErrorString(error: u32, text: *mut *const c_char) -> Result<(), CUresult> {
    if text.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    match error_strings().iter().find(|(code, _, _)| *code == error) {
        // SAFETY: as above.
        Some((_, _, description)) => unsafe { put(text, description.as_ptr()) },
        None => {
            // SAFETY: the caller's out-pointer or buffer (NULL is refused).
            unsafe { put(text, std::ptr::null())? };
            Err(CUresult::INVALID_VALUE)
        }
    }
}

#[cfg(test)]
mod pci_tests {
    use super::PciAddress;

    #[test]
    fn pci_bus_ids_parse_in_every_form_cuda_accepts() {
        let full = PciAddress::parse("0000:3b:00.0").unwrap();
        assert_eq!((full.domain, full.bus, full.device), (0, 0x3b, 0));
        for form in ["0000:3b:00.0", "0:3B:0", "3b:00.0", "00000000:3b:00.0"] {
            let a = PciAddress::parse(form).unwrap();
            assert!(a.names(&full), "{form}");
        }
        assert!(!PciAddress::parse("0000:3c:00.0").unwrap().names(&full));
        assert!(!PciAddress::parse("0000:3b:00.1").unwrap().names(&full));
        for bad in ["", "3b", "zz:00.0", "0:1:2:3", "3b:00"] {
            assert_eq!(PciAddress::parse(bad), None, "{bad:?}");
        }
    }
}
