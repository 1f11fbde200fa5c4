//! Which fatbin entries a GPU can run: CUDA's binary and PTX compatibility rules.
//!
//! * A cubin (SASS) built for `sm_XY` runs on a GPU of compute capability X.Z with Z >= Y: same major, equal
//!   or later minor. An architecture-specific cubin (`sm_90a`) runs only on exactly X.Y; a family-specific
//!   one (`sm_100f`) on X.Y and later minors of the same major.
//! * PTX for `compute_XY` is JIT-compiled by the driver for any GPU of capability >= X.Y, across majors;
//!   arch-specific PTX (`compute_90a`) only for exactly X.Y, family-specific PTX only within its major.
//!
//! When several entries fit, [`SmArch::preference`] orders them: the nearest minor (or, for PTX, the highest
//! virtual architecture) first, and among equals the most specific target (`a`, then `f`, then plain), which
//! is what the build asked for on that GPU **[inferred: NVIDIA does not document the driver's tie-break]**.

use std::fmt;

/// A GPU's compute capability, e.g. 9.0 for an H100/H200.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeCapability {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl ComputeCapability {
    /// From `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`/`_MINOR`.
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// How specific a target is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ArchVariant {
    /// `sm_90` / `compute_90`.
    Generic,
    /// `sm_100f` / `compute_100f` (flag [`crate::FLAG_FAMILY_SPECIFIC`]).
    FamilySpecific,
    /// `sm_90a` / `compute_90a` (flag [`crate::FLAG_ARCH_SPECIFIC`]).
    ArchSpecific,
}

/// The architecture a fatbin entry targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SmArch {
    /// Major version (the entry's `sm_arch / 10`).
    pub major: u32,
    /// Minor version (`sm_arch % 10`).
    pub minor: u32,
    /// Plain, family- or arch-specific.
    pub variant: ArchVariant,
}

impl SmArch {
    /// From an entry's `sm_arch` field (10 * major + minor) and flags.
    pub fn from_entry(sm_arch: u32, flags: u64) -> Self {
        let variant = if flags & crate::FLAG_ARCH_SPECIFIC != 0 {
            ArchVariant::ArchSpecific
        } else if flags & crate::FLAG_FAMILY_SPECIFIC != 0 {
            ArchVariant::FamilySpecific
        } else {
            ArchVariant::Generic
        };
        Self {
            major: sm_arch / 10,
            minor: sm_arch % 10,
            variant,
        }
    }

    /// Whether SASS built for this architecture runs on `cc` unchanged.
    pub fn cubin_runs_on(&self, cc: ComputeCapability) -> bool {
        if self.major != cc.major || self.minor > cc.minor {
            return false;
        }
        match self.variant {
            ArchVariant::ArchSpecific => self.minor == cc.minor,
            ArchVariant::FamilySpecific | ArchVariant::Generic => true,
        }
    }

    /// Whether PTX for this virtual architecture can be JIT-compiled for `cc`.
    pub fn ptx_runs_on(&self, cc: ComputeCapability) -> bool {
        match self.variant {
            ArchVariant::Generic => (self.major, self.minor) <= (cc.major, cc.minor),
            ArchVariant::FamilySpecific => self.major == cc.major && self.minor <= cc.minor,
            ArchVariant::ArchSpecific => self.major == cc.major && self.minor == cc.minor,
        }
    }

    /// Orders candidates that all run on one GPU: higher is better.
    pub fn preference(&self) -> (u32, u32, ArchVariant) {
        (self.major, self.minor, self.variant)
    }
}

impl fmt::Display for SmArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let suffix = match self.variant {
            ArchVariant::Generic => "",
            ArchVariant::FamilySpecific => "f",
            ArchVariant::ArchSpecific => "a",
        };
        write!(f, "sm_{}{}{}", self.major, self.minor, suffix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn cc(major: u32, minor: u32) -> ComputeCapability {
        ComputeCapability::new(major, minor)
    }

    #[test]
    fn cubins_run_within_their_major_and_later_minors() {
        let sm86 = SmArch::from_entry(86, 0);
        assert!(sm86.cubin_runs_on(cc(8, 6)));
        assert!(sm86.cubin_runs_on(cc(8, 9)));
        assert!(!sm86.cubin_runs_on(cc(8, 0)));
        assert!(!sm86.cubin_runs_on(cc(9, 0)));
        let sm90a = SmArch::from_entry(90, crate::FLAG_ARCH_SPECIFIC);
        assert_eq!(sm90a.to_string(), "sm_90a");
        assert!(sm90a.cubin_runs_on(cc(9, 0)));
        let sm100a = SmArch::from_entry(100, crate::FLAG_ARCH_SPECIFIC);
        assert!(!sm100a.cubin_runs_on(cc(10, 3)));
        let sm100f = SmArch::from_entry(100, crate::FLAG_FAMILY_SPECIFIC);
        assert!(sm100f.cubin_runs_on(cc(10, 3)));
        assert!(!sm100f.cubin_runs_on(cc(12, 0)));
    }

    #[test]
    fn ptx_runs_on_later_gpus_unless_specific() {
        let c75 = SmArch::from_entry(75, 0);
        assert!(c75.ptx_runs_on(cc(9, 0)));
        assert!(c75.ptx_runs_on(cc(7, 5)));
        assert!(!c75.ptx_runs_on(cc(7, 0)));
        let c90a = SmArch::from_entry(90, crate::FLAG_ARCH_SPECIFIC);
        assert!(c90a.ptx_runs_on(cc(9, 0)));
        assert!(!c90a.ptx_runs_on(cc(10, 0)));
        let c100f = SmArch::from_entry(100, crate::FLAG_FAMILY_SPECIFIC);
        assert!(c100f.ptx_runs_on(cc(10, 3)));
        assert!(!c100f.ptx_runs_on(cc(12, 0)));
    }
}
