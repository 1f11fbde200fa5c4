//! Memory pools: stream-ordered allocation (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`,
//! `cuMemFreeAsync`) and the `cuMemPool*` calls.
//!
//! A pool hands out device memory and keeps what is freed to it for later allocations of the same size
//! class (its *reserved* memory is what it holds: in use plus kept). Memory freed in stream order returns
//! to the pool when the free is reached on its stream, so a later allocation can only be given memory
//! whose previous user has finished, whatever stream it runs on. At each synchronisation of the host with
//! the device (stream, event or context), a pool gives kept memory back until it holds no more than its
//! release threshold (0 by default: everything), and `cuMemPoolTrimTo` does the same on demand; both only
//! ever release memory no allocation uses. Statistics follow CUDA's attributes (`RESERVED_MEM_*`,
//! `USED_MEM_*`, their high-water marks, resettable to 0).

use std::collections::{BTreeMap, HashMap, HashSet};

use gleam_protocol::types::{
    CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CUmemLocation, CUmemPoolProps,
    CUresult,
};

use crate::memory::{ALLOC_ALIGN, DeviceMemory};

/// Handles of pools start here (the default pool is the first).
const POOL_HANDLE_BASE: u64 = 0x0900_0000_0000;
/// Pools one session may hold (each is small; this bounds what a client can make us keep).
pub const MAX_POOLS: usize = 4096;
/// Allocations are rounded up to this size class, so freed blocks fit later requests of similar size.
const SIZE_CLASS: u64 = 512;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: accepted as a declaration (exporting is refused later).
const HANDLE_TYPE_POSIX_FD: u32 = 1;

/// `CUmemPool_attribute` values of CUDA 13.0.
mod attr {
    pub const REUSE_FOLLOW_EVENT_DEPENDENCIES: u32 = 1;
    pub const REUSE_ALLOW_OPPORTUNISTIC: u32 = 2;
    pub const REUSE_ALLOW_INTERNAL_DEPENDENCIES: u32 = 3;
    pub const RELEASE_THRESHOLD: u32 = 4;
    pub const RESERVED_MEM_CURRENT: u32 = 5;
    pub const RESERVED_MEM_HIGH: u32 = 6;
    pub const USED_MEM_CURRENT: u32 = 7;
    pub const USED_MEM_HIGH: u32 = 8;
}

/// Whether attribute `attr` is a C `int` (4 bytes) rather than a `cuuint64_t`.
pub fn attribute_is_int(attr: u32) -> bool {
    matches!(
        attr,
        attr::REUSE_FOLLOW_EVENT_DEPENDENCIES
            | attr::REUSE_ALLOW_OPPORTUNISTIC
            | attr::REUSE_ALLOW_INTERNAL_DEPENDENCIES
    )
}

/// One pool.
#[derive(Debug)]
struct Pool {
    props: CUmemPoolProps,
    release_threshold: u64,
    /// The three `REUSE_*` policies (all on by default). The emu reuses memory only once its free has
    /// run, which every policy allows, so they are kept and reported only.
    reuse: [bool; 3],
    /// Outstanding allocations: address -> bytes (its size class).
    live: HashMap<u64, u64>,
    /// Freed blocks kept for reuse: size class -> addresses.
    kept: BTreeMap<u64, Vec<u64>>,
    kept_bytes: u64,
    used: u64,
    used_high: u64,
    reserved_high: u64,
    /// Destroyed while allocations were outstanding: they are freed as they come back.
    destroyed: bool,
}

impl Pool {
    fn new(props: CUmemPoolProps) -> Self {
        Self {
            props,
            release_threshold: 0,
            reuse: [true; 3],
            live: HashMap::new(),
            kept: BTreeMap::new(),
            kept_bytes: 0,
            used: 0,
            used_high: 0,
            reserved_high: 0,
            destroyed: false,
        }
    }

    fn reserved(&self) -> u64 {
        self.used + self.kept_bytes
    }

