//! The kernels of a module image and the layout of their parameters, read on the client from the image
//! it holds, so that a launch never copies more from `kernelParams` than the kernel really takes, whatever
//! a serving peer claims.
//!
//! * PTX: every `.entry name(.param ..., ...)` declaration. A parameter's size is its type's (`.u8` 1 ...
//!   `.b64` 8) times its array length; its alignment the `.align` before the type (for arrays) or the
//!   type's size; offsets follow in declaration order, each aligned. In `.param .u64 .ptr .global .align
//!   16 p` the `.align` describes the pointee: the parameter itself is a `.u64`.
//! * cubin (ELF): entry functions are the `STT_FUNC` symbols marked `STO_CUDA_ENTRY`; each has a section
//!   `.nv.info.<name>` of `{u8 format, u8 attribute, u16 value}` records, where `EIATTR_KPARAM_INFO`
//!   records (one per parameter, 12-byte payload: index u32, ordinal u16, offset u16, flags u32 with the
//!   size in bits 18..32) give the layout and `EIATTR_PARAM_CBANK` the total.
//!
//! Nothing here trusts a length in the image: every read is bounds-checked, and sums use checked
//! arithmetic.

use std::collections::BTreeMap;

/// Largest parameter buffer CUDA accepts (12.1+ on Volta and later): a layout beyond it is refused.
pub const MAX_PARAM_BYTES: u32 = 32_764;
/// Most parameters a kernel may declare here (each takes at least one byte of the buffer).
pub const MAX_PARAMS: usize = MAX_PARAM_BYTES as usize;

/// One parameter's place in the packed buffer.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq, Hash)]
pub struct Param {
    /// Byte offset.
    pub offset: u32,
    /// Byte size.
    pub size: u32,
}

/// A kernel (entry function) of an image.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Kernel {
    /// Its symbol name (mangled for C++ kernels).
    pub name: String,
    /// Its parameters in declaration order.
    pub params: Vec<Param>,
}

impl Kernel {
    /// Bytes of the packed parameter buffer: the end of the last parameter (0 without parameters).
    pub fn params_bytes(&self) -> u32 {
        self.params
            .iter()
            .map(|p| p.offset.saturating_add(p.size))
            .max()
            .unwrap_or(0)
    }
}

/// The kernels of one image, by name.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Kernels {
    /// Name -> kernel.
    pub by_name: BTreeMap<String, Kernel>,
}

impl Kernels {
    /// The kernel called `name`.
    pub fn get(&self, name: &str) -> Option<&Kernel> {
        self.by_name.get(name)
    }

    /// How many kernels the image has.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether the image has no kernel.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

/// Why an image's kernels could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// The PTX text has a malformed `.entry` declaration.
    #[error("malformed PTX entry declaration{}: {what}", kernel.as_ref().map(|k| format!(" of {k}")).unwrap_or_default())]
    Ptx {
        /// The kernel, if its name was read.
        kernel: Option<String>,
        /// What is wrong.
        what: String,
    },
    /// The cubin's ELF structure is broken.
    #[error("malformed cubin: {0}")]
    Elf(&'static str),
    /// A kernel's parameters overlap, overflow or exceed CUDA's limit.
    #[error("kernel {kernel}: implausible parameter layout ({what})")]
    Layout {
        /// The kernel.
        kernel: String,
        /// What is wrong.
        what: &'static str,
    },
    /// Neither PTX text nor an ELF cubin.
    #[error("not a PTX or cubin image")]
    NotAnImage,
}

/// The kernels of an image: PTX text or an ELF cubin (a fatbin entry's decompressed payload, or a bare
/// image given to `cuModuleLoadData`).
pub fn kernels_of(image: &[u8]) -> Result<Kernels, LayoutError> {
    match crate::classify(image) {
        crate::ImageKind::Elf => cubin_kernels(image),
        crate::ImageKind::Ptx => {
            let end = image.iter().position(|&b| b == 0).unwrap_or(image.len());
            let text = std::str::from_utf8(&image[..end]).map_err(|_| LayoutError::Ptx {
                kernel: None,
                what: "not UTF-8".into(),
            })?;
            ptx_kernels(text)
        }
        _ => Err(LayoutError::NotAnImage),
    }
}

// --- PTX ------------------------------------------------------------------------------------------------

/// The `.entry` kernels of PTX text and their parameter layouts.
pub fn ptx_kernels(text: &str) -> Result<Kernels, LayoutError> {
    let text = strip_comments(text);
    let mut out = Kernels::default();
    let mut rest = text.as_str();
    while let Some(at) = find_directive(rest, ".entry") {
        rest = &rest[at + ".entry".len()..];
        let name_end = rest.find(['(', '{', ';']).ok_or_else(|| LayoutError::Ptx {
            kernel: None,
            what: "no parameter list or body after .entry".into(),
        })?;
        let name = rest[..name_end].trim().to_owned();
        if name.is_empty() || !name.chars().all(is_ident_char) {
            return Err(LayoutError::Ptx {
                kernel: None,
                what: format!("bad kernel name {name:?}"),
            });
        }
        let after = &rest[name_end..];
        let params = if after.starts_with('(') {
            let close = after.find(')').ok_or_else(|| LayoutError::Ptx {
                kernel: Some(name.clone()),
                what: "unclosed parameter list".into(),
            })?;
            let list = &after[1..close];
            rest = &after[close + 1..];
            ptx_params(&name, list)?
        } else {
            rest = after;
            Vec::new()
        };
        let kernel = Kernel { name, params };
        check_layout(&kernel)?;
        // A declaration (`.extern .entry`) and its definition describe the same kernel.
        out.by_name.insert(kernel.name.clone(), kernel);
    }
    Ok(out)
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '%' | '.')
}

