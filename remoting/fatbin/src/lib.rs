//! Module images: how many bytes a `cuModuleLoadData` image spans, and what a fatbinary contains.
//!
//! `cuModuleLoadData(module, image)` and `cuLibraryLoadData(.., code, ..)` get a pointer and no length, so
//! the client must work out the extent before shipping the bytes. [`image_size`] does that from the first
//! bytes, dispatching on the magic number:
//!
//! * a fatbin *wrapper* (`__fatBinC_Wrapper_t`, magic [`FATBIN_WRAPPER_MAGIC`]) points to a fatbin header;
//!   [`unwrap_fatbin_wrapper`] follows it (the client ships the fatbin itself, not the wrapper);
//! * a fatbin header (magic [`FATBIN_MAGIC`]): header size + `fat_size`;
//! * an ELF cubin: the furthest extent of its section and program header tables and of its sections;
//! * otherwise PTX text: up to and including the terminating NUL.
//!
//! [`Fatbin::parse`] reads the entries of a fatbin held in a byte slice (kind, SM architecture, flags
//! including compression), without trusting any length in it. [`FatbinEntry::decompressed`] inflates an
//! LZ4- or ZSTD-compressed entry within a caller-given byte budget, [`Fatbin::select`] picks what a GPU of a
//! given compute capability runs (its SASS, else the best PTX: [`arch`]), and [`Fatbin::rebuild`] writes a
//! fatbin holding only chosen entries. [`read_wrapper`] reads a `__fatBinC_Wrapper_t` of either version,
//! including the prelinked fatbin list of version 2 (`-rdc` programs).

use std::borrow::Cow;
use std::ffi::c_void;
use std::io::Read;

pub mod arch;
pub mod kernels;

pub use arch::{ArchVariant, ComputeCapability, SmArch};

/// Magic of `__fatBinC_Wrapper_t` (the structure `__cudaRegisterFatBinary` receives).
pub const FATBIN_WRAPPER_MAGIC: u32 = 0x4662_43B1;
/// Magic of a fatbin header (the start of an `.nv_fatbin` section).
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// Bytes of a fatbin header.
pub const FATBIN_HEADER_BYTES: usize = 16;
/// Bytes of a fatbin entry header as written by current toolkits (its `header_size` field is authoritative).
pub const ENTRY_HEADER_BYTES: usize = 64;
/// Entry flag: the payload is LZ4-compressed.
pub const FLAG_COMPRESSED_LZ4: u64 = 0x2000;
/// Entry flag: the payload is ZSTD-compressed.
pub const FLAG_COMPRESSED_ZSTD: u64 = 0x8000;
/// Entry flag: 64-bit code.
pub const FLAG_64BIT: u64 = 0x1;
/// Entry flag: debug information.
pub const FLAG_DEBUG: u64 = 0x2;
/// Entry flag: built for Linux.
pub const FLAG_LINUX: u64 = 0x10;
/// Entry flag: an architecture-specific target (`sm_90a`, `compute_100a`): runs on exactly that SM.
pub const FLAG_ARCH_SPECIFIC: u64 = 0x10_0000;
/// Entry flag: a family-specific target (`sm_100f`): runs on that SM and later minors of the same major.
pub const FLAG_FAMILY_SPECIFIC: u64 = 0x20_0000;

/// Most entries [`Fatbin::parse`] accepts (every entry takes at least 16 bytes, so this only bounds memory).
pub const MAX_ENTRIES: usize = 1 << 16;
/// Most prelinked fatbins [`read_wrapper`] follows in a version-2 wrapper.
pub const MAX_PRELINKED: usize = 1 << 12;
/// Largest entry header accepted (current toolkits write 64, 80 or 112 bytes).
pub const MAX_ENTRY_HEADER_BYTES: u64 = 4096;

/// Upper bound on an image the client will ship (a larger claimed size is treated as corrupt).
pub const MAX_IMAGE_BYTES: u64 = 4 << 30;

const ELF_MAGIC: [u8; 4] = *b"\x7fELF";

