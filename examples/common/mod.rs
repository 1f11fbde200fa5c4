//! Helpers shared by the cudarc examples (included with `#[path]`, not an example itself).
//! Each example uses a different subset, hence the `dead_code` allowance.
//!
//! Everything here is deterministic so that an example prints the same lines on a real GPU,
//! through Gleam and on the emu backend.

#![allow(dead_code)]

use std::process::ExitCode;

/// splitmix64: a tiny deterministic generator for the inputs.
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in [-1, 1), a multiple of 2^-12 so sums and products stay short.
    pub fn next_f32(&mut self) -> f32 {
        ((self.next_u64() >> 51) as i32 - 4096) as f32 / 4096.0
    }
}

/// FNV-1a over the little-endian bytes of the values: the printed checksum.
pub fn checksum<T: Copy, const N: usize>(values: &[T], to_bytes: impl Fn(T) -> [u8; N]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &v in values {
        for b in to_bytes(v) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Compares device results with the CPU reference bit for bit; reports the first mismatches.
pub fn compare_f32(name: &str, got: &[f32], want: &[f32]) -> bool {
    let mut bad = 0usize;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() != w.to_bits() {
            if bad < 5 {
                eprintln!("{name}: mismatch at {i}: got {g:?}, want {w:?}");
            }
            bad += 1;
        }
    }
    if got.len() != want.len() {
        eprintln!("{name}: got {} values, want {}", got.len(), want.len());
        return false;
    }
    if bad > 0 {
        eprintln!("{name}: {bad} of {} values differ", want.len());
    }
    bad == 0
}

/// Turns the outcome of an example's `run` into its exit status.
pub fn finish<E: std::fmt::Debug>(name: &str, outcome: Result<bool, E>) -> ExitCode {
    match outcome {
        Ok(true) => {
            println!("{name}: OK");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("{name}: FAILED (result differs from the CPU reference)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{name}: CUDA error: {e:?}");
            ExitCode::from(2)
        }
    }
}