/// The next `.entry` directive (a whole word) in `text`.
fn find_directive(text: &str, directive: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = text[from..].find(directive) {
        let at = from + i;
        let before_ok = at == 0 || !text[..at].ends_with(is_ident_char);
        let after = text[at + directive.len()..].chars().next();
        if before_ok && after.is_some_and(char::is_whitespace) {
            return Some(at);
        }
        from = at + directive.len();
    }
    None
}

/// PTX without `//` and `/* */` comments (string literals do not occur in declarations).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('/', Some('/')) => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            ('/', Some('*')) => {
                chars.next();
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out
}

/// One `.param` list: `.param [.align A] .type [.ptr .space [.align A']] name[[N]], ...`.
fn ptx_params(kernel: &str, list: &str) -> Result<Vec<Param>, LayoutError> {
    let bad = |what: String| LayoutError::Ptx {
        kernel: Some(kernel.to_owned()),
        what,
    };
    let mut params = Vec::new();
    let mut end = 0u32;
    for decl in list.split(',') {
        let words: Vec<&str> = decl.split_whitespace().collect();
        if words.is_empty() {
            continue;
        }
        if words.first() != Some(&".param") {
            return Err(bad(format!("parameter {decl:?} is not a .param")));
        }
        let mut align = None;
        let mut scalar = None;
        let mut name = None;
        let mut i = 1;
        while i < words.len() {
            let w = words[i];
            match w {
                ".align" => {
                    let a: u32 = words
                        .get(i + 1)
                        .and_then(|v| v.parse().ok())
                        .filter(|a: &u32| a.is_power_of_two())
                        .ok_or_else(|| bad(format!("bad .align in {decl:?}")))?;
                    // After `.ptr`, the alignment is the pointee's.
                    if scalar.is_none() {
                        align = Some(a);
                    }
                    i += 2;
                    continue;
                }
                ".ptr" | ".global" | ".const" | ".shared" | ".local" => {}
                _ if w.starts_with('.') => {
                    scalar = Some(
                        scalar_size(w)
                            .ok_or_else(|| bad(format!("unknown type {w} in {decl:?}")))?,
                    );
                }
                _ => name = Some(w),
            }
            i += 1;
        }
        let size = scalar.ok_or_else(|| bad(format!("no type in {decl:?}")))?;
        let name = name.ok_or_else(|| bad(format!("no name in {decl:?}")))?;
        let count = match name.split_once('[') {
            Some((_, dims)) => dims
                .strip_suffix(']')
                .and_then(|n| n.trim().parse::<u32>().ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("bad array length in {decl:?}")))?,
            None => 1,
        };
        let bytes = size
            .checked_mul(count)
            .filter(|&b| b <= MAX_PARAM_BYTES)
            .ok_or_else(|| bad(format!("parameter {name} is too large")))?;
        let align = align.unwrap_or(size).max(1);
        let offset = end
            .checked_next_multiple_of(align)
            .ok_or_else(|| bad("offsets overflow".into()))?;
        end = offset
            .checked_add(bytes)
            .ok_or_else(|| bad("offsets overflow".into()))?;
        params.push(Param {
            offset,
            size: bytes,
        });
        if params.len() > MAX_PARAMS {
            return Err(bad("too many parameters".into()));
        }
    }
    Ok(params)
}

