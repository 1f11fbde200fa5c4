//! Stream attributes (`cuStreamSetAttribute`/`GetAttribute`/`CopyAttributes`): an L2 access-policy
//! window, a synchronization policy, a priority and a memory synchronization domain (and its map). On a
//! GPU they steer its caches and schedulers; here there is no cache to steer, so a stream keeps what it
//! was given, checked as the driver checks it, and answers with it. The priority is the stream's own, the
//! one its work is scheduled by ([`crate::streams::Streams::set_priority`]).

use gleam_protocol::api::AttrValue;
use gleam_protocol::types::CUresult;

/// `CUstreamAttrID` (= `CUlaunchAttributeID`) values that apply to streams.
pub const ACCESS_POLICY_WINDOW: u32 = 1;
pub const SYNCHRONIZATION_POLICY: u32 = 3;
pub const PRIORITY: u32 = 8;
pub const MEM_SYNC_DOMAIN_MAP: u32 = 9;
pub const MEM_SYNC_DOMAIN: u32 = 10;

/// `CU_SYNC_POLICY_AUTO` .. `CU_SYNC_POLICY_BLOCKING_SYNC`.
const SYNC_POLICY_AUTO: u32 = 1;
const SYNC_POLICY_LAST: u32 = 4;
/// `CU_ACCESS_PROPERTY_PERSISTING`, the last `CUaccessProperty`; a miss may not persist.
const ACCESS_PERSISTING: u32 = 2;
/// `CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE`, the last domain.
const DOMAIN_REMOTE: u32 = 1;

/// `CUaccessPolicyWindow`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    pub base: u64,
    pub bytes: u64,
    pub hit_ratio: f32,
    pub hit_prop: u32,
    pub miss_prop: u32,
}

/// One attribute with its value, checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Attr {
    Window(Window),
    SyncPolicy(u32),
    Priority(i32),
    DomainMap([u8; 2]),
    Domain(u32),
}

/// What the device allows: the largest window, and how many sync domains it has.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_window: u64,
    pub domains: u8,
}

impl Attr {
    /// Attribute `id` as `cuStreamSetAttribute` gives it: `CUDA_ERROR_INVALID_VALUE` for an id that is
    /// not a stream attribute or a value out of range.
    pub fn parse(id: u32, v: &AttrValue, limits: Limits) -> Result<Self, CUresult> {
        let w = v.0;
        let low = w[0] as u32;
        let attr = match id {
            ACCESS_POLICY_WINDOW => {
                let window = Window {
                    base: w[0],
                    bytes: w[1],
                    hit_ratio: f32::from_bits(w[2] as u32),
                    hit_prop: (w[2] >> 32) as u32,
                    miss_prop: w[3] as u32,
                };
                if window.bytes > limits.max_window
                    || !(0.0..=1.0).contains(&window.hit_ratio)
                    || window.hit_prop > ACCESS_PERSISTING
                    || window.miss_prop >= ACCESS_PERSISTING
                {
                    return Err(CUresult::INVALID_VALUE);
                }
                Self::Window(window)
            }
            SYNCHRONIZATION_POLICY if (SYNC_POLICY_AUTO..=SYNC_POLICY_LAST).contains(&low) => {
                Self::SyncPolicy(low)
            }
            PRIORITY => Self::Priority(low as i32),
            MEM_SYNC_DOMAIN_MAP => {
                let map = [w[0] as u8, (w[0] >> 8) as u8];
                if map.iter().any(|&d| d >= limits.domains) {
                    return Err(CUresult::INVALID_VALUE);
                }
                Self::DomainMap(map)
            }
            MEM_SYNC_DOMAIN if low <= DOMAIN_REMOTE => Self::Domain(low),
            _ => return Err(CUresult::INVALID_VALUE),
        };
        Ok(attr)
    }

    /// The value as `cuStreamGetAttribute` writes it (the rest of the union zeroed).
    pub fn value(self) -> AttrValue {
        let mut w = [0u64; 8];
        match self {
            Self::Window(win) => {
                w[0] = win.base;
                w[1] = win.bytes;
                w[2] = u64::from(win.hit_ratio.to_bits()) | (u64::from(win.hit_prop) << 32);
                w[3] = u64::from(win.miss_prop);
            }
            Self::SyncPolicy(v) | Self::Domain(v) => w[0] = u64::from(v),
            Self::Priority(p) => w[0] = u64::from(p as u32),
            Self::DomainMap([d, r]) => w[0] = u64::from(d) | (u64::from(r) << 8),
        }
        AttrValue(w)
    }
}

