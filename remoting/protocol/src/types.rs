//! The C ABI types of the CUDA driver API, as Gleam's shim exports them and the server's real driver takes
//! them: plain integers and pointers, so that any value an application passes is representable (no Rust
//! enums across the ABI, where an unknown value would be undefined behaviour).

use std::ffi::c_void;

use serde::{Deserialize, Serialize};

/// A CUDA driver result code (`CUresult`). `#[repr(transparent)]` over `u32`, so it crosses the C ABI as is.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, Hash, PartialEq, Serialize)]
pub struct CUresult(pub u32);

impl CUresult {
    /// True for `CUDA_SUCCESS`.
    pub fn is_success(self) -> bool {
        self.0 == 0
    }

    /// `Ok(())` for success, else `Err(self)`.
    pub fn result(self) -> Result<(), CUresult> {
        if self.is_success() { Ok(()) } else { Err(self) }
    }

    /// The symbolic name (`CUDA_ERROR_INVALID_VALUE`), or `None` for a code CUDA 13.0 does not define.
    pub fn name(self) -> Option<&'static str> {
        ERROR_NAMES
            .iter()
            .find(|(code, _)| *code == self.0)
            .map(|(_, name)| *name)
    }

    /// Whether this error leaves the context unusable: every later call returns it (CUDA's "sticky" errors).
    pub fn is_sticky(self) -> bool {
        matches!(
            self,
            Self::ILLEGAL_ADDRESS
                | Self::LAUNCH_FAILED
                | Self::ASSERT
                | Self::MISALIGNED_ADDRESS
                | Self::ILLEGAL_INSTRUCTION
                | Self::INVALID_ADDRESS_SPACE
                | Self::INVALID_PC
                | Self::HARDWARE_STACK_ERROR
                | Self::LAUNCH_TIMEOUT
        )
    }

    /// `CUDA_SUCCESS`
    pub const SUCCESS: CUresult = CUresult(0);
    /// `CUDA_ERROR_INVALID_VALUE`
    pub const INVALID_VALUE: CUresult = CUresult(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY`
    pub const OUT_OF_MEMORY: CUresult = CUresult(2);
    /// `CUDA_ERROR_NOT_INITIALIZED`
    pub const NOT_INITIALIZED: CUresult = CUresult(3);
    /// `CUDA_ERROR_DEINITIALIZED`
    pub const DEINITIALIZED: CUresult = CUresult(4);
    /// `CUDA_ERROR_PROFILER_DISABLED`
    pub const PROFILER_DISABLED: CUresult = CUresult(5);
    /// `CUDA_ERROR_PROFILER_NOT_INITIALIZED`
    pub const PROFILER_NOT_INITIALIZED: CUresult = CUresult(6);
    /// `CUDA_ERROR_PROFILER_ALREADY_STARTED`
    pub const PROFILER_ALREADY_STARTED: CUresult = CUresult(7);
    /// `CUDA_ERROR_PROFILER_ALREADY_STOPPED`
    pub const PROFILER_ALREADY_STOPPED: CUresult = CUresult(8);
    /// `CUDA_ERROR_STUB_LIBRARY`
    pub const STUB_LIBRARY: CUresult = CUresult(34);
    /// `CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER`
    pub const CALL_REQUIRES_NEWER_DRIVER: CUresult = CUresult(36);
    /// `CUDA_ERROR_DEVICE_UNAVAILABLE`
    pub const DEVICE_UNAVAILABLE: CUresult = CUresult(46);
    /// `CUDA_ERROR_NO_DEVICE`
    pub const NO_DEVICE: CUresult = CUresult(100);
    /// `CUDA_ERROR_INVALID_DEVICE`
    pub const INVALID_DEVICE: CUresult = CUresult(101);
    /// `CUDA_ERROR_DEVICE_NOT_LICENSED`
    pub const DEVICE_NOT_LICENSED: CUresult = CUresult(102);
    /// `CUDA_ERROR_INVALID_IMAGE`
    pub const INVALID_IMAGE: CUresult = CUresult(200);
    /// `CUDA_ERROR_INVALID_CONTEXT`
    pub const INVALID_CONTEXT: CUresult = CUresult(201);
    /// `CUDA_ERROR_CONTEXT_ALREADY_CURRENT`
    pub const CONTEXT_ALREADY_CURRENT: CUresult = CUresult(202);
    /// `CUDA_ERROR_MAP_FAILED`
    pub const MAP_FAILED: CUresult = CUresult(205);
    /// `CUDA_ERROR_UNMAP_FAILED`
    pub const UNMAP_FAILED: CUresult = CUresult(206);
    /// `CUDA_ERROR_ARRAY_IS_MAPPED`
    pub const ARRAY_IS_MAPPED: CUresult = CUresult(207);
    /// `CUDA_ERROR_ALREADY_MAPPED`
    pub const ALREADY_MAPPED: CUresult = CUresult(208);
    /// `CUDA_ERROR_NO_BINARY_FOR_GPU`
    pub const NO_BINARY_FOR_GPU: CUresult = CUresult(209);
    /// `CUDA_ERROR_ALREADY_ACQUIRED`
    pub const ALREADY_ACQUIRED: CUresult = CUresult(210);
    /// `CUDA_ERROR_NOT_MAPPED`
    pub const NOT_MAPPED: CUresult = CUresult(211);
    /// `CUDA_ERROR_NOT_MAPPED_AS_ARRAY`
    pub const NOT_MAPPED_AS_ARRAY: CUresult = CUresult(212);
    /// `CUDA_ERROR_NOT_MAPPED_AS_POINTER`
    pub const NOT_MAPPED_AS_POINTER: CUresult = CUresult(213);
    /// `CUDA_ERROR_ECC_UNCORRECTABLE`
    pub const ECC_UNCORRECTABLE: CUresult = CUresult(214);
    /// `CUDA_ERROR_UNSUPPORTED_LIMIT`
    pub const UNSUPPORTED_LIMIT: CUresult = CUresult(215);
    /// `CUDA_ERROR_CONTEXT_ALREADY_IN_USE`
    pub const CONTEXT_ALREADY_IN_USE: CUresult = CUresult(216);
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`
    pub const PEER_ACCESS_UNSUPPORTED: CUresult = CUresult(217);
    /// `CUDA_ERROR_INVALID_PTX`
    pub const INVALID_PTX: CUresult = CUresult(218);
    /// `CUDA_ERROR_INVALID_GRAPHICS_CONTEXT`
    pub const INVALID_GRAPHICS_CONTEXT: CUresult = CUresult(219);
    /// `CUDA_ERROR_NVLINK_UNCORRECTABLE`
    pub const NVLINK_UNCORRECTABLE: CUresult = CUresult(220);
    /// `CUDA_ERROR_JIT_COMPILER_NOT_FOUND`
    pub const JIT_COMPILER_NOT_FOUND: CUresult = CUresult(221);
    /// `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`
    pub const UNSUPPORTED_PTX_VERSION: CUresult = CUresult(222);
    /// `CUDA_ERROR_JIT_COMPILATION_DISABLED`
    pub const JIT_COMPILATION_DISABLED: CUresult = CUresult(223);
    /// `CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY`
    pub const UNSUPPORTED_EXEC_AFFINITY: CUresult = CUresult(224);
    /// `CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC`
    pub const UNSUPPORTED_DEVSIDE_SYNC: CUresult = CUresult(225);
    /// `CUDA_ERROR_CONTAINED`
    pub const CONTAINED: CUresult = CUresult(226);
    /// `CUDA_ERROR_INVALID_SOURCE`
    pub const INVALID_SOURCE: CUresult = CUresult(300);
    /// `CUDA_ERROR_FILE_NOT_FOUND`
    pub const FILE_NOT_FOUND: CUresult = CUresult(301);
    /// `CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND`
    pub const SHARED_OBJECT_SYMBOL_NOT_FOUND: CUresult = CUresult(302);
    /// `CUDA_ERROR_SHARED_OBJECT_INIT_FAILED`
    pub const SHARED_OBJECT_INIT_FAILED: CUresult = CUresult(303);
    /// `CUDA_ERROR_OPERATING_SYSTEM`
    pub const OPERATING_SYSTEM: CUresult = CUresult(304);
    /// `CUDA_ERROR_INVALID_HANDLE`
    pub const INVALID_HANDLE: CUresult = CUresult(400);
    /// `CUDA_ERROR_ILLEGAL_STATE`
    pub const ILLEGAL_STATE: CUresult = CUresult(401);
    /// `CUDA_ERROR_LOSSY_QUERY`
    pub const LOSSY_QUERY: CUresult = CUresult(402);
    /// `CUDA_ERROR_NOT_FOUND`
    pub const NOT_FOUND: CUresult = CUresult(500);
    /// `CUDA_ERROR_NOT_READY`
    pub const NOT_READY: CUresult = CUresult(600);
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`
    pub const ILLEGAL_ADDRESS: CUresult = CUresult(700);
    /// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`
    pub const LAUNCH_OUT_OF_RESOURCES: CUresult = CUresult(701);
    /// `CUDA_ERROR_LAUNCH_TIMEOUT`
    pub const LAUNCH_TIMEOUT: CUresult = CUresult(702);
    /// `CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING`
    pub const LAUNCH_INCOMPATIBLE_TEXTURING: CUresult = CUresult(703);
    /// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`
    pub const PEER_ACCESS_ALREADY_ENABLED: CUresult = CUresult(704);
    /// `CUDA_ERROR_PEER_ACCESS_NOT_ENABLED`
    pub const PEER_ACCESS_NOT_ENABLED: CUresult = CUresult(705);
    /// `CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE`
    pub const PRIMARY_CONTEXT_ACTIVE: CUresult = CUresult(708);
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED`
    pub const CONTEXT_IS_DESTROYED: CUresult = CUresult(709);
    /// `CUDA_ERROR_ASSERT`
    pub const ASSERT: CUresult = CUresult(710);
    /// `CUDA_ERROR_TOO_MANY_PEERS`
    pub const TOO_MANY_PEERS: CUresult = CUresult(711);
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`
    pub const HOST_MEMORY_ALREADY_REGISTERED: CUresult = CUresult(712);
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`
    pub const HOST_MEMORY_NOT_REGISTERED: CUresult = CUresult(713);
    /// `CUDA_ERROR_HARDWARE_STACK_ERROR`
    pub const HARDWARE_STACK_ERROR: CUresult = CUresult(714);
    /// `CUDA_ERROR_ILLEGAL_INSTRUCTION`
    pub const ILLEGAL_INSTRUCTION: CUresult = CUresult(715);
    /// `CUDA_ERROR_MISALIGNED_ADDRESS`
    pub const MISALIGNED_ADDRESS: CUresult = CUresult(716);
    /// `CUDA_ERROR_INVALID_ADDRESS_SPACE`
    pub const INVALID_ADDRESS_SPACE: CUresult = CUresult(717);
    /// `CUDA_ERROR_INVALID_PC`
    pub const INVALID_PC: CUresult = CUresult(718);
    /// `CUDA_ERROR_LAUNCH_FAILED`
    pub const LAUNCH_FAILED: CUresult = CUresult(719);
    /// `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`
    pub const COOPERATIVE_LAUNCH_TOO_LARGE: CUresult = CUresult(720);
    /// `CUDA_ERROR_TENSOR_MEMORY_LEAK`
    pub const TENSOR_MEMORY_LEAK: CUresult = CUresult(721);
    /// `CUDA_ERROR_NOT_PERMITTED`
    pub const NOT_PERMITTED: CUresult = CUresult(800);
    /// `CUDA_ERROR_NOT_SUPPORTED`
    pub const NOT_SUPPORTED: CUresult = CUresult(801);
    /// `CUDA_ERROR_SYSTEM_NOT_READY`
    pub const SYSTEM_NOT_READY: CUresult = CUresult(802);
    /// `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`
    pub const SYSTEM_DRIVER_MISMATCH: CUresult = CUresult(803);
    /// `CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE`
    pub const COMPAT_NOT_SUPPORTED_ON_DEVICE: CUresult = CUresult(804);
    /// `CUDA_ERROR_MPS_CONNECTION_FAILED`
    pub const MPS_CONNECTION_FAILED: CUresult = CUresult(805);
    /// `CUDA_ERROR_MPS_RPC_FAILURE`
    pub const MPS_RPC_FAILURE: CUresult = CUresult(806);
    /// `CUDA_ERROR_MPS_SERVER_NOT_READY`
    pub const MPS_SERVER_NOT_READY: CUresult = CUresult(807);
    /// `CUDA_ERROR_MPS_MAX_CLIENTS_REACHED`
    pub const MPS_MAX_CLIENTS_REACHED: CUresult = CUresult(808);
    /// `CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED`
    pub const MPS_MAX_CONNECTIONS_REACHED: CUresult = CUresult(809);
    /// `CUDA_ERROR_MPS_CLIENT_TERMINATED`
    pub const MPS_CLIENT_TERMINATED: CUresult = CUresult(810);
    /// `CUDA_ERROR_CDP_NOT_SUPPORTED`
    pub const CDP_NOT_SUPPORTED: CUresult = CUresult(811);
    /// `CUDA_ERROR_CDP_VERSION_MISMATCH`
    pub const CDP_VERSION_MISMATCH: CUresult = CUresult(812);
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`
    pub const STREAM_CAPTURE_UNSUPPORTED: CUresult = CUresult(900);
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`
    pub const STREAM_CAPTURE_INVALIDATED: CUresult = CUresult(901);
    /// `CUDA_ERROR_STREAM_CAPTURE_MERGE`
    pub const STREAM_CAPTURE_MERGE: CUresult = CUresult(902);
    /// `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED`
    pub const STREAM_CAPTURE_UNMATCHED: CUresult = CUresult(903);
    /// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`
    pub const STREAM_CAPTURE_UNJOINED: CUresult = CUresult(904);
    /// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`
    pub const STREAM_CAPTURE_ISOLATION: CUresult = CUresult(905);
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`
    pub const STREAM_CAPTURE_IMPLICIT: CUresult = CUresult(906);
    /// `CUDA_ERROR_CAPTURED_EVENT`
    pub const CAPTURED_EVENT: CUresult = CUresult(907);
    /// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`
    pub const STREAM_CAPTURE_WRONG_THREAD: CUresult = CUresult(908);
    /// `CUDA_ERROR_TIMEOUT`
    pub const TIMEOUT: CUresult = CUresult(909);
    /// `CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE`
    pub const GRAPH_EXEC_UPDATE_FAILURE: CUresult = CUresult(910);
    /// `CUDA_ERROR_EXTERNAL_DEVICE`
    pub const EXTERNAL_DEVICE: CUresult = CUresult(911);
    /// `CUDA_ERROR_INVALID_CLUSTER_SIZE`
    pub const INVALID_CLUSTER_SIZE: CUresult = CUresult(912);
    /// `CUDA_ERROR_FUNCTION_NOT_LOADED`
    pub const FUNCTION_NOT_LOADED: CUresult = CUresult(913);
    /// `CUDA_ERROR_INVALID_RESOURCE_TYPE`
    pub const INVALID_RESOURCE_TYPE: CUresult = CUresult(914);
    /// `CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION`
    pub const INVALID_RESOURCE_CONFIGURATION: CUresult = CUresult(915);
    /// `CUDA_ERROR_KEY_ROTATION`
    pub const KEY_ROTATION: CUresult = CUresult(916);
    /// `CUDA_ERROR_UNKNOWN`
    pub const UNKNOWN: CUresult = CUresult(999);
}

