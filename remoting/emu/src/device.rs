//! What the emulated device says about itself: attributes (`cuDeviceGetAttribute`), identity, limits, and
//! the occupancy model. It presents itself as a compute capability 7.5 device (so nvcc's default `sm_75`
//! PTX is accepted) with the limits of that architecture, and the host's CPU count as its multiprocessors
//! (blocks run in parallel on that many threads). Memory pools and virtual memory management are
//! emulated; features it does not emulate (cooperative launches, clusters, exporting memory to other
//! processes...) are reported as absent. Managed memory and mapped host memory are device memory here
//! (the client mirrors them); textures and surfaces have sm_75's size limits ([`limits`]).

/// `cuDeviceGetName`.
pub const NAME: &str = "Gleam Emulator (PTX interpreter)";
/// `cuDeviceGetUuid_v2`: stable across runs and hosts.
pub const UUID: [u8; 16] = *b"GleamEmuPTX\x00\x07\x05\x00\x01";
/// `cuDeviceGetPCIBusId`.
pub const PCI_BUS_ID: &str = "0000:00:00.0";
/// `cuDriverGetVersion`.
pub const DRIVER_VERSION: i32 = 13000;
/// Compute capability.
pub const CC: (i32, i32) = (7, 5);
/// One past the last `CUdevice_attribute` id of CUDA 13.0 (`CU_DEVICE_ATTRIBUTE_MAX`).
pub const DEVICE_ATTRIBUTE_END: usize = 144;
/// One past the last `CUfunction_attribute` id of CUDA 13.0 (`CU_FUNC_ATTRIBUTE_MAX`).
pub const FUNC_ATTRIBUTE_END: usize = 17;

/// Device limits of sm_75 that launches and the occupancy model use.
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;
pub const MAX_BLOCK_DIM: [u32; 3] = [1024, 1024, 64];
pub const MAX_GRID_DIM: [u32; 3] = [0x7fff_ffff, 65535, 65535];
pub const SHARED_PER_BLOCK: u32 = 48 << 10;
pub const SHARED_PER_BLOCK_OPTIN: u32 = 64 << 10;
pub const SHARED_PER_SM: u32 = 64 << 10;
pub const REGS_PER_SM: u32 = 65536;
pub const MAX_THREADS_PER_SM: u32 = 1024;
pub const MAX_BLOCKS_PER_SM: u32 = 16;
pub const WARP_SIZE: u32 = 32;
pub const CONST_BYTES: u32 = 64 << 10;
/// Local memory per thread ptxas accepts.
pub const LOCAL_PER_THREAD: u32 = 512 << 10;
/// `cuCtxGetStreamPriorityRange`: (least, greatest).
pub const STREAM_PRIORITIES: (i32, i32) = (0, -5);

/// Texture, surface and array size limits of sm_75 (in elements), and alignments.
pub mod limits {
    pub const TEXTURE_1D: u64 = 131_072;
    pub const TEXTURE_2D_WIDTH: u64 = 131_072;
    pub const TEXTURE_2D_HEIGHT: u64 = 65_536;
    pub const TEXTURE_3D: u64 = 16_384;
    pub const TEXTURE_1D_LAYERED: u64 = 32_768;
    pub const TEXTURE_2D_LAYERED: u64 = 32_768;
    pub const LAYERS: u64 = 2_048;
    pub const TEXTURE_2D_GATHER: u64 = 32_768;
    pub const TEXTURE_CUBEMAP: u64 = 32_768;
    pub const LAYERS_CUBEMAP: u64 = 2_046;
    pub const TEXTURE_1D_LINEAR: u64 = 1 << 28;
    pub const TEXTURE_2D_LINEAR_WIDTH: u64 = 131_072;
    pub const TEXTURE_2D_LINEAR_HEIGHT: u64 = 65_000;
    pub const TEXTURE_2D_LINEAR_PITCH: u64 = 2_097_120;
    pub const SURFACE_1D: u64 = 32_768;
    pub const SURFACE_2D_WIDTH: u64 = 131_072;
    pub const SURFACE_2D_HEIGHT: u64 = 65_536;
    pub const SURFACE_3D: u64 = 16_384;
    pub const SURFACE_2D_LAYERED: u64 = 32_768;
    pub const SURFACE_CUBEMAP: u64 = 32_768;
    /// `CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT`: linear and pitched texture memory starts on it.
    pub const TEXTURE_ALIGNMENT: u64 = 512;
    /// `CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT`: pitched texture rows are multiples of it.
    pub const TEXTURE_PITCH_ALIGNMENT: u64 = 32;
}

/// `CU_FUNC_ATTRIBUTE_*` ids used here.
pub mod func_attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 0;
    pub const SHARED_SIZE_BYTES: i32 = 1;
    pub const CONST_SIZE_BYTES: i32 = 2;
    pub const LOCAL_SIZE_BYTES: i32 = 3;
    pub const NUM_REGS: i32 = 4;
    pub const PTX_VERSION: i32 = 5;
    pub const BINARY_VERSION: i32 = 6;
    pub const CACHE_MODE_CA: i32 = 7;
    pub const MAX_DYNAMIC_SHARED_SIZE_BYTES: i32 = 8;
    pub const PREFERRED_SHARED_MEMORY_CARVEOUT: i32 = 9;
}