/// Bytes of a PTX fundamental type.
fn scalar_size(ty: &str) -> Option<u32> {
    Some(match ty {
        ".u8" | ".s8" | ".b8" | ".pred" => 1,
        ".u16" | ".s16" | ".b16" | ".f16" | ".bf16" => 2,
        ".u32" | ".s32" | ".b32" | ".f32" | ".f16x2" | ".bf16x2" | ".tf32" => 4,
        ".u64" | ".s64" | ".b64" | ".f64" | ".texref" | ".samplerref" | ".surfref" => 8,
        ".b128" => 16,
        _ => return None,
    })
}

/// Parameters must not overlap and must fit CUDA's limit.
fn check_layout(kernel: &Kernel) -> Result<(), LayoutError> {
    let bad = |what| LayoutError::Layout {
        kernel: kernel.name.clone(),
        what,
    };
    let mut sorted: Vec<Param> = kernel.params.clone();
    sorted.sort_by_key(|p| p.offset);
    let mut end = 0u32;
    for p in &sorted {
        if p.offset < end {
            return Err(bad("parameters overlap"));
        }
        end = p
            .offset
            .checked_add(p.size)
            .ok_or_else(|| bad("parameter offsets overflow"))?;
    }
    if end > MAX_PARAM_BYTES {
        return Err(bad("more than 32,764 bytes of parameters"));
    }
    Ok(())
}

// --- cubin -----------------------------------------------------------------------------------------------

const SHT_SYMTAB: u32 = 2;
const STT_FUNC: u8 = 2;
/// `st_other` bit of a CUDA entry function (a kernel, launchable from the host).
const STO_CUDA_ENTRY: u8 = 0x10;
const EIFMT_NVAL: u8 = 1;
const EIFMT_BVAL: u8 = 2;
const EIFMT_HVAL: u8 = 3;
const EIFMT_SVAL: u8 = 4;
const EIATTR_PARAM_CBANK: u8 = 0x0a;
const EIATTR_KPARAM_INFO: u8 = 0x17;
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;

struct Section<'a> {
    name: &'a [u8],
    kind: u32,
    link: u32,
    data: &'a [u8],
}

/// The kernels of a 64-bit little-endian ELF cubin and their parameter layouts.
pub fn cubin_kernels(elf: &[u8]) -> Result<Kernels, LayoutError> {
    let sections = elf_sections(elf)?;
    let mut out = Kernels::default();
    for symtab in sections.iter().filter(|s| s.kind == SHT_SYMTAB) {
        let strtab = sections
            .get(symtab.link as usize)
            .ok_or(LayoutError::Elf("symbol table without string table"))?;
        for sym in symtab.data.chunks_exact(24) {
            let (info, other) = (sym[4], sym[5]);
            if info & 0xf != STT_FUNC || other & STO_CUDA_ENTRY == 0 {
                continue;
            }
            let name_at = u32::from_le_bytes([sym[0], sym[1], sym[2], sym[3]]) as usize;
            let name = c_str(strtab.data, name_at).ok_or(LayoutError::Elf("bad symbol name"))?;
            let name = std::str::from_utf8(name)
                .map_err(|_| LayoutError::Elf("symbol name is not UTF-8"))?
                .to_owned();
            let info_name = [b".nv.info.".as_slice(), name.as_bytes()].concat();
            let params = match sections.iter().find(|s| s.name == info_name.as_slice()) {
                Some(section) => nv_info_params(&name, section.data)?,
                // A kernel without parameters may have no attributes of its own.
                None => Vec::new(),
            };
            let kernel = Kernel { name, params };
            check_layout(&kernel)?;
            out.by_name.insert(kernel.name.clone(), kernel);
        }
    }
    Ok(out)
}