/// The attributes a stream keeps (its priority lives with the stream itself).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamAttrs {
    window: Window,
    sync_policy: u32,
    domain_map: [u8; 2],
    domain: u32,
}

impl Default for StreamAttrs {
    fn default() -> Self {
        Self {
            window: Window::default(),
            sync_policy: SYNC_POLICY_AUTO,
            domain_map: [0, 0],
            domain: 0,
        }
    }
}

impl StreamAttrs {
    /// Attribute `id` of a stream of priority `priority`.
    pub fn get(&self, id: u32, priority: i32) -> Result<Attr, CUresult> {
        Ok(match id {
            ACCESS_POLICY_WINDOW => Attr::Window(self.window),
            SYNCHRONIZATION_POLICY => Attr::SyncPolicy(self.sync_policy),
            PRIORITY => Attr::Priority(priority),
            MEM_SYNC_DOMAIN_MAP => Attr::DomainMap(self.domain_map),
            MEM_SYNC_DOMAIN => Attr::Domain(self.domain),
            _ => return Err(CUresult::INVALID_VALUE),
        })
    }

    /// Keeps `attr` (a priority is the caller's to apply to the stream).
    pub fn set(&mut self, attr: Attr) {
        match attr {
            Attr::Window(w) => self.window = w,
            Attr::SyncPolicy(p) => self.sync_policy = p,
            Attr::DomainMap(m) => self.domain_map = m,
            Attr::Domain(d) => self.domain = d,
            Attr::Priority(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_window: 1 << 20,
        domains: 1,
    };

    fn value(words: &[u64]) -> AttrValue {
        let mut w = [0u64; 8];
        w[..words.len()].copy_from_slice(words);
        AttrValue(w)
    }

    #[test]
    fn values_round_trip_through_the_union() {
        let window = value(&[
            0x7000_0000,
            4096,
            u64::from(0.5f32.to_bits()) | (2 << 32),
            1,
        ]);
        let attr = Attr::parse(ACCESS_POLICY_WINDOW, &window, LIMITS).unwrap();
        assert_eq!(attr.value(), window);
        let mut attrs = StreamAttrs::default();
        attrs.set(attr);
        assert_eq!(attrs.get(ACCESS_POLICY_WINDOW, 0), Ok(attr));
        assert_eq!(
            attrs.get(SYNCHRONIZATION_POLICY, 0),
            Ok(Attr::SyncPolicy(SYNC_POLICY_AUTO))
        );
        assert_eq!(
            Attr::parse(PRIORITY, &value(&[u64::from((-3i32) as u32)]), LIMITS),
            Ok(Attr::Priority(-3))
        );
        assert_eq!(attrs.get(PRIORITY, -3).unwrap().value().0[0], 0xffff_fffd);
    }

    #[test]
    fn out_of_range_values_and_launch_only_ids_are_refused() {
        let bad = [
            // Window larger than the device allows, hit ratio above 1, a persisting miss.
            (ACCESS_POLICY_WINDOW, value(&[0, 2 << 20, 0, 0])),
            (
                ACCESS_POLICY_WINDOW,
                value(&[0, 16, u64::from(1.5f32.to_bits())]),
            ),
            (ACCESS_POLICY_WINDOW, value(&[0, 16, 0, 2])),
            (SYNCHRONIZATION_POLICY, value(&[0])),
            (SYNCHRONIZATION_POLICY, value(&[5])),
            (MEM_SYNC_DOMAIN, value(&[2])),
            // One domain here: a map may only name domain 0.
            (MEM_SYNC_DOMAIN_MAP, value(&[1 << 8])),
            // Cooperative launches and clusters are launch attributes, not stream ones.
            (2, value(&[1])),
            (4, value(&[1])),
        ];
        for (id, v) in bad {
            assert_eq!(
                Attr::parse(id, &v, LIMITS),
                Err(CUresult::INVALID_VALUE),
                "{id}"
            );
        }
        assert_eq!(
            StreamAttrs::default().get(2, 0),
            Err(CUresult::INVALID_VALUE)
        );
    }
}
