//! Settings from the environment: how a thread that waits for the other end of a session waits (the
//! client waiting for a reply, the session process waiting for the next request), and the byte sizes
//! that variables such as `GLEAM_CACHE_THRESHOLD` and `GLEAM_EMU_MEMORY` are written in.

use std::sync::OnceLock;
use std::time::Duration;

/// Default of [`spin_budget`]: a LAN round trip (up to a millisecond or so) with margin, so a thread
/// waiting for a reply over the LAN, or a session waiting for a synchronizing client's next request,
/// stays awake.
const DEFAULT_SPIN: Duration = Duration::from_millis(2);
/// Hosts with fewer cores do not spin by default.
const SPIN_MIN_CORES: usize = 4;

/// How long a waiting thread spins before parking: `GLEAM_SPIN_US` microseconds if set, else
/// [`DEFAULT_SPIN`] on hosts with at least [`SPIN_MIN_CORES`] cores and none on smaller ones, where a
/// spinning thread would take the core that the awaited reply needs (CUDA's own "auto" scheduling makes
/// the same choice).
///
/// Waking a parked thread costs microseconds, far more from a deep idle state: with one millisecond
/// between requests, every hop of a round trip would pay it.
pub fn spin_budget() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let configured = std::env::var("GLEAM_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        match configured {
            Some(us) => Duration::from_micros(us.min(1_000_000)),
            None => {
                let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
                if cores >= SPIN_MIN_CORES {
                    DEFAULT_SPIN
                } else {
                    Duration::ZERO
                }
            }
        }
    })
}

/// Whether a setting's value turns something off: `off`, `0`, `false` or `no`, in any case.
pub fn turned_off(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "off" | "0" | "false" | "no"
    )
}

/// A byte size as written in the environment: a number with an optional unit, `K`, `M`, `G` or `T`, with
/// or without `B`/`iB`, in any case, all powers of 1024 (as memory sizes are): `4096`, `64KiB`, `2 M`,
/// `1gb`. `None` for anything else, or a size past `u64`.
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

#[cfg(test)]
mod size_tests {
    use super::{parse_size, turned_off};

    #[test]
    fn off_is_off_in_any_spelling_and_nothing_else_is() {
        for v in ["off", "OFF", " 0 ", "false", "No"] {
            assert!(turned_off(v), "{v:?}");
        }
        for v in ["on", "1", "", "offline", "auto"] {
            assert!(!turned_off(v), "{v:?}");
        }
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("123"), Some(123));
        assert_eq!(parse_size("64KiB"), Some(64 << 10));
        assert_eq!(parse_size(" 2 M "), Some(2 << 20));
        assert_eq!(parse_size("512 MiB"), Some(512 << 20));
        assert_eq!(parse_size("1gb"), Some(1 << 30));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("3t"), Some(3 << 40));
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("1.5MiB"), None);
        assert_eq!(parse_size("MiB"), None);
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("99999999999TiB"), None);
    }
}