/// Multiprocessors reported: the host's parallelism, which is how many blocks run at once.
pub fn multiprocessors() -> i32 {
    std::thread::available_parallelism()
        .map(|n| n.get().clamp(1, 256) as i32)
        .unwrap_or(1)
}

/// The attribute vector of [`gleam_protocol::wire::DeviceInfo`]: index = attribute id, 0 unused.
pub fn attributes() -> Vec<i32> {
    let mut a = vec![0i32; DEVICE_ATTRIBUTE_END];
    let mut set = |id: usize, v: i32| a[id] = v;
    set(1, MAX_THREADS_PER_BLOCK as i32);
    set(2, MAX_BLOCK_DIM[0] as i32);
    set(3, MAX_BLOCK_DIM[1] as i32);
    set(4, MAX_BLOCK_DIM[2] as i32);
    set(5, MAX_GRID_DIM[0] as i32);
    set(6, MAX_GRID_DIM[1] as i32);
    set(7, MAX_GRID_DIM[2] as i32);
    set(8, SHARED_PER_BLOCK as i32);
    set(9, CONST_BYTES as i32);
    set(10, WARP_SIZE as i32);
    set(11, i32::MAX); // MAX_PITCH
    set(12, REGS_PER_SM as i32); // MAX_REGISTERS_PER_BLOCK
    set(13, 1_590_000); // CLOCK_RATE, kHz
    set(14, 512); // TEXTURE_ALIGNMENT
    set(15, 1); // GPU_OVERLAP
    set(16, multiprocessors());
    set(17, 0); // KERNEL_EXEC_TIMEOUT: set by the backend from its watchdog
    set(18, 0); // INTEGRATED
    set(19, 1); // CAN_MAP_HOST_MEMORY: host allocations are device memory, mirrored by the client
    set(20, 0); // COMPUTE_MODE: default
    // Texture and surface limits (in elements).
    let lim = |v: u64| v as i32;
    set(21, lim(limits::TEXTURE_1D));
    set(22, lim(limits::TEXTURE_2D_WIDTH));
    set(23, lim(limits::TEXTURE_2D_HEIGHT));
    set(24, lim(limits::TEXTURE_3D));
    set(25, lim(limits::TEXTURE_3D));
    set(26, lim(limits::TEXTURE_3D));
    set(27, lim(limits::TEXTURE_2D_LAYERED));
    set(28, lim(limits::TEXTURE_2D_LAYERED));
    set(29, lim(limits::LAYERS));
    set(42, lim(limits::TEXTURE_1D_LAYERED));
    set(43, lim(limits::LAYERS));
    set(45, lim(limits::TEXTURE_2D_GATHER));
    set(46, lim(limits::TEXTURE_2D_GATHER));
    set(52, lim(limits::TEXTURE_CUBEMAP));
    set(53, lim(limits::TEXTURE_CUBEMAP));
    set(54, lim(limits::LAYERS_CUBEMAP));
    set(55, lim(limits::SURFACE_1D));
    set(56, lim(limits::SURFACE_2D_WIDTH));
    set(57, lim(limits::SURFACE_2D_HEIGHT));
    set(58, lim(limits::SURFACE_3D));
    set(59, lim(limits::SURFACE_3D));
    set(60, lim(limits::SURFACE_3D));
    set(61, lim(limits::SURFACE_1D));
    set(62, lim(limits::LAYERS));
    set(63, lim(limits::SURFACE_2D_LAYERED));
    set(64, lim(limits::SURFACE_2D_LAYERED));
    set(65, lim(limits::LAYERS));
    set(66, lim(limits::SURFACE_CUBEMAP));
    set(67, lim(limits::SURFACE_CUBEMAP));
    set(68, lim(limits::LAYERS_CUBEMAP));
    set(69, lim(limits::TEXTURE_1D_LINEAR));
    set(70, lim(limits::TEXTURE_2D_LINEAR_WIDTH));
    set(71, lim(limits::TEXTURE_2D_LINEAR_HEIGHT));
    set(72, lim(limits::TEXTURE_2D_LINEAR_PITCH));
    set(30, 512); // SURFACE_ALIGNMENT
    set(31, 1); // CONCURRENT_KERNELS
    set(32, 0); // ECC_ENABLED
    set(33, 0); // PCI_BUS_ID
    set(34, 0); // PCI_DEVICE_ID
    set(35, 0); // TCC_DRIVER
    set(36, 5_001_000); // MEMORY_CLOCK_RATE, kHz
    set(37, 256); // GLOBAL_MEMORY_BUS_WIDTH
    set(38, 4 << 20); // L2_CACHE_SIZE
    set(39, MAX_THREADS_PER_SM as i32);
    set(40, 2); // ASYNC_ENGINE_COUNT
    set(41, 1); // UNIFIED_ADDRESSING
    set(50, 0); // PCI_DOMAIN_ID
    set(51, 32); // TEXTURE_PITCH_ALIGNMENT
    set(75, CC.0);
    set(76, CC.1);
    set(78, 1); // STREAM_PRIORITIES_SUPPORTED
    set(79, 1); // GLOBAL_L1_CACHE_SUPPORTED
    set(80, 1); // LOCAL_L1_CACHE_SUPPORTED
    set(81, SHARED_PER_SM as i32);
    set(82, REGS_PER_SM as i32);
    set(83, 1); // MANAGED_MEMORY: device memory here; the client mirrors it
    set(84, 0); // MULTI_GPU_BOARD
    set(87, 32); // SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO
    set(89, 1); // CONCURRENT_MANAGED_ACCESS: kernels and mirror reads and writes may overlap
    set(91, 0); // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: registered memory has its own device address
    set(95, 0); // COOPERATIVE_LAUNCH: not emulated
    set(97, SHARED_PER_BLOCK_OPTIN as i32);
    set(99, 1); // HOST_REGISTER_SUPPORTED (the client mirrors registered memory in a host allocation)
    set(102, 1); // VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
    set(103, 0); // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: nothing is exported to other processes
    set(106, MAX_BLOCKS_PER_SM as i32);
    set(111, 0); // RESERVED_SHARED_MEMORY_PER_BLOCK
    set(115, 1); // MEMORY_POOLS_SUPPORTED
    set(119, 0); // MEMPOOL_SUPPORTED_HANDLE_TYPES: none (pools are not shared with other processes)
    set(120, 0); // CLUSTER_LAUNCH
    set(126, 1); // MEM_SYNC_DOMAIN_COUNT
    set(131, -1); // NUMA_ID
    set(134, -1); // HOST_NUMA_ID
    a
}