    /// Gives kept blocks back to the device until the pool holds at most `keep` bytes.
    fn release_down_to(&mut self, mem: &DeviceMemory, keep: u64) {
        while self.reserved() > keep {
            let Some(mut entry) = self.kept.last_entry() else {
                break;
            };
            let class = *entry.key();
            let addr = entry.get_mut().pop();
            if entry.get().is_empty() {
                entry.remove();
            }
            if let Some(addr) = addr {
                let _ = mem.free(addr);
                self.kept_bytes -= class;
            }
        }
    }
}

/// The device's pools.
#[derive(Debug)]
pub struct Pools {
    pools: HashMap<u64, Pool>,
    default: u64,
    current: u64,
    next: u64,
    /// Which pool each outstanding allocation came from.
    owner: HashMap<u64, u64>,
    /// Allocations whose stream-ordered free is queued but not reached yet.
    freeing: HashSet<u64>,
}

impl Default for Pools {
    fn default() -> Self {
        Self::new()
    }
}

impl Pools {
    /// Device 0's pools: its default pool, current.
    pub fn new() -> Self {
        let default = POOL_HANDLE_BASE | 0x10;
        let props = CUmemPoolProps {
            alloc_type: CU_MEM_ALLOCATION_TYPE_PINNED,
            location: CUmemLocation {
                kind: CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            },
            ..CUmemPoolProps::default()
        };
        Self {
            pools: HashMap::from([(default, Pool::new(props))]),
            default,
            current: default,
            next: 1,
            owner: HashMap::new(),
            freeing: HashSet::new(),
        }
    }

    /// `cuDeviceGetDefaultMemPool`.
    pub fn default_pool(&self) -> u64 {
        self.default
    }

    /// `cuDeviceGetMemPool`.
    pub fn current(&self) -> u64 {
        self.current
    }

    /// `cuDeviceSetMemPool`.
    pub fn set_current(&mut self, pool: u64) -> Result<(), CUresult> {
        self.live_pool(pool)?;
        self.current = pool;
        Ok(())
    }

    fn live_pool(&self, pool: u64) -> Result<&Pool, CUresult> {
        self.pools
            .get(&pool)
            .filter(|p| !p.destroyed)
            .ok_or(CUresult::INVALID_VALUE)
    }

    fn live_pool_mut(&mut self, pool: u64) -> Result<&mut Pool, CUresult> {
        self.pools
            .get_mut(&pool)
            .filter(|p| !p.destroyed)
            .ok_or(CUresult::INVALID_VALUE)
    }

    /// `cuMemPoolCreate`: device-0 pools of device memory.
    pub fn create(&mut self, props: CUmemPoolProps) -> Result<u64, CUresult> {
        if props.alloc_type != CU_MEM_ALLOCATION_TYPE_PINNED
            || props.handle_types & !HANDLE_TYPE_POSIX_FD != 0
            || props.reserved_head.iter().any(|&b| b != 0)
            || props.reserved_tail.iter().any(|&b| b != 0)
        {
            return Err(CUresult::INVALID_VALUE);
        }
        check_location(&props.location)?;
        if self.pools.len() >= MAX_POOLS {
            tracing::warn!("a session asked for more than {MAX_POOLS} memory pools: refused");
            return Err(CUresult::OUT_OF_MEMORY);
        }
        self.next += 1;
        let handle = POOL_HANDLE_BASE | (self.next << 4);
        self.pools.insert(handle, Pool::new(props));
        Ok(handle)
    }

    /// `cuMemPoolDestroy`: the default pool cannot be; memory still allocated from the pool is freed
    /// when it is freed by the application.
    pub fn destroy(&mut self, pool: u64, mem: &DeviceMemory) -> Result<(), CUresult> {
        if pool == self.default {
            return Err(CUresult::INVALID_VALUE);
        }
        let p = self.live_pool_mut(pool)?;
        p.release_down_to(mem, 0);
        p.destroyed = true;
        if p.live.is_empty() {
            self.pools.remove(&pool);
        }
        if self.current == pool {
            self.current = self.default;
        }
        Ok(())
    }