impl std::fmt::Display for CUresult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "CUresult {}", self.0),
        }
    }
}

impl std::error::Error for CUresult {}

/// Every `CUresult` of CUDA 13.0 with its symbolic name (cuGetErrorName answers from this table).
pub const ERROR_NAMES: &[(u32, &str)] = &[
    (0, "CUDA_SUCCESS"),
    (1, "CUDA_ERROR_INVALID_VALUE"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "CUDA_ERROR_NOT_INITIALIZED"),
    (4, "CUDA_ERROR_DEINITIALIZED"),
    (5, "CUDA_ERROR_PROFILER_DISABLED"),
    (6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED"),
    (7, "CUDA_ERROR_PROFILER_ALREADY_STARTED"),
    (8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED"),
    (34, "CUDA_ERROR_STUB_LIBRARY"),
    (36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"),
    (46, "CUDA_ERROR_DEVICE_UNAVAILABLE"),
    (100, "CUDA_ERROR_NO_DEVICE"),
    (101, "CUDA_ERROR_INVALID_DEVICE"),
    (102, "CUDA_ERROR_DEVICE_NOT_LICENSED"),
    (200, "CUDA_ERROR_INVALID_IMAGE"),
    (201, "CUDA_ERROR_INVALID_CONTEXT"),
    (202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT"),
    (205, "CUDA_ERROR_MAP_FAILED"),
    (206, "CUDA_ERROR_UNMAP_FAILED"),
    (207, "CUDA_ERROR_ARRAY_IS_MAPPED"),
    (208, "CUDA_ERROR_ALREADY_MAPPED"),
    (209, "CUDA_ERROR_NO_BINARY_FOR_GPU"),
    (210, "CUDA_ERROR_ALREADY_ACQUIRED"),
    (211, "CUDA_ERROR_NOT_MAPPED"),
    (212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY"),
    (213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER"),
    (214, "CUDA_ERROR_ECC_UNCORRECTABLE"),
    (215, "CUDA_ERROR_UNSUPPORTED_LIMIT"),
    (216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE"),
    (217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"),
    (218, "CUDA_ERROR_INVALID_PTX"),
    (219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT"),
    (220, "CUDA_ERROR_NVLINK_UNCORRECTABLE"),
    (221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"),
    (222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
    (223, "CUDA_ERROR_JIT_COMPILATION_DISABLED"),
    (224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY"),
    (225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC"),
    (226, "CUDA_ERROR_CONTAINED"),
    (300, "CUDA_ERROR_INVALID_SOURCE"),
    (301, "CUDA_ERROR_FILE_NOT_FOUND"),
    (302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND"),
    (303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED"),
    (304, "CUDA_ERROR_OPERATING_SYSTEM"),
    (400, "CUDA_ERROR_INVALID_HANDLE"),
    (401, "CUDA_ERROR_ILLEGAL_STATE"),
    (402, "CUDA_ERROR_LOSSY_QUERY"),
    (500, "CUDA_ERROR_NOT_FOUND"),
    (600, "CUDA_ERROR_NOT_READY"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    (701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
    (702, "CUDA_ERROR_LAUNCH_TIMEOUT"),
    (703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING"),
    (704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"),
    (705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"),
    (708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE"),
    (709, "CUDA_ERROR_CONTEXT_IS_DESTROYED"),
    (710, "CUDA_ERROR_ASSERT"),
    (711, "CUDA_ERROR_TOO_MANY_PEERS"),
    (712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"),
    (713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"),
    (714, "CUDA_ERROR_HARDWARE_STACK_ERROR"),
    (715, "CUDA_ERROR_ILLEGAL_INSTRUCTION"),
    (716, "CUDA_ERROR_MISALIGNED_ADDRESS"),
    (717, "CUDA_ERROR_INVALID_ADDRESS_SPACE"),
    (718, "CUDA_ERROR_INVALID_PC"),
    (719, "CUDA_ERROR_LAUNCH_FAILED"),
    (720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"),
    (721, "CUDA_ERROR_TENSOR_MEMORY_LEAK"),
    (800, "CUDA_ERROR_NOT_PERMITTED"),
    (801, "CUDA_ERROR_NOT_SUPPORTED"),
    (802, "CUDA_ERROR_SYSTEM_NOT_READY"),
    (803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    (804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"),
    (805, "CUDA_ERROR_MPS_CONNECTION_FAILED"),
    (806, "CUDA_ERROR_MPS_RPC_FAILURE"),
    (807, "CUDA_ERROR_MPS_SERVER_NOT_READY"),
    (808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED"),
    (809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED"),
    (810, "CUDA_ERROR_MPS_CLIENT_TERMINATED"),
    (811, "CUDA_ERROR_CDP_NOT_SUPPORTED"),
    (812, "CUDA_ERROR_CDP_VERSION_MISMATCH"),
    (900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
    (901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    (902, "CUDA_ERROR_STREAM_CAPTURE_MERGE"),
    (903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"),
    (904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"),
    (905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"),
    (906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"),
    (907, "CUDA_ERROR_CAPTURED_EVENT"),
    (908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"),
    (909, "CUDA_ERROR_TIMEOUT"),
    (910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"),
    (911, "CUDA_ERROR_EXTERNAL_DEVICE"),
    (912, "CUDA_ERROR_INVALID_CLUSTER_SIZE"),
    (913, "CUDA_ERROR_FUNCTION_NOT_LOADED"),
    (914, "CUDA_ERROR_INVALID_RESOURCE_TYPE"),
    (915, "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"),
    (916, "CUDA_ERROR_KEY_ROTATION"),
    (999, "CUDA_ERROR_UNKNOWN"),
];

/// `CUdevice`: an ordinal.
pub type CUdevice = i32;
/// `CUdeviceptr`: a device address, identical on client and server.
pub type CUdeviceptr = u64;
/// Opaque handles: pointers in C, carried on the wire as their `u64` value (identity on both sides).
pub type CUcontext = *mut c_void;
/// See [`CUcontext`].
pub type CUmodule = *mut c_void;
/// See [`CUcontext`].
pub type CUfunction = *mut c_void;
/// See [`CUcontext`].
pub type CUstream = *mut c_void;
/// See [`CUcontext`].
pub type CUevent = *mut c_void;
/// See [`CUcontext`].
pub type CUlibrary = *mut c_void;
/// See [`CUcontext`].
pub type CUkernel = *mut c_void;

/// Opaque driver handles that Gleam passes through unchanged (identity on both sides of a session).
macro_rules! opaque_handles {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        pub type $name = *mut c_void;
    )*};
}

opaque_handles! {
    /// `CUarray`.
    CUarray;
    /// `CUmipmappedArray`.
    CUmipmappedArray;
    /// `CUtexref` (legacy texture reference).
    CUtexref;
    /// `CUsurfref` (legacy surface reference).
    CUsurfref;
    /// `CUgraph`.
    CUgraph;
    /// `CUgraphNode`.
    CUgraphNode;
    /// `CUgraphExec`.
    CUgraphExec;
    /// `CUmemoryPool`.
    CUmemoryPool;
    /// `CUuserObject`.
    CUuserObject;
    /// `CUgraphicsResource`.
    CUgraphicsResource;
    /// `CUexternalMemory`.
    CUexternalMemory;
    /// `CUexternalSemaphore`.
    CUexternalSemaphore;
    /// `CUlinkState`.
    CUlinkState;
    /// `CUgreenCtx`.
    CUgreenCtx;
    /// `CUdevResourceDesc`.
    CUdevResourceDesc;
    /// `CUeglStreamConnection`.
    CUeglStreamConnection;
    /// `CUlogsCallbackHandle`.
    CUlogsCallbackHandle;
}

/// `CUmemLocation`: where memory lives (a type and an id), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUmemLocation {
    /// `CUmemLocationType`.
    pub kind: u32,
    /// Device ordinal, host NUMA node... depending on `kind`.
    pub id: i32,
}

/// A C struct that travels in a request or reply as itself. Its pointer fields (Windows-only handles and
/// security attributes, meaningless across a network) are kept as integers of the same size and cleared
/// before they travel and again when they arrive, so a value from the network never names memory.
pub trait WireStruct: Copy {
    /// The struct with every pointer field zeroed.
    #[must_use]
    fn cleared(self) -> Self;
}

impl WireStruct for CUmemLocation {
    fn cleared(self) -> Self {
        self
    }
}

/// `CUmemLocationType` values used by Gleam.
pub const CU_MEM_LOCATION_TYPE_DEVICE: u32 = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: u32 = 1;

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUmemAllocationFlags {
    /// `CUmemAllocationCompType`.
    pub compression_type: u8,
    /// Whether the allocation may be used with GPUDirect RDMA.
    pub gpu_direct_rdma_capable: u8,
    /// `CU_MEM_CREATE_USAGE_*` bits.
    pub usage: u16,
    /// Must be zero.
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp` (`cuMemCreate`, `cuMemGetAllocationGranularity`): 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUmemAllocationProp {
    /// `CUmemAllocationType`.
    pub kind: u32,
    /// `CUmemAllocationHandleType` bits the allocation may be exported as.
    pub requested_handle_types: u32,
    /// Where the memory lives.
    pub location: CUmemLocation,
    /// `void *win32HandleMetaData` (Windows only): cleared.
    pub win32_handle_meta_data: u64,
    /// Compression, RDMA and usage flags.
    pub alloc_flags: CUmemAllocationFlags,
}

impl WireStruct for CUmemAllocationProp {
    fn cleared(self) -> Self {
        Self {
            win32_handle_meta_data: 0,
            ..self
        }
    }
}

/// `CUmemPoolProps` (`cuMemPoolCreate`): 88 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUmemPoolProps {
    /// `CUmemAllocationType` of the pool's allocations.
    pub alloc_type: u32,
    /// `CUmemAllocationHandleType` bits the pool's allocations may be exported as.
    pub handle_types: u32,
    /// Where the pool's memory lives.
    pub location: CUmemLocation,
    /// `void *win32SecurityAttributes` (Windows only): cleared.
    pub win32_security_attributes: u64,
    /// Most bytes the pool may hold (0: no limit but the device's).
    pub max_size: u64,
    /// `CU_MEM_POOL_CREATE_USAGE_*` bits.
    pub usage: u16,
    /// `reserved[54]`, which must be zero (two arrays so serde can carry them).
    pub reserved_head: [u8; 32],
    /// The rest of `reserved`.
    pub reserved_tail: [u8; 22],
}

impl WireStruct for CUmemPoolProps {
    fn cleared(self) -> Self {
        Self {
            win32_security_attributes: 0,
            ..self
        }
    }
}

/// `CUmemAccessDesc` (`cuMemSetAccess`, `cuMemPoolSetAccess`): 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUmemAccessDesc {
    /// Whose access.
    pub location: CUmemLocation,
    /// `CUmemAccess_flags`: 0 none, 1 read, 3 read and write.
    pub flags: u32,
}

impl WireStruct for CUmemAccessDesc {
    fn cleared(self) -> Self {
        self
    }
}

/// `CUexecAffinityParam` (`cuCtxCreate_v3`): a type and, for the only type (SM count), a count. 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUexecAffinityParam {
    /// `CUexecAffinityType` (0 = SM count).
    pub kind: u32,
    /// The union's only member: `smCount.val`.
    pub value: u32,
}

impl WireStruct for CUexecAffinityParam {
    fn cleared(self) -> Self {
        self
    }
}

/// `CUctxCreateParams` (`cuCtxCreate_v4`): read by the shim, never sent as is (its members are pointers).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUctxCreateParams {
    /// `CUexecAffinityParam *execAffinityParams`.
    pub exec_affinity_params: *mut CUexecAffinityParam,
    /// How many.
    pub num_exec_affinity_params: i32,
    /// `CUctxCigParam *cigParams` (CUDA in graphics: a shared graphics context).
    pub cig_params: *mut c_void,
}

// The C layouts of CUDA 13.0's cuda.h.
const _: () = {
    assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
    assert!(std::mem::size_of::<CUmemPoolProps>() == 88);
    assert!(std::mem::size_of::<CUmemAccessDesc>() == 12);
    assert!(std::mem::size_of::<CUexecAffinityParam>() == 8);
    assert!(std::mem::size_of::<CUctxCreateParams>() == 24);
};

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUipcMemHandle {
    /// The driver's bytes.
    pub reserved: [u8; 64],
}

/// `CUipcEventHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUipcEventHandle {
    /// The driver's bytes.
    pub reserved: [u8; 64],
}

/// `CUeglFrame`, passed by value to `cuEGLStreamProducerPresentFrame` (EGL interop is not offered across
/// a network; only its size and alignment matter here).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug)]
pub struct CUeglFrame {
    /// The driver's bytes.
    pub bytes: [u8; 64],
}

/// The legacy default stream handle (`CU_STREAM_LEGACY`).
pub const CU_STREAM_LEGACY: u64 = 0x1;
/// The per-thread default stream handle (`CU_STREAM_PER_THREAD`).
pub const CU_STREAM_PER_THREAD: u64 = 0x2;
/// `cuLaunchKernel`'s `extra`: end of list.
pub const CU_LAUNCH_PARAM_END: usize = 0x0;
/// `cuLaunchKernel`'s `extra`: a pointer to the packed parameter buffer follows.
pub const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 0x1;
/// `cuLaunchKernel`'s `extra`: a pointer to the buffer's `size_t` size follows.
pub const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 0x2;
