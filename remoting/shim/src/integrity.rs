//! The answer to the CUDA runtime's integrity check (export table `D4082055-BDE6-704B-8D34-BA123C66E1F2`,
//! slot 1): a pure function of what the runtime and the driver can both observe.
//!
//! The runtime calls `check(version: u32, unix_seconds: u64, out: *mut [u8; 16]) -> CUresult` and compares the
//! 16 bytes against its own computation; on a mismatch every runtime call fails with
//! `cudaErrorSoftwareValidityNotEstablished` (103). The algorithm, as documented by two independent public
//! reimplementations (ZLUDA `dark_api/src/lib.rs::integrity_check`, LUPINE `client.cpp::lupine_integrity_check`;
//! see `docs/dark-api.md`), is HMAC (RFC 2104) over MD2 (RFC 1319, 16-byte blocks) with a fixed 16-byte key:
//!
//! * `version % 10 == 0` and `== 1` answer fixed digests (older runtimes' protocol);
//! * otherwise the message is a 48-byte record (driver version, `version`, pid, the low 32 bits of
//!   `pthread_self()`, the addresses of the driver's CUDART_INTERFACE table, of the integrity-check table and of
//!   the check function itself, `unix_seconds`; little-endian, in that order), followed for each device in
//!   ordinal order by its UUID (16 bytes) and its PCI domain, bus and device ids (three `i32`).
//!
//! For remoting, the devices are the serving peer's (its UUIDs and PCI ids, fetched at init), while the
//! addresses, pid and thread are the client process's own: the runtime hashes what it sees locally.
//!
//! Wired into a scratch build of the shim, this digest was accepted by the CUDA 13.0 runtime (static and
//! torch's dynamic one; `docs/pytorch-local.md`). `tools/gpu/integrity_probe.c` records NVIDIA's own answers
//! with every input; the fixture test below replays them through [`digest`].