/// The parameters recorded in one `.nv.info.<kernel>` section.
fn nv_info_params(kernel: &str, data: &[u8]) -> Result<Vec<Param>, LayoutError> {
    let bad = |what| LayoutError::Layout {
        kernel: kernel.to_owned(),
        what,
    };
    let mut by_ordinal: BTreeMap<u16, Param> = BTreeMap::new();
    let mut total: Option<u32> = None;
    let mut at = 0usize;
    while at + 4 <= data.len() {
        let (format, attribute) = (data[at], data[at + 1]);
        let value = u16::from_le_bytes([data[at + 2], data[at + 3]]);
        at += 4;
        let payload = match format {
            EIFMT_NVAL | EIFMT_BVAL | EIFMT_HVAL => &[][..],
            EIFMT_SVAL => {
                let end = at
                    .checked_add(value as usize)
                    .filter(|&e| e <= data.len())
                    .ok_or(LayoutError::Elf(".nv.info record past the end"))?;
                let p = &data[at..end];
                at = end;
                p
            }
            _ => return Err(LayoutError::Elf("unknown .nv.info record format")),
        };
        match (attribute, format) {
            (EIATTR_KPARAM_INFO, EIFMT_SVAL) if payload.len() >= 12 => {
                let ordinal = u16::from_le_bytes([payload[4], payload[5]]);
                let offset = u16::from_le_bytes([payload[6], payload[7]]);
                let flags = u32::from_le_bytes([payload[8], payload[9], payload[10], payload[11]]);
                let size = (flags >> 18) & 0x3fff;
                let param = Param {
                    offset: u32::from(offset),
                    size,
                };
                if by_ordinal.insert(ordinal, param).is_some() {
                    return Err(bad("a parameter is described twice"));
                }
            }
            (EIATTR_PARAM_CBANK, EIFMT_SVAL) if payload.len() >= 8 => {
                total = Some(u32::from(u16::from_le_bytes([payload[6], payload[7]])));
            }
            (EIATTR_CBANK_PARAM_SIZE, EIFMT_HVAL) => total = total.or(Some(u32::from(value))),
            _ => {}
        }
    }
    // Ordinals must be 0..n without gaps.
    if by_ordinal
        .keys()
        .enumerate()
        .any(|(i, &o)| i != usize::from(o))
    {
        return Err(bad("parameter ordinals have gaps"));
    }
    let params: Vec<Param> = by_ordinal.into_values().collect();
    let end = params
        .iter()
        .map(|p| p.offset.checked_add(p.size))
        .try_fold(0u32, |m, e| e.map(|e| m.max(e)))
        .ok_or_else(|| bad("parameter offsets overflow"))?;
    if let Some(total) = total
        && end > total
    {
        return Err(bad("parameters extend past the parameter bank"));
    }
    Ok(params)
}

fn c_str(bytes: &[u8], at: usize) -> Option<&[u8]> {
    let rest = bytes.get(at..)?;
    let end = rest.iter().position(|&b| b == 0)?;
    Some(&rest[..end])
}