/// The image at a pointer could not be sized or parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    /// A NULL image pointer.
    #[error("the image pointer is NULL")]
    Null,
    /// A size field claims more than [`MAX_IMAGE_BYTES`] or overflows.
    #[error("the image claims an implausible size ({0} bytes)")]
    Implausible(u64),
    /// The image is an ELF file Gleam does not understand (32-bit, or a truncated header).
    #[error("unsupported ELF image: {0}")]
    Elf(&'static str),
    /// A fatbin is shorter than its headers say.
    #[error("truncated fatbin: {0}")]
    Truncated(&'static str),
    /// Not a fatbin (wrong magic or version).
    #[error("not a fatbin: {0}")]
    NotFatbin(&'static str),
    /// The wrapper's version is not 1 or 2, or its data pointer is NULL.
    #[error("unsupported fatbin wrapper: {0}")]
    Wrapper(&'static str),
    /// Decompressing an entry would exceed the caller's byte budget.
    #[error("a fatbin entry decompresses to {needed} bytes, over the budget of {budget}")]
    OverBudget {
        /// Bytes the entry claims or produced (at least).
        needed: u64,
        /// The budget given.
        budget: u64,
    },
    /// A compressed entry is corrupt, or does not inflate to the size it claims.
    #[error("cannot decompress a fatbin entry ({codec}): {reason}")]
    Decompress {
        /// `lz4` or `zstd`.
        codec: &'static str,
        /// What went wrong.
        reason: String,
    },
}

/// What kind of image the first bytes announce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// `__fatBinC_Wrapper_t`.
    FatbinWrapper,
    /// Fatbin header followed by entries.
    Fatbin,
    /// ELF cubin.
    Elf,
    /// PTX text (anything else).
    Ptx,
}

/// The first four bytes of the image at `image`, read one at a time up to a NUL (zeros after it): PTX
/// text may be shorter than four bytes (`""` is one), and no magic number holds a zero byte, so this reads
/// nothing an image does not have and classifies the same.
///
/// # Safety
/// `image` is readable up to its first NUL byte or for four bytes, whichever comes first.
unsafe fn head(image: *const u8) -> [u8; 4] {
    let mut head = [0u8; 4];
    for (i, byte) in head.iter_mut().enumerate() {
        // SAFETY: no NUL among the bytes before this one, so the caller promised this one is readable.
        *byte = unsafe { image.add(i).read() };
        if *byte == 0 {
            break;
        }
    }
    head
}

/// Classifies an image by its first four bytes.
pub fn classify(head: &[u8]) -> ImageKind {
    let magic = head
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    match magic {
        Some(FATBIN_WRAPPER_MAGIC) => ImageKind::FatbinWrapper,
        Some(FATBIN_MAGIC) => ImageKind::Fatbin,
        _ if head.starts_with(&ELF_MAGIC) => ImageKind::Elf,
        _ => ImageKind::Ptx,
    }
}

/// If `image` is a fatbin wrapper, the pointer to the fatbin header it holds; else `image` unchanged.
///
/// Only version 1 wrappers (and version 2 wrappers, whose prelinked list is ignored: see [`read_wrapper`])
/// are followed.
///
/// # Safety
/// `image` must point to a valid module image as `cuModuleLoadData` requires.
pub unsafe fn unwrap_fatbin_wrapper(image: *const c_void) -> Result<*const c_void, ImageError> {
    if image.is_null() {
        return Err(ImageError::Null);
    }
    // SAFETY: the image is readable up to its first NUL or for its whole header.
    let head = unsafe { head(image.cast()) };
    if classify(&head) != ImageKind::FatbinWrapper {
        return Ok(image);
    }
    // SAFETY: a wrapper is 24 bytes: magic u32, version u32, data u64, filename_or_fatbins u64.
    let wrapper = unsafe { std::slice::from_raw_parts(image.cast::<u8>(), 16) };
    let version = read_u32(wrapper, 4).unwrap_or(0);
    if version != 1 && version != 2 {
        return Err(ImageError::Wrapper("version is neither 1 nor 2"));
    }
    let data = read_u64(wrapper, 8).unwrap_or(0);
    if data == 0 {
        return Err(ImageError::Wrapper("NULL data pointer"));
    }
    Ok(data as *const c_void)
}

/// The byte length of the module image at `image` (a fatbin wrapper must be unwrapped first with
/// [`unwrap_fatbin_wrapper`]; here it is followed automatically and the size is that of the fatbin).
///
/// # Safety
/// `image` must point to a valid module image as `cuModuleLoadData` requires: its headers readable, and
/// the extent they describe readable.
pub unsafe fn image_size(image: *const c_void) -> Result<usize, ImageError> {
    // SAFETY: forwarded contract.
    let image = unsafe { unwrap_fatbin_wrapper(image)? }.cast::<u8>();
    // SAFETY: the image is readable up to its first NUL or for its whole header.
    let head = unsafe { head(image) };
    match classify(&head) {
        ImageKind::Fatbin => {
            // SAFETY: a fatbin header is 16 bytes.
            let header = unsafe { std::slice::from_raw_parts(image, FATBIN_HEADER_BYTES) };
            fatbin_size(header)
        }
        ImageKind::Elf => {
            // SAFETY: a 64-bit ELF header is 64 bytes.
            let header = unsafe { std::slice::from_raw_parts(image, 64) };
            let (shoff, shnum, shentsize, extent) = elf_header_extent(header)?;
            let mut size = extent;
            if shnum > 0 {
                // SAFETY: the section header table lies within the image the header describes.
                let table = unsafe {
                    std::slice::from_raw_parts(
                        image.add(shoff as usize),
                        shnum as usize * shentsize as usize,
                    )
                };
                size = size.max(elf_sections_extent(table, shentsize)?);
            }
            checked_size(size)
        }
        ImageKind::Ptx => {
            // SAFETY: PTX text is NUL-terminated.
            let text = unsafe { std::ffi::CStr::from_ptr(image.cast()) };
            Ok(text.to_bytes_with_nul().len())
        }
        ImageKind::FatbinWrapper => Err(ImageError::Wrapper("a wrapper points to another wrapper")),
    }
}

/// The byte length of a module image held in a slice (which may be longer than the image).
pub fn image_size_in(bytes: &[u8]) -> Result<usize, ImageError> {
    match classify(bytes) {
        ImageKind::Fatbin => {
            let size = fatbin_size(bytes)?;
            if size > bytes.len() {
                return Err(ImageError::Truncated("entries extend past the end"));
            }
            Ok(size)
        }
        ImageKind::Elf => {
            let (shoff, shnum, shentsize, extent) = elf_header_extent(bytes)?;
            let mut size = extent;
            if shnum > 0 {
                let start = shoff as usize;
                let end = start + shnum as usize * shentsize as usize;
                let table = bytes
                    .get(start..end)
                    .ok_or(ImageError::Elf("section headers past the end"))?;
                size = size.max(elf_sections_extent(table, shentsize)?);
            }
            let size = checked_size(size)?;
            if size > bytes.len() {
                return Err(ImageError::Elf("sections extend past the end"));
            }
            Ok(size)
        }
        ImageKind::Ptx => Ok(bytes
            .iter()
            .position(|&b| b == 0)
            .map_or(bytes.len(), |nul| nul + 1)),
        ImageKind::FatbinWrapper => {
            Err(ImageError::Wrapper("a wrapper holds a pointer, not bytes"))
        }
    }
}

fn fatbin_size(header: &[u8]) -> Result<usize, ImageError> {
    let header_size = u64::from(read_u16(header, 6).ok_or(ImageError::Truncated("header"))?);
    let fat_size = read_u64(header, 8).ok_or(ImageError::Truncated("header"))?;
    if header_size < FATBIN_HEADER_BYTES as u64 {
        return Err(ImageError::NotFatbin("header size below 16"));
    }
    checked_size(header_size.saturating_add(fat_size))
}

/// Returns (e_shoff, e_shnum, e_shentsize, extent of the header and both header tables).
fn elf_header_extent(header: &[u8]) -> Result<(u64, u16, u16, u64), ImageError> {
    if header.len() < 64 {
        return Err(ImageError::Elf("truncated header"));
    }
    if header[4] != 2 {
        return Err(ImageError::Elf("not a 64-bit ELF"));
    }
    if header[5] != 1 {
        return Err(ImageError::Elf("not little-endian"));
    }
    let field64 = |at| read_u64(header, at).ok_or(ImageError::Elf("truncated header"));
    let field16 = |at| read_u16(header, at).ok_or(ImageError::Elf("truncated header"));
    let phoff = field64(32)?;
    let shoff = field64(40)?;
    let phentsize = field16(54)?;
    let phnum = field16(56)?;
    let shentsize = field16(58)?;
    let shnum = field16(60)?;
    if shnum > 0 && shentsize < 64 {
        return Err(ImageError::Elf("section header entries below 64 bytes"));
    }
    let ph_end = phoff.saturating_add(u64::from(phnum) * u64::from(phentsize));
    let sh_end = shoff.saturating_add(u64::from(shnum) * u64::from(shentsize));
    let extent = 64u64.max(ph_end).max(sh_end);
    checked_size(extent)?;
    Ok((shoff, shnum, shentsize, extent))
}

/// The furthest end of any section with file contents (SHT_NOBITS sections occupy no file bytes).
fn elf_sections_extent(table: &[u8], shentsize: u16) -> Result<u64, ImageError> {
    const SHT_NOBITS: u32 = 8;
    let mut extent = 0u64;
    for entry in table.chunks_exact(shentsize as usize) {
        let kind = read_u32(entry, 4).ok_or(ImageError::Elf("truncated section header"))?;
        if kind == SHT_NOBITS {
            continue;
        }
        let offset = read_u64(entry, 24).ok_or(ImageError::Elf("truncated section header"))?;
        let size = read_u64(entry, 32).ok_or(ImageError::Elf("truncated section header"))?;
        extent = extent.max(offset.saturating_add(size));
    }
    Ok(extent)
}

fn checked_size(size: u64) -> Result<usize, ImageError> {
    if size > MAX_IMAGE_BYTES {
        return Err(ImageError::Implausible(size));
    }
    Ok(size as usize)
}

/// The kind of a fatbin entry's payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// PTX text (NUL-padded).
    Ptx,
    /// An ELF cubin (SASS for one SM architecture).
    Elf,
    /// A kind this parser does not know (the raw value).
    Other(u16),
}

/// How an entry's payload is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Stored as is.
    None,
    /// LZ4 (flag 0x2000).
    Lz4,
    /// ZSTD (flag 0x8000).
    Zstd,
}