/// What the occupancy model needs of a function.
#[derive(Clone, Copy, Debug)]
pub struct Resources {
    pub max_threads: u32,
    pub regs: u32,
    pub static_shared: u32,
    pub max_dynamic_shared: u32,
}

/// `cuOccupancyMaxActiveBlocksPerMultiprocessor`: the usual model of sm_75's per-SM limits (threads,
/// blocks, registers allocated per warp in 256-register units, shared memory in 256-byte units).
pub fn max_active_blocks(f: &Resources, block_size: u32, dynamic_shared: u64) -> u32 {
    if block_size == 0
        || block_size > f.max_threads
        || dynamic_shared > u64::from(f.max_dynamic_shared)
    {
        return 0;
    }
    let warps = block_size.div_ceil(WARP_SIZE);
    let by_threads = MAX_THREADS_PER_SM / (warps * WARP_SIZE);
    let regs_per_warp = (f.regs.clamp(1, 255) * WARP_SIZE).next_multiple_of(256);
    let by_regs = REGS_PER_SM / (regs_per_warp * warps);
    let shared = u64::from(f.static_shared) + dynamic_shared;
    let by_shared = if shared == 0 {
        MAX_BLOCKS_PER_SM
    } else {
        (u64::from(SHARED_PER_SM) / shared.next_multiple_of(256)) as u32
    };
    MAX_BLOCKS_PER_SM
        .min(by_threads)
        .min(by_regs)
        .min(by_shared)
}

/// `cuOccupancyAvailableDynamicSMemPerBlock`: dynamic shared memory per block that still lets `blocks`
/// blocks of `block_size` threads reside on one SM.
pub fn available_dynamic_shared(f: &Resources, blocks: u32, block_size: u32) -> u64 {
    if blocks == 0 || max_active_blocks(f, block_size, 0) < blocks {
        return 0;
    }
    let per_block = (SHARED_PER_SM / blocks) / 256 * 256;
    u64::from(
        per_block
            .min(SHARED_PER_BLOCK_OPTIN)
            .saturating_sub(f.static_shared),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_vector_uses_real_ids() {
        let a = attributes();
        assert_eq!(a.len(), DEVICE_ATTRIBUTE_END);
        assert_eq!((a[1], a[10], a[75], a[76]), (1024, 32, 7, 5));
        // Mapped host memory, unified addressing, VMM, memory pools; managed memory, concurrent access.
        assert_eq!((a[19], a[41], a[102], a[115]), (1, 1, 1, 1));
        assert_eq!((a[83], a[89], a[91]), (1, 1, 0));
        // 2D texture limits and texture alignment.
        assert_eq!((a[22], a[23], a[14]), (131_072, 65_536, 512));
    }

    #[test]
    fn occupancy_follows_the_limits() {
        let f = Resources {
            max_threads: 1024,
            regs: 32,
            static_shared: 0,
            max_dynamic_shared: SHARED_PER_BLOCK,
        };
        assert_eq!(max_active_blocks(&f, 256, 0), 4);
        assert_eq!(max_active_blocks(&f, 32, 0), 16);
        assert_eq!(max_active_blocks(&f, 256, 32 << 10), 2);
        assert_eq!(max_active_blocks(&f, 2048, 0), 0);
        assert_eq!(available_dynamic_shared(&f, 2, 256), 32 << 10);
    }
}