fn elf_sections(elf: &[u8]) -> Result<Vec<Section<'_>>, LayoutError> {
    let u16_at = |at: usize| {
        elf.get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u64_at = |b: &[u8], at: usize| {
        b.get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    let u32_at = |b: &[u8], at: usize| {
        b.get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    if elf.len() < 64 || !elf.starts_with(b"\x7fELF") || elf[4] != 2 || elf[5] != 1 {
        return Err(LayoutError::Elf("not a 64-bit little-endian ELF"));
    }
    let shoff = u64_at(elf, 40).ok_or(LayoutError::Elf("truncated header"))? as usize;
    let shentsize = u16_at(58).ok_or(LayoutError::Elf("truncated header"))? as usize;
    let shnum = u16_at(60).ok_or(LayoutError::Elf("truncated header"))? as usize;
    let shstrndx = u16_at(62).ok_or(LayoutError::Elf("truncated header"))? as usize;
    if shnum == 0 {
        return Ok(Vec::new());
    }
    if shentsize < 64 {
        return Err(LayoutError::Elf("section headers below 64 bytes"));
    }
    let table = shoff
        .checked_add(shnum * shentsize)
        .and_then(|end| elf.get(shoff..end))
        .ok_or(LayoutError::Elf("section headers past the end"))?;
    let mut raw = Vec::with_capacity(shnum);
    for h in table.chunks_exact(shentsize) {
        let name = u32_at(h, 0).unwrap_or(0);
        let kind = u32_at(h, 4).unwrap_or(0);
        let offset = u64_at(h, 24).unwrap_or(0);
        let size = u64_at(h, 32).unwrap_or(0);
        let link = u32_at(h, 40).unwrap_or(0);
        let data = if kind == 8 {
            &[][..] // SHT_NOBITS
        } else {
            usize::try_from(offset)
                .ok()
                .zip(usize::try_from(size).ok())
                .and_then(|(o, s)| elf.get(o..o.checked_add(s)?))
                .ok_or(LayoutError::Elf("section data past the end"))?
        };
        raw.push((name, kind, link, data));
    }
    let names = raw
        .get(shstrndx)
        .map(|s| s.3)
        .ok_or(LayoutError::Elf("no section name table"))?;
    raw.into_iter()
        .map(|(name, kind, link, data)| {
            Ok(Section {
                name: c_str(names, name as usize).ok_or(LayoutError::Elf("bad section name"))?,
                kind,
                link,
                data,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(k: &Kernel) -> Vec<(u32, u32)> {
        k.params.iter().map(|p| (p.offset, p.size)).collect()
    }

    #[test]
    fn ptx_params_follow_types_alignment_and_arrays() {
        let ptx = r"
            .version 9.0
            .target sm_75
            // .entry commented_out(.param .u32 x)
            .visible .entry mixed(
                .param .u8 mixed_param_0,
                .param .align 16 .b8 mixed_param_1[16], /* a struct */
                .param .u64 .ptr .global .align 16 mixed_param_2,
                .param .u16 mixed_param_3,
                .param .f64 mixed_param_4
            )
            .maxntid 128, 1, 1
            { ret; }
            .entry empty() { ret; }
            .weak .entry bare { ret; }
        ";
        let k = ptx_kernels(ptx).unwrap();
        assert_eq!(k.len(), 3);
        let mixed = k.get("mixed").unwrap();
        assert_eq!(layout(mixed), [(0, 1), (16, 16), (32, 8), (40, 2), (48, 8)]);
        assert_eq!(mixed.params_bytes(), 56);
        assert!(k.get("empty").unwrap().params.is_empty());
        assert!(k.get("bare").unwrap().params.is_empty());
        assert!(k.get("commented_out").is_none());
    }

    #[test]
    fn malformed_ptx_is_an_error_not_a_guess() {
        for bad in [
            ".entry k(.param .u32 a",
            ".entry k(.param .u33 a)",
            ".entry k(.param .align 3 .b8 a[4])",
            ".entry k(.param .b8 a[0])",
            ".entry k(.param .b8 a[40000])",
            ".entry k(.reg .u32 a)",
        ] {
            assert!(ptx_kernels(bad).is_err(), "{bad}");
        }
        // Many parameters that together exceed the limit.
        let many: Vec<String> = (0..5000).map(|i| format!(".param .u64 p{i}")).collect();
        let text = format!(".entry k({})", many.join(","));
        assert!(matches!(
            ptx_kernels(&text),
            Err(LayoutError::Layout { .. })
        ));
    }

    #[test]
    fn nv_info_records_give_the_layout() {
        // KPARAM_INFO for ordinals 1 and 0 (reverse order, as ptxas writes them), then PARAM_CBANK.
        let mut info = Vec::new();
        let kparam = |ordinal: u16, offset: u16, size: u32| {
            let mut r = vec![EIFMT_SVAL, EIATTR_KPARAM_INFO, 12, 0];
            r.extend_from_slice(&0u32.to_le_bytes());
            r.extend_from_slice(&ordinal.to_le_bytes());
            r.extend_from_slice(&offset.to_le_bytes());
            r.extend_from_slice(&((size << 18) | 0x1f000).to_le_bytes());
            r
        };
        info.extend(kparam(1, 8, 4));
        info.extend(kparam(0, 0, 8));
        info.extend([EIFMT_SVAL, EIATTR_PARAM_CBANK, 8, 0]);
        info.extend_from_slice(&[5, 0, 0, 0, 0x10, 0x02, 12, 0]);
        info.extend([EIFMT_HVAL, EIATTR_CBANK_PARAM_SIZE, 12, 0]);
        let params = nv_info_params("k", &info).unwrap();
        assert_eq!(
            params,
            [Param { offset: 0, size: 8 }, Param { offset: 8, size: 4 }]
        );
        // A record that claims more bytes than the section has.
        let mut short = info.clone();
        short.extend([EIFMT_SVAL, EIATTR_KPARAM_INFO, 200, 0]);
        assert!(nv_info_params("k", &short).is_err());
        // A parameter past the bank's end.
        let mut past = kparam(0, 0, 8);
        past.extend(kparam(1, 8, 64));
        past.extend([EIFMT_SVAL, EIATTR_PARAM_CBANK, 8, 0]);
        past.extend_from_slice(&[5, 0, 0, 0, 0x10, 0x02, 12, 0]);
        assert!(nv_info_params("k", &past).is_err());
    }
}