/// One entry of a fatbin.
#[derive(Clone, Copy, Debug)]
pub struct FatbinEntry<'a> {
    /// PTX or ELF.
    pub kind: EntryKind,
    /// SM architecture, e.g. 90 for `sm_90` (10 * major + minor).
    pub sm_arch: u32,
    /// Raw flags (64-bit, debug, compression, arch- or family-specific...).
    pub flags: u64,
    /// Size of the payload once decompressed (as the entry claims; 0 when not recorded).
    pub uncompressed_size: u64,
    /// The entry's format version (major, minor): the PTX ISA version for PTX (e.g. (9, 0)), the cubin
    /// format for ELF.
    pub version: (u16, u16),
    /// The payload as stored (compressed if [`FatbinEntry::compression`] says so).
    pub payload: &'a [u8],
    /// The whole entry as stored: its header, payload and padding (what [`Fatbin::rebuild`] copies).
    pub raw: &'a [u8],
}

impl<'a> FatbinEntry<'a> {
    /// The architecture this entry targets.
    pub fn arch(&self) -> SmArch {
        SmArch::from_entry(self.sm_arch, self.flags)
    }

    /// Whether a GPU of compute capability `cc` can run this entry (an ELF without recompiling, PTX through
    /// the driver's JIT), per CUDA's compatibility rules ([`arch`]).
    pub fn runs_on(&self, cc: ComputeCapability) -> bool {
        match self.kind {
            EntryKind::Elf => self.arch().cubin_runs_on(cc),
            EntryKind::Ptx => self.arch().ptx_runs_on(cc),
            EntryKind::Other(_) => false,
        }
    }