    /// Allocates `size` bytes from `pool` (0: the current pool) for context `ctx`.
    pub fn alloc(
        &mut self,
        pool: u64,
        size: u64,
        ctx: u64,
        mem: &DeviceMemory,
    ) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        let pool = if pool == 0 { self.current } else { pool };
        let class = size
            .checked_next_multiple_of(SIZE_CLASS)
            .ok_or(CUresult::OUT_OF_MEMORY)?;
        let p = self.live_pool_mut(pool)?;
        let reused = p.kept.get_mut(&class).and_then(Vec::pop);
        if p.kept.get(&class).is_some_and(Vec::is_empty) {
            p.kept.remove(&class);
        }
        let addr = if let Some(addr) = reused {
            p.kept_bytes -= class;
            addr
        } else {
            if p.props.max_size != 0 && p.reserved() + class > p.props.max_size {
                p.release_down_to(mem, p.props.max_size.saturating_sub(class));
                if p.reserved() + class > p.props.max_size {
                    return Err(CUresult::OUT_OF_MEMORY);
                }
            }
            match mem.alloc(class, ALLOC_ALIGN, ctx) {
                Ok(addr) => addr,
                Err(CUresult::OUT_OF_MEMORY) => {
                    // What the pool keeps is the first thing to give back when the device is full.
                    p.release_down_to(mem, p.used);
                    mem.alloc(class, ALLOC_ALIGN, ctx)?
                }
                Err(e) => return Err(e),
            }
        };
        p.live.insert(addr, class);
        p.used += class;
        p.used_high = p.used_high.max(p.used);
        p.reserved_high = p.reserved_high.max(p.reserved());
        self.owner.insert(addr, pool);
        Ok(addr)
    }

    /// `cuMemFreeAsync`, when queued: takes `addr` out of the outstanding allocations and says which pool
    /// it goes back to, or `None` if no pool handed it out. Freeing it again before its free is reached
    /// is `CUDA_ERROR_INVALID_VALUE`.
    pub fn begin_free(&mut self, addr: u64) -> Result<Option<u64>, CUresult> {
        if self.freeing.contains(&addr) {
            return Err(CUresult::INVALID_VALUE);
        }
        let pool = self.owner.remove(&addr);
        match pool {
            Some(_) => {
                self.freeing.insert(addr);
            }
            // Freed before and kept by its pool for reuse: still mapped, but no longer the caller's.
            None if self.is_kept(addr) => return Err(CUresult::INVALID_VALUE),
            None => {}
        }
        Ok(pool)
    }

    /// Whether `addr` is memory a pool keeps for reuse (freed, not handed out again).
    fn is_kept(&self, addr: u64) -> bool {
        self.pools
            .values()
            .any(|p| p.kept.values().any(|kept| kept.contains(&addr)))
    }

    /// `cuMemFreeAsync`, when its stream reaches it: the memory goes back to `pool`, for reuse.
    pub fn finish_free(&mut self, pool: u64, addr: u64, mem: &DeviceMemory) {
        self.freeing.remove(&addr);
        let Some(p) = self.pools.get_mut(&pool) else {
            let _ = mem.free(addr);
            return;
        };
        let Some(class) = p.live.remove(&addr) else {
            return;
        };
        p.used -= class;
        if p.destroyed {
            let _ = mem.free(addr);
            if p.live.is_empty() {
                self.pools.remove(&pool);
            }
            return;
        }
        p.kept.entry(class).or_default().push(addr);
        p.kept_bytes += class;
    }

    /// The host synchronised with the device: every pool gives back what it keeps above its threshold.
    pub fn synchronized(&mut self, mem: &DeviceMemory) {
        for p in self.pools.values_mut() {
            let keep = p.release_threshold.max(p.used);
            p.release_down_to(mem, keep);
        }
    }

    /// `cuMemPoolTrimTo`.
    pub fn trim_to(&mut self, pool: u64, keep: u64, mem: &DeviceMemory) -> Result<(), CUresult> {
        self.live_pool_mut(pool)?.release_down_to(mem, keep);
        Ok(())
    }

    /// `cuMemPoolGetAttribute`: the value (an `int` attribute as 0 or 1).
    pub fn attribute(&self, pool: u64, attribute: u32) -> Result<u64, CUresult> {
        let p = self.live_pool(pool)?;
        Ok(match attribute {
            attr::REUSE_FOLLOW_EVENT_DEPENDENCIES => u64::from(p.reuse[0]),
            attr::REUSE_ALLOW_OPPORTUNISTIC => u64::from(p.reuse[1]),
            attr::REUSE_ALLOW_INTERNAL_DEPENDENCIES => u64::from(p.reuse[2]),
            attr::RELEASE_THRESHOLD => p.release_threshold,
            attr::RESERVED_MEM_CURRENT => p.reserved(),
            attr::RESERVED_MEM_HIGH => p.reserved_high,
            attr::USED_MEM_CURRENT => p.used,
            attr::USED_MEM_HIGH => p.used_high,
            _ => return Err(CUresult::INVALID_VALUE),
        })
    }

    /// `cuMemPoolSetAttribute`: the reuse policies, the release threshold, and the high-water marks
    /// (which may only be reset, to 0: they restart from the current figure).
    pub fn set_attribute(&mut self, pool: u64, attribute: u32, value: u64) -> Result<(), CUresult> {
        let p = self.live_pool_mut(pool)?;
        match attribute {
            attr::REUSE_FOLLOW_EVENT_DEPENDENCIES
            | attr::REUSE_ALLOW_OPPORTUNISTIC
            | attr::REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                p.reuse[(attribute - 1) as usize] = value != 0;
            }
            attr::RELEASE_THRESHOLD => p.release_threshold = value,
            attr::RESERVED_MEM_HIGH if value == 0 => p.reserved_high = p.reserved(),
            attr::USED_MEM_HIGH if value == 0 => p.used_high = p.used,
            _ => return Err(CUresult::INVALID_VALUE),
        }
        Ok(())
    }

    /// `cuMemPoolGetAccess`: the device's own pools are always readable and writable by it.
    pub fn access(&self, pool: u64, location: &CUmemLocation) -> Result<u32, CUresult> {
        self.live_pool(pool)?;
        check_location(location)?;
        Ok(3)
    }

    /// `cuMemPoolSetAccess`: device 0 is the only device, and the pool's own always has read-write
    /// access, which is all it may be given.
    pub fn set_access(
        &mut self,
        pool: u64,
        location: &CUmemLocation,
        flags: u32,
    ) -> Result<(), CUresult> {
        self.live_pool(pool)?;
        check_location(location)?;
        if flags == 3 {
            Ok(())
        } else {
            Err(CUresult::INVALID_VALUE)
        }
    }

    /// Allocations of a context that died are gone: forget them.
    pub fn forget_freed(&mut self, mem: &DeviceMemory) {
        let gone = |addr: &u64| mem.address_range(*addr).map(|r| r.0) != Some(*addr);
        self.owner.retain(|a, _| !gone(a));
        self.freeing.retain(|a| !gone(a));
        for p in self.pools.values_mut() {
            let before = p.live.values().sum::<u64>();
            p.live.retain(|a, _| !gone(a));
            p.used -= before - p.live.values().sum::<u64>();
            for addrs in p.kept.values_mut() {
                addrs.retain(|a| !gone(a));
            }
            p.kept.retain(|_, v| !v.is_empty());
            p.kept_bytes = p.kept.iter().map(|(c, v)| c * v.len() as u64).sum();
        }
    }

    /// The session ended (its memory is being freed wholesale): back to the default pool alone.
    pub fn clear(&mut self) {
        *self = Self::new();
    }
}