/// One device as the hash sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceIdentity {
    /// `cuDeviceGetUuid_v2` bytes.
    pub uuid: [u8; 16],
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID` (50).
    pub pci_domain: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID` (33).
    pub pci_bus: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID` (34).
    pub pci_device: i32,
}

/// Everything the digest depends on.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// First argument of the check (the runtime's protocol version; its last decimal digit picks the mode).
    pub version: u32,
    /// Second argument of the check.
    pub unix_seconds: u64,
    /// What `cuDriverGetVersion` reports (e.g. 13000).
    pub driver_version: u32,
    /// `getpid()` of the process answering.
    pub pid: u32,
    /// The low 32 bits of `pthread_self()` of the calling thread.
    pub thread: u32,
    /// Address of the CUDART_INTERFACE table (`6BD5FB6C-...`) that `cuGetExportTable` hands out.
    pub cudart_table: u64,
    /// Address of the integrity-check table (`D4082055-...`).
    pub integrity_table: u64,
    /// Address of the check function (slot 1 of the integrity-check table).
    pub check_fn: u64,
    /// Every visible device, in ordinal order.
    pub devices: &'a [DeviceIdentity],
}

/// The HMAC key (the first pass of the algorithm uses no input, so its result is this constant).
const KEY: [u8; 16] = [
    0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52, 0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F,
];

/// Fixed answers for `version % 10` of 0 and 1, as two little-endian u64 words.
const FIXED_MODE_0: [u64; 2] = [0x3341_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8];
const FIXED_MODE_1: [u64; 2] = [0x1841_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8];

/// The 16 bytes the check writes to its out-pointer.
pub fn digest(inputs: &Inputs<'_>) -> [u8; 16] {
    match inputs.version % 10 {
        0 => return words_to_bytes(FIXED_MODE_0),
        1 => return words_to_bytes(FIXED_MODE_1),
        _ => {}
    }
    let mut inner = Md2::new();
    inner.update(&KEY.map(|b| b ^ 0x36));
    inner.update(&record(inputs));
    for device in inputs.devices {
        inner.update(&device_record(device));
    }
    let inner = inner.finish();
    let mut outer = Md2::new();
    outer.update(&KEY.map(|b| b ^ 0x5c));
    outer.update(&inner);
    outer.finish()
}

/// The 48-byte record that follows the key block.
fn record(inputs: &Inputs<'_>) -> [u8; 48] {
    let mut out = [0u8; 48];
    out[0..4].copy_from_slice(&inputs.driver_version.to_le_bytes());
    out[4..8].copy_from_slice(&inputs.version.to_le_bytes());
    out[8..12].copy_from_slice(&inputs.pid.to_le_bytes());
    out[12..16].copy_from_slice(&inputs.thread.to_le_bytes());
    out[16..24].copy_from_slice(&inputs.cudart_table.to_le_bytes());
    out[24..32].copy_from_slice(&inputs.integrity_table.to_le_bytes());
    out[32..40].copy_from_slice(&inputs.check_fn.to_le_bytes());
    out[40..48].copy_from_slice(&inputs.unix_seconds.to_le_bytes());
    out
}

fn device_record(device: &DeviceIdentity) -> [u8; 28] {
    let mut out = [0u8; 28];
    out[0..16].copy_from_slice(&device.uuid);
    out[16..20].copy_from_slice(&device.pci_domain.to_le_bytes());
    out[20..24].copy_from_slice(&device.pci_bus.to_le_bytes());
    out[24..28].copy_from_slice(&device.pci_device.to_le_bytes());
    out
}

fn words_to_bytes(words: [u64; 2]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&words[0].to_le_bytes());
    out[8..].copy_from_slice(&words[1].to_le_bytes());
    out
}

/// MD2 (RFC 1319): 16-byte blocks, a 48-byte state mixed 18 rounds per block, and a running checksum that is
/// hashed as a last block.
#[derive(Clone)]
struct Md2 {
    /// Hash state (16 bytes), the block being compressed (16) and their XOR (16).
    x: [u8; 48],
    checksum: [u8; 16],
    block: [u8; 16],
    filled: usize,
}

impl Md2 {
    fn new() -> Self {
        Self {
            x: [0; 48],
            checksum: [0; 16],
            block: [0; 16],
            filled: 0,
        }
    }

    fn update(&mut self, data: &[u8]) {
        for &byte in data {
            self.block[self.filled] = byte;
            self.filled += 1;
            if self.filled == 16 {
                let block = self.block;
                self.compress(&block);
                self.filled = 0;
            }
        }
    }

    fn finish(mut self) -> [u8; 16] {
        // Pad with n bytes of value n (1..=16) to a whole block, then hash the checksum as a block.
        let pad = (16 - self.filled) as u8;
        self.update(&vec![pad; pad as usize]);
        let checksum = self.checksum;
        self.compress_without_checksum(&checksum);
        let mut out = [0u8; 16];
        out.copy_from_slice(&self.x[..16]);
        out
    }

    fn compress(&mut self, block: &[u8; 16]) {
        // The checksum is updated from the block before the block is mixed in (the RFC's errata form:
        // C[j] ^= S[M[j] ^ L]).
        let mut last = self.checksum[15];
        for (c, &m) in self.checksum.iter_mut().zip(block) {
            *c ^= PI_SUBST[usize::from(m ^ last)];
            last = *c;
        }
        self.compress_without_checksum(block);
    }

    fn compress_without_checksum(&mut self, block: &[u8; 16]) {
        for (i, &m) in block.iter().enumerate() {
            self.x[16 + i] = m;
            self.x[32 + i] = self.x[i] ^ m;
        }
        let mut t = 0u8;
        for round in 0..18u8 {
            for x in self.x.iter_mut() {
                *x ^= PI_SUBST[usize::from(t)];
                t = *x;
            }
            t = t.wrapping_add(round);
        }
    }
}

/// MD2's substitution table (RFC 1319, section 3.2: a permutation of 0..=255 built from the digits of pi).
const PI_SUBST: [u8; 256] = [
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199,
    115, 140, 152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66,
    111, 24, 138, 23, 229, 18, 190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47,
    238, 122, 169, 104, 121, 145, 21, 178, 7, 63, 148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93,
    154, 90, 144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3, 255, 25, 48, 179, 72, 165, 181, 209,
    215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182, 118, 252, 107, 226,
    156, 116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2, 27,
    96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81,
    175, 58, 195, 92, 249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205,
    244, 65, 129, 77, 82, 106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74,
    120, 136, 149, 139, 227, 99, 232, 109, 233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14,
    102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10, 49, 68, 80, 180, 143, 237, 31, 26,
    219, 153, 141, 51, 159, 17, 131, 20,
];

/// Reading the fixture that `tools/gpu/integrity_probe.c` writes (one `key value...` per line).
pub mod fixture {
    use super::{DeviceIdentity, Inputs};

    /// One recorded call of NVIDIA's check.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Case {
        /// First argument.
        pub version: u32,
        /// Second argument.
        pub unix_seconds: u64,
        /// What the call returned.
        pub result: u32,
        /// The 16 bytes it wrote.
        pub out: [u8; 16],
        /// `pthread_self()` of the calling thread, when not the main one (`pthread_self` below).
        pub thread: Option<u64>,
    }

    /// A parsed fixture: the inputs common to every case, and the cases.
    #[derive(Clone, Debug, Default)]
    pub struct Fixture {
        /// `cuDriverGetVersion`.
        pub driver_version: u32,
        /// `getpid()` of the probe.
        pub pid: u32,
        /// `pthread_self()` of the calling thread (full width).
        pub pthread_self: u64,
        /// `syscall(SYS_gettid)` (recorded in case the driver hashes that instead).
        pub gettid: u32,
        /// CUDART_INTERFACE table address.
        pub cudart_table: u64,
        /// Integrity table address.
        pub integrity_table: u64,
        /// Check function address.
        pub check_fn: u64,
        /// Devices in ordinal order.
        pub devices: Vec<DeviceIdentity>,
        /// Recorded calls.
        pub cases: Vec<Case>,
    }

    impl Fixture {
        /// The inputs of one case, with the thread taken as the low 32 bits of `pthread_self()`.
        pub fn inputs(&self, case: &Case) -> Inputs<'_> {
            Inputs {
                version: case.version,
                unix_seconds: case.unix_seconds,
                driver_version: self.driver_version,
                pid: self.pid,
                thread: case.thread.unwrap_or(self.pthread_self) as u32,
                cudart_table: self.cudart_table,
                integrity_table: self.integrity_table,
                check_fn: self.check_fn,
                devices: &self.devices,
            }
        }

        /// Parses the probe's output. Lines starting with `#` and unknown keys are ignored.
        pub fn parse(text: &str) -> Result<Self, String> {
            let mut fixture = Self::default();
            for (n, line) in text.lines().enumerate() {
                let words: Vec<&str> = line.split_whitespace().collect();
                let at = |i: usize| {
                    words
                        .get(i)
                        .copied()
                        .ok_or_else(|| format!("line {}: too few fields", n + 1))
                };
                match words.first().copied() {
                    None | Some("#") => {}
                    Some(w) if w.starts_with('#') => {}
                    Some("driver_version") => fixture.driver_version = number(at(1)?)? as u32,
                    Some("pid") => fixture.pid = number(at(1)?)? as u32,
                    Some("pthread_self") => fixture.pthread_self = number(at(1)?)?,
                    Some("gettid") => fixture.gettid = number(at(1)?)? as u32,
                    Some("cudart_table") => fixture.cudart_table = number(at(1)?)?,
                    Some("integrity_table") => fixture.integrity_table = number(at(1)?)?,
                    Some("check_fn") => fixture.check_fn = number(at(1)?)?,
                    // device ORDINAL uuid HEX32 domain D bus B device V
                    Some("device") => fixture.devices.push(DeviceIdentity {
                        uuid: hex16(at(3)?)?,
                        pci_domain: number(at(5)?)? as i32,
                        pci_bus: number(at(7)?)? as i32,
                        pci_device: number(at(9)?)? as i32,
                    }),
                    // case version V seconds S result R out HEX32 [thread 0xX]
                    Some("case") => fixture.cases.push(Case {
                        version: number(at(2)?)? as u32,
                        unix_seconds: number(at(4)?)?,
                        result: number(at(6)?)? as u32,
                        out: hex16(at(8)?)?,
                        thread: match words.get(9) {
                            Some(&"thread") => Some(number(at(10)?)?),
                            _ => None,
                        },
                    }),
                    Some(_) => {}
                }
            }
            if fixture.cases.is_empty() {
                return Err("the fixture records no case".into());
            }
            Ok(fixture)
        }
    }

    fn number(word: &str) -> Result<u64, String> {
        let parsed = match word.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => word.parse(),
        };
        parsed.map_err(|e| format!("{word:?} is not a number: {e}"))
    }

    fn hex16(word: &str) -> Result<[u8; 16], String> {
        let bytes = word.as_bytes();
        if bytes.len() != 32 {
            return Err(format!("{word:?} is not 32 hex digits"));
        }
        let mut out = [0u8; 16];
        for (i, pair) in bytes.chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).map_err(|e| e.to_string())?;
            out[i] = u8::from_str_radix(text, 16).map_err(|e| format!("{word:?}: {e}"))?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn md2(data: &[u8]) -> String {
        let mut h = Md2::new();
        h.update(data);
        hex(&h.finish())
    }

    #[test]
    fn md2_matches_the_rfc_test_suite() {
        // RFC 1319, appendix A.5.
        assert_eq!(md2(b""), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(md2(b"a"), "32ec01ec4a6dac72c0ab96fb34c0b5d1");
        assert_eq!(md2(b"abc"), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(md2(b"message digest"), "ab4f496bfb2a530b219ff33031fe06b0");
        assert_eq!(
            md2(b"abcdefghijklmnopqrstuvwxyz"),
            "4e8ddff3650292ab5a4108c3aa47940b"
        );
        assert_eq!(
            md2(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"),
            "da33def2a42df13975352846c30338cd"
        );
        assert_eq!(
            md2("1234567890".repeat(8).as_bytes()),
            "d5976f79d83d3a0dc9806c3c66f3efd8"
        );
    }

    #[test]
    fn pi_subst_is_a_permutation() {
        let mut seen = [false; 256];
        for &b in &PI_SUBST {
            assert!(!seen[usize::from(b)], "{b} appears twice");
            seen[usize::from(b)] = true;
        }
    }

    /// ZLUDA's unit tests (`dark_api/src/lib.rs`, tests `integrity_check_pass2` and `_pass3`) publish the
    /// MD2 state after the key block and after a recorded 48-byte record; matching them pins the record's
    /// field order and widths.
    #[test]
    fn intermediate_states_match_the_published_ones() {
        let mut h = Md2::new();
        h.update(&KEY.map(|b| b ^ 0x36));
        assert_eq!(hex(&h.x[..16]), "8b219a49e86d1aeef237f9b54a8c3c75");
        assert_eq!(hex(&h.checksum), "57a110860e60441e705f67d1eb67a13d");
        let inputs = Inputs {
            version: 12082,
            unix_seconds: 0x682b_9cee,
            driver_version: 12080,
            pid: 0x002f_a423,
            thread: 0xf79c_1000,
            cudart_table: 0x7fff_f695_8240,
            integrity_table: 0x7fff_f695_8220,
            check_fn: 0x7fff_f2aa_f4a0,
            devices: &[],
        };
        h.update(&record(&inputs));
        assert_eq!(h.filled, 0);
        assert_eq!(hex(&h.x[..16]), "0afdabc9ff9ba0be4d303282744fa748");
        assert_eq!(hex(&h.checksum), "6428d9e1d434c0a94988c96158dd6674");
    }

    #[test]
    fn modes_0_and_1_are_fixed() {
        let mut inputs = Inputs {
            version: 13000,
            unix_seconds: 1,
            driver_version: 13000,
            pid: 1,
            thread: 2,
            cudart_table: 3,
            integrity_table: 4,
            check_fn: 5,
            devices: &[],
        };
        assert_eq!(hex(&digest(&inputs)), "5c67cb031c184133e8d14c1faa83d38e");
        inputs.pid = 99;
        assert_eq!(hex(&digest(&inputs)), "5c67cb031c184133e8d14c1faa83d38e");
        inputs.version = 12341;
        assert_eq!(hex(&digest(&inputs)), "5c67cb031c184118e8d14c1faa83d38e");
    }

    #[test]
    fn every_input_changes_the_hashed_modes() {
        let device = DeviceIdentity {
            uuid: [7; 16],
            pci_domain: 0,
            pci_bus: 0x19,
            pci_device: 0,
        };
        let devices = [device];
        let base = Inputs {
            version: 13002,
            unix_seconds: 1_767_225_600,
            driver_version: 13000,
            pid: 4242,
            thread: 0xdead_b000,
            cudart_table: 0x7f00_0000_1000,
            integrity_table: 0x7f00_0000_2000,
            check_fn: 0x7f00_0000_3000,
            devices: &devices,
        };
        let reference = digest(&base);
        assert_eq!(reference, digest(&base), "deterministic");
        let other_device = [DeviceIdentity {
            pci_bus: 0x1a,
            ..device
        }];
        let variants = [
            Inputs {
                version: 13003,
                ..base
            },
            Inputs {
                unix_seconds: base.unix_seconds + 1,
                ..base
            },
            Inputs {
                driver_version: 12090,
                ..base
            },
            Inputs { pid: 4243, ..base },
            Inputs {
                thread: base.thread + 1,
                ..base
            },
            Inputs {
                cudart_table: base.cudart_table + 8,
                ..base
            },
            Inputs {
                integrity_table: base.integrity_table + 8,
                ..base
            },
            Inputs {
                check_fn: base.check_fn + 16,
                ..base
            },
            Inputs {
                devices: &other_device,
                ..base
            },
            Inputs {
                devices: &[],
                ..base
            },
        ];
        for v in &variants {
            assert_ne!(digest(v), reference, "{v:?} gave the same digest");
        }
    }

    #[test]
    fn fixture_parser_reads_the_probe_format() {
        let text = "# integrity_probe\ndriver_version 13000\npid 77\npthread_self 0x7f00deadb000\n\
                    gettid 78\ncudart_table 0x7f0000001000\nintegrity_table 0x7f0000002000\n\
                    check_fn 0x7f0000003000\n\
                    device 0 uuid 000102030405060708090a0b0c0d0e0f domain 0 bus 25 device 0\n\
                    case version 13000 seconds 1767225600 result 0 out 5c67cb031c184133e8d14c1faa83d38e\n\
                    case version 13001 seconds 1 result 0 out 5c67cb031c184118e8d14c1faa83d38e thread 0x7f0012345000\n";
        let f = fixture::Fixture::parse(text).unwrap();
        assert_eq!(f.pid, 77);
        assert_eq!(f.devices[0].pci_bus, 25);
        assert_eq!(f.devices[0].uuid[15], 15);
        let case = &f.cases[0];
        assert_eq!(f.inputs(case).thread, 0xdead_b000);
        assert_eq!(digest(&f.inputs(case)), case.out);
        assert_eq!(f.inputs(&f.cases[1]).thread, 0x1234_5000);
        assert_eq!(digest(&f.inputs(&f.cases[1])), f.cases[1].out);
        assert!(fixture::Fixture::parse("pid 1\n").is_err());
    }

    /// Replays NVIDIA's answers recorded on the GPU machine. Enabled by the shim's build script once
    /// `tests/fixtures/integrity-fixture.txt` exists; until then it shows as ignored, never as passed.
    #[test]
    #[cfg_attr(
        not(gleam_integrity_fixture),
        ignore = "no fixture yet: record remoting/shim/tests/fixtures/integrity-fixture.txt on the GPU machine \
                  with tools/gpu/integrity_probe.c (scripts/gpu/integrity-probe.sh)"
    )]
    fn replays_the_real_drivers_answers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/integrity-fixture.txt"
        );
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("cannot read {path}: {e} (record it with the probe)"));
        let fixture = fixture::Fixture::parse(&text).unwrap();
        assert!(!fixture.devices.is_empty(), "the fixture lists no device");
        let mut failures = Vec::new();
        for case in &fixture.cases {
            if case.result != 0 {
                continue; // the driver refused this version; nothing to compare
            }
            let ours = digest(&fixture.inputs(case));
            if ours != case.out {
                failures.push(format!(
                    "version {} seconds {}: driver {} ours {}",
                    case.version,
                    case.unix_seconds,
                    hex(&case.out),
                    hex(&ours)
                ));
            }
        }
        assert!(
            fixture.cases.iter().any(|c| c.result == 0),
            "the driver answered no case"
        );
        assert!(
            failures.is_empty(),
            "digest differs from NVIDIA's (gettid was {}):\n{}",
            fixture.gettid,
            failures.join("\n")
        );
    }
}