    /// The payload, decompressed if it is stored compressed, producing at most `budget` bytes (a corrupt or
    /// hostile entry cannot make this allocate more). Uncompressed payloads are borrowed as stored (PTX keeps
    /// its NUL padding).
    pub fn decompressed(&self, budget: usize) -> Result<Cow<'a, [u8]>, ImageError> {
        let claimed = self.uncompressed_size;
        if claimed > budget as u64 {
            return Err(ImageError::OverBudget {
                needed: claimed,
                budget: budget as u64,
            });
        }
        let out = match self.compression() {
            Compression::None => return Ok(Cow::Borrowed(self.payload)),
            Compression::Zstd => zstd_frame(self.payload, claimed as usize, budget)?,
            Compression::Lz4 => lz4_block(self.payload, claimed as usize, budget)?,
        };
        if claimed != 0 && out.len() as u64 != claimed {
            return Err(ImageError::Decompress {
                codec: match self.compression() {
                    Compression::Lz4 => "lz4",
                    _ => "zstd",
                },
                reason: format!("{} bytes out, the entry claims {claimed}", out.len()),
            });
        }
        Ok(Cow::Owned(out))
    }

    /// How the payload is compressed.
    pub fn compression(&self) -> Compression {
        if self.flags & FLAG_COMPRESSED_ZSTD != 0 {
            Compression::Zstd
        } else if self.flags & FLAG_COMPRESSED_LZ4 != 0 {
            Compression::Lz4
        } else {
            Compression::None
        }
    }

    /// The PTX text of an uncompressed PTX entry, without its NUL padding.
    pub fn ptx_text(&self) -> Option<&str> {
        if self.kind != EntryKind::Ptx || self.compression() != Compression::None {
            return None;
        }
        let end = self
            .payload
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.payload.len());
        std::str::from_utf8(&self.payload[..end]).ok()
    }
}

/// A parsed fatbin: its entries, each borrowing its payload from the input.
#[derive(Clone, Debug)]
pub struct Fatbin<'a> {
    /// The entries in file order.
    pub entries: Vec<FatbinEntry<'a>>,
}