/// Pools here hold device 0's memory.
fn check_location(location: &CUmemLocation) -> Result<(), CUresult> {
    match (location.kind, location.id) {
        (CU_MEM_LOCATION_TYPE_DEVICE, 0) => Ok(()),
        (CU_MEM_LOCATION_TYPE_DEVICE, _) => Err(CUresult::INVALID_DEVICE),
        // Host and NUMA-node pools need memory the device can reach on the host: not emulated.
        (2..=4, _) => Err(CUresult::NOT_SUPPORTED),
        _ => Err(CUresult::INVALID_VALUE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_memory_is_kept_reused_and_released_at_synchronisation() {
        let mem = DeviceMemory::new(64 << 20);
        let mut pools = Pools::new();
        let pool = pools.current();
        let a = pools.alloc(0, 1000, 1, &mem).unwrap();
        assert_eq!(pools.attribute(pool, attr::USED_MEM_CURRENT), Ok(1024));
        assert_eq!(pools.begin_free(a), Ok(Some(pool)));
        assert_eq!(
            pools.begin_free(a),
            Err(CUresult::INVALID_VALUE),
            "a second free of the same memory"
        );
        pools.finish_free(pool, a, &mem);
        assert_eq!(pools.attribute(pool, attr::USED_MEM_CURRENT), Ok(0));
        assert_eq!(pools.attribute(pool, attr::RESERVED_MEM_CURRENT), Ok(1024));
        // The same size class gets the kept block back.
        let b = pools.alloc(0, 900, 1, &mem).unwrap();
        assert_eq!(a, b);
        pools.begin_free(b).unwrap();
        pools.finish_free(pool, b, &mem);
        // Threshold 0: synchronisation gives it back to the device.
        pools.synchronized(&mem);
        assert_eq!(pools.attribute(pool, attr::RESERVED_MEM_CURRENT), Ok(0));
        assert_eq!(mem.live_allocations(), 0);
        assert_eq!(pools.attribute(pool, attr::USED_MEM_HIGH), Ok(1024));
        pools.set_attribute(pool, attr::USED_MEM_HIGH, 0).unwrap();
        assert_eq!(pools.attribute(pool, attr::USED_MEM_HIGH), Ok(0));
        assert_eq!(
            pools.set_attribute(pool, attr::USED_MEM_HIGH, 5),
            Err(CUresult::INVALID_VALUE)
        );
    }

    #[test]
    fn the_release_threshold_and_trim_keep_what_they_say() {
        let mem = DeviceMemory::new(64 << 20);
        let mut pools = Pools::new();
        let pool = pools.current();
        pools
            .set_attribute(pool, attr::RELEASE_THRESHOLD, 4096)
            .unwrap();
        let blocks: Vec<u64> = (0..4)
            .map(|_| pools.alloc(pool, 2048, 1, &mem).unwrap())
            .collect();
        for b in blocks {
            pools.begin_free(b).unwrap();
            pools.finish_free(pool, b, &mem);
        }
        pools.synchronized(&mem);
        assert_eq!(pools.attribute(pool, attr::RESERVED_MEM_CURRENT), Ok(4096));
        pools.trim_to(pool, 0, &mem).unwrap();
        assert_eq!(pools.attribute(pool, attr::RESERVED_MEM_CURRENT), Ok(0));
    }

    #[test]
    fn created_pools_obey_their_size_and_outlive_destruction_until_freed() {
        let mem = DeviceMemory::new(64 << 20);
        let mut pools = Pools::new();
        let props = CUmemPoolProps {
            alloc_type: CU_MEM_ALLOCATION_TYPE_PINNED,
            location: CUmemLocation {
                kind: CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            },
            max_size: 1 << 20,
            ..CUmemPoolProps::default()
        };
        let pool = pools.create(props).unwrap();
        assert_eq!(
            pools.alloc(pool, 2 << 20, 1, &mem),
            Err(CUresult::OUT_OF_MEMORY)
        );
        let a = pools.alloc(pool, 4096, 1, &mem).unwrap();
        pools.set_current(pool).unwrap();
        assert_eq!(
            pools.destroy(pools.default_pool(), &mem),
            Err(CUresult::INVALID_VALUE)
        );
        pools.destroy(pool, &mem).unwrap();
        assert_eq!(pools.current(), pools.default_pool());
        assert_eq!(pools.attribute(pool, 7), Err(CUresult::INVALID_VALUE));
        // The outstanding allocation is still good, and freed when it comes back.
        assert_eq!(mem.live_allocations(), 1);
        assert_eq!(pools.begin_free(a), Ok(Some(pool)));
        pools.finish_free(pool, a, &mem);
        assert_eq!(mem.live_allocations(), 0);
        let bad = CUmemPoolProps {
            location: CUmemLocation { kind: 1, id: 3 },
            ..props
        };
        assert_eq!(pools.create(bad), Err(CUresult::INVALID_DEVICE));
    }
}