impl<'a> Fatbin<'a> {
    /// Parses a fatbin (header + entries) held in `bytes`. Every length is checked against the slice.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, ImageError> {
        if classify(bytes) != ImageKind::Fatbin {
            return Err(ImageError::NotFatbin("wrong magic"));
        }
        let header_size = read_u16(bytes, 6).ok_or(ImageError::Truncated("header"))? as usize;
        let fat_size = read_u64(bytes, 8).ok_or(ImageError::Truncated("header"))?;
        if header_size < FATBIN_HEADER_BYTES {
            return Err(ImageError::NotFatbin("header size below 16"));
        }
        let end = (header_size as u64)
            .checked_add(fat_size)
            .filter(|&end| end <= bytes.len() as u64)
            .ok_or(ImageError::Truncated("entries extend past the end"))?
            as usize;
        let mut entries = Vec::new();
        let mut at = header_size;
        // Entries are back to back; a zero-sized tail (padding) ends the list.
        while at + 16 <= end {
            if entries.len() == MAX_ENTRIES {
                return Err(ImageError::Implausible(MAX_ENTRIES as u64));
            }
            let entry = &bytes[at..end];
            let kind = read_u16(entry, 0).ok_or(ImageError::Truncated("entry header"))?;
            let entry_header =
                u64::from(read_u32(entry, 4).ok_or(ImageError::Truncated("entry header"))?);
            let payload_size = read_u64(entry, 8).ok_or(ImageError::Truncated("entry header"))?;
            if kind == 0 && entry_header == 0 {
                break;
            }
            if entry_header < 16 {
                return Err(ImageError::Truncated("entry header size below 16"));
            }
            if entry_header > MAX_ENTRY_HEADER_BYTES {
                return Err(ImageError::Implausible(entry_header));
            }
            // The optional fields are read from the entry's own header only: one shorter than 64 bytes lacks
            // them (reading on would take the payload or the next entry for them).
            let header = &entry[..(entry_header as usize).min(entry.len())];
            let compressed = read_u32(header, 16).map_or(0, u64::from);
            let sm_arch = read_u32(header, 28).unwrap_or(0);
            let flags = read_u64(header, 40).unwrap_or(0);
            let version = (
                read_u16(header, 26).unwrap_or(0),
                read_u16(header, 24).unwrap_or(0),
            );
            let uncompressed_size = read_u64(header, 56).unwrap_or(0);
            let compressed_flag = flags & (FLAG_COMPRESSED_LZ4 | FLAG_COMPRESSED_ZSTD) != 0;
            // A compressed payload is `compressed_size` bytes; the stride covers whichever is larger.
            let stored = if compressed_flag && compressed > 0 {
                compressed
            } else {
                payload_size
            };
            let stride = payload_size.max(compressed);
            let payload_start = entry_header;
            let payload_end = payload_start
                .checked_add(stored)
                .filter(|&e| e <= entry.len() as u64)
                .ok_or(ImageError::Truncated("entry payload past the end"))?;
            let next = payload_start
                .checked_add(stride)
                .ok_or(ImageError::Truncated("entry size overflows"))?;
            entries.push(FatbinEntry {
                kind: match kind {
                    1 => EntryKind::Ptx,
                    2 => EntryKind::Elf,
                    other => EntryKind::Other(other),
                },
                sm_arch,
                flags,
                uncompressed_size,
                version,
                payload: &entry[payload_start as usize..payload_end as usize],
                raw: &entry[..next.min(entry.len() as u64) as usize],
            });
            if next > entry.len() as u64 {
                break;
            }
            at += next as usize;
        }
        Ok(Self { entries })
    }

    /// What a GPU of compute capability `cc` runs from this fatbin: the cubin for its SM (or a compatible
    /// one), else the PTX of the highest virtual architecture it can JIT ([`arch`] gives the rules). `None`
    /// when nothing fits (the driver's `CUDA_ERROR_NO_BINARY_FOR_GPU`).
    pub fn select(&self, cc: ComputeCapability) -> Option<Selected<'_, 'a>> {
        let best = |kind: EntryKind| {
            self.entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.kind == kind && e.runs_on(cc))
                .max_by_key(|(_, e)| e.arch().preference())
        };
        let (index, entry) = best(EntryKind::Elf).or_else(|| best(EntryKind::Ptx))?;
        Some(Selected { index, entry })
    }

    /// Every entry a GPU of compute capability `cc` can run, in file order (to let the serving driver make
    /// its own choice among them).
    pub fn runnable(&self, cc: ComputeCapability) -> Vec<usize> {
        (0..self.entries.len())
            .filter(|&i| self.entries[i].runs_on(cc))
            .collect()
    }

    /// A fatbin holding only the entries at `indices` (in the order given), each copied as stored.
    /// Out-of-range indices are skipped.
    pub fn rebuild(&self, indices: &[usize]) -> Vec<u8> {
        let body: usize = indices
            .iter()
            .filter_map(|&i| self.entries.get(i))
            .map(|e| e.raw.len())
            .sum();
        let mut out = Vec::with_capacity(FATBIN_HEADER_BYTES + body);
        out.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&(FATBIN_HEADER_BYTES as u16).to_le_bytes());
        out.extend_from_slice(&(body as u64).to_le_bytes());
        for e in indices.iter().filter_map(|&i| self.entries.get(i)) {
            out.extend_from_slice(e.raw);
        }
        out
    }

    /// The PTX entry with the highest SM architecture not above `max_sm` (any PTX entry if none is).
    /// Unlike [`Fatbin::select`] it ignores CUDA's compatibility rules: the emu backend interprets any PTX.
    pub fn best_ptx(&self, max_sm: u32) -> Option<&FatbinEntry<'a>> {
        let ptx = self.entries.iter().filter(|e| e.kind == EntryKind::Ptx);
        ptx.clone()
            .filter(|e| e.sm_arch <= max_sm)
            .max_by_key(|e| e.sm_arch)
            .or_else(|| ptx.min_by_key(|e| e.sm_arch))
    }
}

/// The entry [`Fatbin::select`] picked.
#[derive(Clone, Copy, Debug)]
pub struct Selected<'f, 'a> {
    /// Its position in [`Fatbin::entries`].
    pub index: usize,
    /// The entry.
    pub entry: &'f FatbinEntry<'a>,
}

/// What a `__fatBinC_Wrapper_t` (the argument of `__cudaRegisterFatBinary`) holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wrapper {
    /// 1, or 2 for programs built with relocatable device code (`-rdc`).
    pub version: u32,
    /// The wrapper's own fatbin (for version 2, the device-linked image, possibly with no entries).
    pub fatbin: *const u8,
    /// Version 2 only: the fatbins of the separately compiled objects (`__cudaPrelinkedFatbins`, filled by
    /// the registration code before `__cudaRegisterFatBinary` runs), which the driver links together at load
    /// time. Empty for version 1 (whose last field is an offline file name, or NULL).
    pub prelinked: Vec<*const u8>,
}

/// Reads the wrapper at `wrapper`, following a version-2 wrapper's NULL-terminated prelinked list (at most
/// [`MAX_PRELINKED`] entries).
///
/// # Safety
/// `wrapper` must point to a readable 24-byte wrapper (its magic is checked before more is read) and, for
/// version 2, its list pointer to a readable NULL-terminated pointer array.
pub unsafe fn read_wrapper(wrapper: *const c_void) -> Result<Wrapper, ImageError> {
    if wrapper.is_null() {
        return Err(ImageError::Null);
    }
    // SAFETY: the caller guarantees the first bytes are readable.
    let head = unsafe { std::slice::from_raw_parts(wrapper.cast::<u8>(), 4) };
    if classify(head) != ImageKind::FatbinWrapper {
        return Err(ImageError::Wrapper("wrong magic"));
    }
    // SAFETY: a wrapper is 24 bytes: magic u32, version u32, data u64, filename_or_fatbins u64.
    let bytes = unsafe { std::slice::from_raw_parts(wrapper.cast::<u8>(), 24) };
    let version = read_u32(bytes, 4).unwrap_or(0);
    let fatbin = read_u64(bytes, 8).unwrap_or(0) as *const u8;
    let list = read_u64(bytes, 16).unwrap_or(0) as *const *const u8;
    if version != 1 && version != 2 {
        return Err(ImageError::Wrapper("version is neither 1 nor 2"));
    }
    if fatbin.is_null() {
        return Err(ImageError::Wrapper("NULL data pointer"));
    }
    let mut prelinked = Vec::new();
    if version == 2 && !list.is_null() {
        loop {
            // SAFETY: the list is NULL-terminated (caller's contract); we stop at the terminator.
            let next = unsafe { list.add(prelinked.len()).read_unaligned() };
            if next.is_null() {
                break;
            }
            if prelinked.len() == MAX_PRELINKED {
                return Err(ImageError::Wrapper("more prelinked fatbins than supported"));
            }
            prelinked.push(next);
        }
    }
    Ok(Wrapper {
        version,
        fatbin,
        prelinked,
    })
}

/// One ZSTD frame (the stored payload may carry zero padding after it), producing at most `budget` bytes.
fn zstd_frame(input: &[u8], claimed: usize, budget: usize) -> Result<Vec<u8>, ImageError> {
    let fail = |reason: String| ImageError::Decompress {
        codec: "zstd",
        reason,
    };
    let decoder = zstd::stream::read::Decoder::with_buffer(input)
        .map_err(|e| fail(e.to_string()))?
        .single_frame();
    // Reserve what the entry claims (already within budget), never more than the budget.
    let mut out = Vec::with_capacity(claimed.min(budget));
    decoder
        .take(budget as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| fail(e.to_string()))?;
    if out.len() > budget {
        return Err(ImageError::OverBudget {
            needed: out.len() as u64,
            budget: budget as u64,
        });
    }
    Ok(out)
}

/// One raw LZ4 block (no frame). Without a claimed size the output is bounded by LZ4's largest ratio.
fn lz4_block(input: &[u8], claimed: usize, budget: usize) -> Result<Vec<u8>, ImageError> {
    let capacity = if claimed > 0 {
        claimed
    } else {
        // A block inflates at most about 255 times (one match byte per 255 output bytes).
        budget.min(input.len().saturating_mul(255).saturating_add(16))
    };
    let mut out = vec![0u8; capacity];
    let n =
        lz4_flex::block::decompress_into(input, &mut out).map_err(|e| ImageError::Decompress {
            codec: "lz4",
            reason: e.to_string(),
        })?;
    out.truncate(n);
    Ok(out)
}

fn read_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Builders of synthetic images, for tests here and in other crates.
pub mod synth {
    use super::*;

    /// One entry to put in a synthetic fatbin.
    #[derive(Debug)]
    pub struct Entry<'a> {
        /// 1 = PTX, 2 = ELF.
        pub kind: u16,
        /// SM architecture.
        pub sm_arch: u32,
        /// Flags.
        pub flags: u64,
        /// Payload bytes.
        pub payload: &'a [u8],
    }

    /// A fatbin with a 16-byte header and 64-byte entry headers, payloads padded to 8 bytes.
    pub fn fatbin(entries: &[Entry<'_>]) -> Vec<u8> {
        let mut body = Vec::new();
        for e in entries {
            let padded = e.payload.len().div_ceil(8) * 8;
            let mut h = [0u8; ENTRY_HEADER_BYTES];
            h[0..2].copy_from_slice(&e.kind.to_le_bytes());
            h[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
            h[4..8].copy_from_slice(&(ENTRY_HEADER_BYTES as u32).to_le_bytes());
            h[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
            h[28..32].copy_from_slice(&e.sm_arch.to_le_bytes());
            h[40..48].copy_from_slice(&e.flags.to_le_bytes());
            h[56..64].copy_from_slice(&(e.payload.len() as u64).to_le_bytes());
            body.extend_from_slice(&h);
            body.extend_from_slice(e.payload);
            body.resize(body.len() + padded - e.payload.len(), 0);
        }
        let mut out = Vec::new();
        out.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&(FATBIN_HEADER_BYTES as u16).to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// A minimal 64-bit little-endian ELF: header, `sections` (offset, size, type) and their table at the end.
    pub fn elf(sections: &[(u64, u64, u32)], file_len: usize) -> Vec<u8> {
        let shoff = file_len as u64;
        let mut out = vec![0u8; file_len];
        out[0..4].copy_from_slice(&ELF_MAGIC);
        out[4] = 2;
        out[5] = 1;
        out[40..48].copy_from_slice(&shoff.to_le_bytes());
        out[58..60].copy_from_slice(&64u16.to_le_bytes());
        out[60..62].copy_from_slice(&(sections.len() as u16).to_le_bytes());
        for &(offset, size, kind) in sections {
            let mut sh = [0u8; 64];
            sh[4..8].copy_from_slice(&kind.to_le_bytes());
            sh[24..32].copy_from_slice(&offset.to_le_bytes());
            sh[32..40].copy_from_slice(&size.to_le_bytes());
            out.extend_from_slice(&sh);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::synth::{Entry, elf, fatbin};
    use super::*;

    const PTX: &[u8] = b".version 8.0\n.target sm_90\n.address_size 64\n";

    #[test]
    fn ptx_text_is_sized_to_its_nul() {
        let mut text = PTX.to_vec();
        text.push(0);
        text.extend_from_slice(b"garbage after the NUL");
        assert_eq!(image_size_in(&text).unwrap(), PTX.len() + 1);
        // SAFETY: NUL-terminated.
        let size = unsafe { image_size(text.as_ptr().cast()) };
        assert_eq!(size.unwrap(), PTX.len() + 1);
    }

    #[test]
    fn fatbin_is_header_plus_fat_size() {
        let mut bin = fatbin(&[
            Entry {
                kind: 2,
                sm_arch: 90,
                flags: FLAG_64BIT,
                payload: b"\x7fELF-not-really",
            },
            Entry {
                kind: 1,
                sm_arch: 90,
                flags: FLAG_64BIT,
                payload: PTX,
            },
        ]);
        let len = bin.len();
        bin.extend_from_slice(&[0xAA; 100]); // bytes after the fatbin are not part of it
        assert_eq!(image_size_in(&bin).unwrap(), len);
        // SAFETY: a complete fatbin.
        assert_eq!(unsafe { image_size(bin.as_ptr().cast()) }.unwrap(), len);

        let parsed = Fatbin::parse(&bin).unwrap();
        assert_eq!(parsed.entries.len(), 2);
        assert_eq!(parsed.entries[0].kind, EntryKind::Elf);
        assert_eq!(parsed.entries[1].sm_arch, 90);
        assert_eq!(
            parsed.best_ptx(90).unwrap().ptx_text().unwrap().as_bytes(),
            PTX
        );
    }

    #[test]
    fn wrapper_is_followed_to_its_fatbin() {
        let bin = fatbin(&[Entry {
            kind: 1,
            sm_arch: 80,
            flags: 0,
            payload: PTX,
        }]);
        let mut wrapper = Vec::new();
        wrapper.extend_from_slice(&FATBIN_WRAPPER_MAGIC.to_le_bytes());
        wrapper.extend_from_slice(&1u32.to_le_bytes());
        wrapper.extend_from_slice(&(bin.as_ptr() as u64).to_le_bytes());
        wrapper.extend_from_slice(&0u64.to_le_bytes());
        // SAFETY: the wrapper points at a live fatbin.
        unsafe {
            assert_eq!(
                unwrap_fatbin_wrapper(wrapper.as_ptr().cast()).unwrap(),
                bin.as_ptr().cast()
            );
            assert_eq!(image_size(wrapper.as_ptr().cast()).unwrap(), bin.len());
        }
        wrapper[4] = 7;
        // SAFETY: as above.
        let bad = unsafe { unwrap_fatbin_wrapper(wrapper.as_ptr().cast()) };
        assert!(matches!(bad, Err(ImageError::Wrapper(_))));
    }

    #[test]
    fn wrappers_of_both_versions_are_read() {
        let own = fatbin(&[]);
        let a = fatbin(&[Entry {
            kind: 1,
            sm_arch: 75,
            flags: 0,
            payload: PTX,
        }]);
        let b = fatbin(&[Entry {
            kind: 1,
            sm_arch: 75,
            flags: 0,
            payload: PTX,
        }]);
        // -rdc: the wrapper's own fatbin is empty; the objects' fatbins come through the NULL-ended list.
        let list: [*const u8; 3] = [a.as_ptr(), b.as_ptr(), std::ptr::null()];
        let mut wrapper = Vec::new();
        wrapper.extend_from_slice(&FATBIN_WRAPPER_MAGIC.to_le_bytes());
        wrapper.extend_from_slice(&2u32.to_le_bytes());
        wrapper.extend_from_slice(&(own.as_ptr() as u64).to_le_bytes());
        wrapper.extend_from_slice(&(list.as_ptr() as u64).to_le_bytes());
        // SAFETY: the wrapper, its fatbin and its list are alive.
        let read = unsafe { read_wrapper(wrapper.as_ptr().cast()) }.unwrap();
        assert_eq!(read.version, 2);
        assert_eq!(read.fatbin, own.as_ptr());
        assert_eq!(read.prelinked, vec![a.as_ptr(), b.as_ptr()]);
        assert_eq!(Fatbin::parse(&own).unwrap().entries.len(), 0);
        // Version 1: the last field is a file name (or NULL), never followed.
        wrapper[4] = 1;
        // SAFETY: as above.
        let read = unsafe { read_wrapper(wrapper.as_ptr().cast()) }.unwrap();
        assert!(read.prelinked.is_empty());
        wrapper[0] = 0;
        // SAFETY: as above.
        assert!(unsafe { read_wrapper(wrapper.as_ptr().cast()) }.is_err());
        // SAFETY: NULL is checked first.
        let null = unsafe { read_wrapper(std::ptr::null()) };
        assert_eq!(null, Err(ImageError::Null));
    }

    #[test]
    fn elf_is_sized_by_its_furthest_extent() {
        // Sections up to 0x300; the section table (2 x 64 bytes) sits at 0x300 and ends at 0x380.
        let image = elf(&[(0x40, 0x100, 1), (0x140, 0x1c0, 1)], 0x300);
        assert_eq!(image_size_in(&image).unwrap(), 0x380);
        // SAFETY: the whole ELF is in the vector.
        assert_eq!(unsafe { image_size(image.as_ptr().cast()) }.unwrap(), 0x380);
        // A NOBITS section (.bss) claims no file bytes, even far away.
        let image = elf(&[(0x40, 0x100, 1), (0x10_0000, 0x1000, 8)], 0x200);
        assert_eq!(image_size_in(&image).unwrap(), 0x280);
    }

    #[test]
    fn lying_lengths_are_errors_not_panics() {
        let mut bin = fatbin(&[Entry {
            kind: 1,
            sm_arch: 90,
            flags: 0,
            payload: PTX,
        }]);
        // fat_size beyond the slice.
        bin[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(Fatbin::parse(&bin).is_err());
        assert!(matches!(
            image_size_in(&bin),
            Err(ImageError::Implausible(_))
        ));
        // Entry payload size beyond the fatbin.
        let mut bin = fatbin(&[Entry {
            kind: 1,
            sm_arch: 90,
            flags: 0,
            payload: PTX,
        }]);
        let at = FATBIN_HEADER_BYTES + 8;
        bin[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Fatbin::parse(&bin).is_err());
        // Truncated ELF.
        assert!(image_size_in(b"\x7fELF\x02\x01").is_err());
        // 32-bit ELF.
        let mut image = elf(&[], 64);
        image[4] = 1;
        assert_eq!(
            image_size_in(&image),
            Err(ImageError::Elf("not a 64-bit ELF"))
        );
        // Random bytes never panic.
        let mut seed = 0x1234_5678u32;
        for _ in 0..2000 {
            let mut bytes = fatbin(&[Entry {
                kind: 1,
                sm_arch: 90,
                flags: 0x2000,
                payload: PTX,
            }]);
            for b in bytes.iter_mut().skip(4) {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                if seed.is_multiple_of(7) {
                    *b = (seed >> 16) as u8;
                }
            }
            let _ = Fatbin::parse(&bytes);
            let _ = image_size_in(&bytes);
        }
    }

    #[test]
    fn compression_flags_are_reported() {
        let bin = fatbin(&[
            Entry {
                kind: 1,
                sm_arch: 90,
                flags: FLAG_COMPRESSED_ZSTD,
                payload: b"zz",
            },
            Entry {
                kind: 2,
                sm_arch: 90,
                flags: FLAG_COMPRESSED_LZ4,
                payload: b"ll",
            },
            Entry {
                kind: 1,
                sm_arch: 75,
                flags: 0,
                payload: PTX,
            },
        ]);
        let parsed = Fatbin::parse(&bin).unwrap();
        assert_eq!(parsed.entries[0].compression(), Compression::Zstd);
        assert_eq!(parsed.entries[1].compression(), Compression::Lz4);
        assert_eq!(parsed.entries[2].compression(), Compression::None);
        assert!(parsed.entries[0].ptx_text().is_none());
        // Best PTX at or below sm_80 is the sm_75 one.
        assert_eq!(parsed.best_ptx(80).unwrap().sm_arch, 75);
    }
}
