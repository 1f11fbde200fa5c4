//! Instruction semantics as plain functions over 64-bit register slots, selected once at compile time so the
//! interpreter's inner loop is an indirect call per lane. Every function reads only the low bits its type
//! needs and returns the result zero-extended from its width.

// The macros below are instantiated for every PTX width: the same `as` is a widening for one type and a
// truncation for another, so `From` cannot express it.
#![allow(clippy::cast_lossless)]

use crate::parse::Ty;
use half::{bf16, f16};

pub type F1 = fn(u64) -> u64;
pub type F2 = fn(u64, u64) -> u64;
pub type F3 = fn(u64, u64, u64) -> u64;
pub type F4 = fn(u64, u64, u64, u64) -> u64;

/// Floating-point rounding mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rnd {
    N = 0,
    Z = 1,
    M = 2,
    P = 3,
}

/// One closure per integer type of `$ty`: each operand `$x` is cast to the type (signed or unsigned) and
/// bound to `$a`; the result is truncated to the type's width (`width`) or is a boolean (`bool`), then
/// zero-extended.
macro_rules! int_fn {
    ($ty:expr, $kind:ident, $f:ty, |$($x:ident as $a:ident),+| $e:expr) => {
        match $ty {
            Ty::U8 | Ty::B8 => Some(int_fn!(@one $kind, $f, u8, u8, |$($x as $a),+| $e)),
            Ty::S8 => Some(int_fn!(@one $kind, $f, i8, u8, |$($x as $a),+| $e)),
            Ty::U16 | Ty::B16 => Some(int_fn!(@one $kind, $f, u16, u16, |$($x as $a),+| $e)),
            Ty::S16 => Some(int_fn!(@one $kind, $f, i16, u16, |$($x as $a),+| $e)),
            Ty::U32 | Ty::B32 => Some(int_fn!(@one $kind, $f, u32, u32, |$($x as $a),+| $e)),
            Ty::S32 => Some(int_fn!(@one $kind, $f, i32, u32, |$($x as $a),+| $e)),
            Ty::U64 | Ty::B64 => Some(int_fn!(@one $kind, $f, u64, u64, |$($x as $a),+| $e)),
            Ty::S64 => Some(int_fn!(@one $kind, $f, i64, u64, |$($x as $a),+| $e)),
            _ => None,
        }
    };
    (@one width, $f:ty, $op:ty, $w:ty, |$($x:ident as $a:ident),+| $e:expr) => {
        (|$($x: u64),+| {
            $(let $a = $x as $op;)+
            ($e) as $w as u64
        }) as $f
    };
    (@one bool, $f:ty, $op:ty, $w:ty, |$($x:ident as $a:ident),+| $e:expr) => {
        (|$($x: u64),+| {
            $(let $a = $x as $op;)+
            ($e) as u64
        }) as $f
    };
}

macro_rules! int2 {
    ($ty:expr, |$a:ident, $b:ident| $e:expr) => {
        int_fn!($ty, width, F2, |x as $a, y as $b| $e)
    };
}

macro_rules! int1 {
    ($ty:expr, |$a:ident| $e:expr) => {
        int_fn!($ty, width, F1, |x as $a| $e)
    };
}

macro_rules! intcmp {
    ($ty:expr, |$a:ident, $b:ident| $e:expr) => {
        int_fn!($ty, bool, F2, |x as $a, y as $b| $e)
    };
}

/// Float closures over f32 / f64 / f16 / bf16 (computed in f32 for the 16-bit formats, which is exact or
/// innocuously double-rounded for +, -, *, /, sqrt) and packed x2 forms: each operand `$x` is bound to
/// `$a` as a float.
macro_rules! flt_fn {
    ($ty:expr, $f:ty, |$($x:ident as $a:ident),+| $e:expr) => {
        match $ty {
            Ty::F32 => Some(
                (|$($x: u64),+| {
                    $(let $a = f32::from_bits($x as u32);)+
                    (($e) as f32).to_bits() as u64
                }) as $f,
            ),
            Ty::F64 => Some(
                (|$($x: u64),+| {
                    $(let $a = f64::from_bits($x);)+
                    (($e) as f64).to_bits()
                }) as $f,
            ),
            Ty::F16 => Some((|$($x: u64),+| flt_fn!(@half h2f, f2h, 0, $($x as $a),+; $e)) as $f),
            Ty::Bf16 => Some((|$($x: u64),+| flt_fn!(@half b2f, f2b, 0, $($x as $a),+; $e)) as $f),
            Ty::F16x2 => Some(
                (|$($x: u64),+| {
                    let lo = flt_fn!(@half h2f, f2h, 0, $($x as $a),+; $e);
                    let hi = flt_fn!(@half h2f, f2h, 16, $($x as $a),+; $e);
                    lo | hi << 16
                }) as $f,
            ),
            Ty::Bf16x2 => Some(
                (|$($x: u64),+| {
                    let lo = flt_fn!(@half b2f, f2b, 0, $($x as $a),+; $e);
                    let hi = flt_fn!(@half b2f, f2b, 16, $($x as $a),+; $e);
                    lo | hi << 16
                }) as $f,
            ),
            _ => None,
        }
    };
    // One 16-bit lane (at bit `$shift`), computed in f32.
    (@half $load:ident, $store:ident, $shift:literal, $($x:ident as $a:ident),+; $e:expr) => {{
        $(let $a = $load($x >> $shift);)+
        $store(($e) as f32)
    }};
}

macro_rules! flt2 {
    ($ty:expr, |$a:ident, $b:ident| $e:expr) => {
        flt_fn!($ty, F2, |x as $a, y as $b| $e)
    };
}

macro_rules! flt1 {
    ($ty:expr, |$a:ident| $e:expr) => {
        flt_fn!($ty, F1, |x as $a| $e)
    };
}

pub fn h2f(x: u64) -> f32 {
    f16::from_bits(x as u16).to_f32()
}
pub fn f2h(v: f32) -> u64 {
    u64::from(f16::from_f32(v).to_bits())
}
pub fn b2f(x: u64) -> f32 {
    bf16::from_bits(x as u16).to_f32()
}
pub fn f2b(v: f32) -> u64 {
    u64::from(bf16::from_f32(v).to_bits())
}
fn f2h64(v: f64) -> u64 {
    u64::from(f16::from_f64(v).to_bits())
}
fn f2b64(v: f64) -> u64 {
    u64::from(bf16::from_f64(v).to_bits())
}

fn f32b(x: u64) -> f32 {
    f32::from_bits(x as u32)
}
fn f64b(x: u64) -> f64 {
    f64::from_bits(x)
}
fn r32(v: f32) -> u64 {
    u64::from(v.to_bits())
}

/// Flush an f32 subnormal to a zero of the same sign (`.ftz`).
pub fn ftz32(x: u64) -> u64 {
    let b = x as u32;
    if b & 0x7f80_0000 == 0 {
        u64::from(b & 0x8000_0000)
    } else {
        u64::from(b)
    }
}

/// Saturate an f32 to [0, 1], NaN to 0 (`.sat`).
pub fn sat32(x: u64) -> u64 {
    let v = f32b(x);
    if v.is_nan() || v <= 0.0 {
        0
    } else if v >= 1.0 {
        r32(1.0)
    } else {
        x & 0xffff_ffff
    }
}

fn next_up32(v: f32) -> f32 {
    if v.is_nan() || v == f32::INFINITY {
        return v;
    }
    if v == 0.0 {
        return f32::from_bits(1);
    }
    let b = v.to_bits();
    f32::from_bits(if v > 0.0 { b + 1 } else { b - 1 })
}
fn next_down32(v: f32) -> f32 {
    -next_up32(-v)
}
fn next_up64(v: f64) -> f64 {
    if v.is_nan() || v == f64::INFINITY {
        return v;
    }
    if v == 0.0 {
        return f64::from_bits(1);
    }
    let b = v.to_bits();
    f64::from_bits(if v > 0.0 { b + 1 } else { b - 1 })
}
fn next_down64(v: f64) -> f64 {
    -next_up64(-v)
}

/// Rounds the exact value `hi + lo` (|lo| at most half an ulp of `hi`) to f32 with `mode`.
pub fn rnd32(hi: f64, lo: f64, mode: Rnd) -> f32 {
    if hi.is_nan() {
        return f32::NAN;
    }
    let mut r = hi as f32;
    if hi.is_infinite() {
        return r;
    }
    // Sign of (r - exact): r - hi is exact, and the sign of a rounded difference is the sign of the exact one.
    let diff = (f64::from(r) - hi) - lo;
    match mode {
        Rnd::N => {
            if lo != 0.0 && r.is_finite() {
                // hi may sit exactly on a midpoint that lo breaks.
                let other = if f64::from(r) > hi {
                    next_down32(r)
                } else {
                    next_up32(r)
                };
                if ((f64::from(r) - hi).abs() - (f64::from(other) - hi).abs()) == 0.0 {
                    let exact_above = lo > 0.0;
                    r = if exact_above {
                        r.max(other)
                    } else {
                        r.min(other)
                    };
                }
            }
            r
        }
        Rnd::Z => {
            if r.is_infinite() {
                return if hi > 0.0 { f32::MAX } else { f32::MIN };
            }
            if hi > 0.0 && diff > 0.0 {
                next_down32(r)
            } else if hi < 0.0 && diff < 0.0 {
                next_up32(r)
            } else {
                r
            }
        }
        Rnd::M => {
            if r == f32::INFINITY {
                return f32::MAX;
            }
            if diff > 0.0 { next_down32(r) } else { r }
        }
        Rnd::P => {
            if r == f32::NEG_INFINITY {
                return f32::MIN;
            }
            if diff < 0.0 { next_up32(r) } else { r }
        }
    }
}

/// Rounds `hi + lo` to f64 where `hi` is already the round-to-nearest result.
pub fn rnd64(hi: f64, lo: f64, mode: Rnd) -> f64 {
    if lo == 0.0 || !hi.is_finite() {
        return hi;
    }
    match mode {
        Rnd::N => hi,
        Rnd::Z => {
            if (hi > 0.0) != (lo > 0.0) {
                if hi > 0.0 {
                    next_down64(hi)
                } else {
                    next_up64(hi)
                }
            } else {
                hi
            }
        }
        Rnd::M => {
            if lo < 0.0 {
                next_down64(hi)
            } else {
                hi
            }
        }
        Rnd::P => {
            if lo > 0.0 {
                next_up64(hi)
            } else {
                hi
            }
        }
    }
}

/// Rounds `hi + lo` to f16 (`bf == false`) or bf16 with `mode`; returns the bits.
pub fn rnd16(hi: f64, lo: f64, mode: Rnd, bf: bool) -> u64 {
    let value = |b: u16| {
        if bf {
            bf16::from_bits(b).to_f64()
        } else {
            f16::from_bits(b).to_f64()
        }
    };
    let r = if bf {
        bf16::from_f64(hi).to_bits()
    } else {
        f16::from_f64(hi).to_bits()
    };
    if hi.is_nan() || hi.is_infinite() || mode == Rnd::N {
        return u64::from(r);
    }
    let max: u16 = if bf { 0x7f7f } else { 0x7bff };
    let neg = r & 0x8000 != 0;
    let rv = value(r);
    if rv.is_infinite() {
        // Overflowed while rounding to nearest: directed modes may stop at the largest finite value.
        let keep_inf = matches!((mode, neg), (Rnd::P, false) | (Rnd::M, true));
        return if keep_inf {
            u64::from(r)
        } else {
            u64::from(r & 0x8000 | max)
        };
    }
    let up = |b: u16| -> u16 {
        if b & 0x8000 == 0 {
            b + 1
        } else if b == 0x8000 {
            1
        } else {
            b - 1
        }
    };
    let down = |b: u16| -> u16 {
        if b & 0x8000 != 0 {
            b + 1
        } else if b == 0 {
            0x8001
        } else {
            b - 1
        }
    };
    // Sign of (r - exact).
    let diff = (rv - hi) - lo;
    let out = match mode {
        Rnd::Z if hi > 0.0 && diff > 0.0 => down(r),
        Rnd::Z if hi < 0.0 && diff < 0.0 => up(r),
        Rnd::M if diff > 0.0 => down(r),
        Rnd::P if diff < 0.0 => up(r),
        _ => r,
    };
    u64::from(out)
}

fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    let e = (a - (s - bb)) + (b - bb);
    (s, e)
}

fn f32_add<const R: u8>(x: u64, y: u64) -> u64 {
    let (s, e) = two_sum(f64::from(f32b(x)), f64::from(f32b(y)));
    r32(rnd32(s, e, rnd(R)))
}
fn f32_sub<const R: u8>(x: u64, y: u64) -> u64 {
    let (s, e) = two_sum(f64::from(f32b(x)), -f64::from(f32b(y)));
    r32(rnd32(s, e, rnd(R)))
}
fn f32_mul<const R: u8>(x: u64, y: u64) -> u64 {
    r32(rnd32(f64::from(f32b(x)) * f64::from(f32b(y)), 0.0, rnd(R)))
}
fn f32_div<const R: u8>(x: u64, y: u64) -> u64 {
    let (a, b) = (f64::from(f32b(x)), f64::from(f32b(y)));
    let q = a / b;
    let lo = if q.is_finite() {
        (-q).mul_add(b, a) / b
    } else {
        0.0
    };
    r32(rnd32(q, lo, rnd(R)))
}
fn f32_fma<const R: u8>(x: u64, y: u64, z: u64) -> u64 {
    // The product of two f32 is exact in f64; two_sum keeps the addition exact as hi + lo.
    let p = f64::from(f32b(x)) * f64::from(f32b(y));
    let (s, e) = two_sum(p, f64::from(f32b(z)));
    r32(rnd32(s, e, rnd(R)))
}
fn f32_sqrt<const R: u8>(x: u64) -> u64 {
    let a = f64::from(f32b(x));
    let r = a.sqrt();
    let lo = if r.is_finite() && r > 0.0 {
        (-r).mul_add(r, a)
    } else {
        0.0
    };
    r32(rnd32(r, lo, rnd(R)))
}
fn f32_rcp<const R: u8>(x: u64) -> u64 {
    f32_div::<R>(r32(1.0), x)
}
fn f64_add<const R: u8>(x: u64, y: u64) -> u64 {
    let (s, e) = two_sum(f64b(x), f64b(y));
    rnd64(s, e, rnd(R)).to_bits()
}
fn f64_sub<const R: u8>(x: u64, y: u64) -> u64 {
    let (s, e) = two_sum(f64b(x), -f64b(y));
    rnd64(s, e, rnd(R)).to_bits()
}
fn f64_mul<const R: u8>(x: u64, y: u64) -> u64 {
    let (a, b) = (f64b(x), f64b(y));
    let p = a * b;
    let e = if p.is_finite() { a.mul_add(b, -p) } else { 0.0 };
    rnd64(p, e, rnd(R)).to_bits()
}
fn f64_div<const R: u8>(x: u64, y: u64) -> u64 {
    let (a, b) = (f64b(x), f64b(y));
    let q = a / b;
    let rem = if q.is_finite() {
        (-q).mul_add(b, a)
    } else {
        0.0
    };
    // sign of the remainder over b gives the side of the exact quotient.
    let lo = if b < 0.0 { -rem } else { rem };
    rnd64(q, lo, rnd(R)).to_bits()
}
fn f64_sqrt<const R: u8>(x: u64) -> u64 {
    let a = f64b(x);
    let r = a.sqrt();
    let lo = if r.is_finite() && r > 0.0 {
        (-r).mul_add(r, a)
    } else {
        0.0
    };
    rnd64(r, lo, rnd(R)).to_bits()
}
fn f64_rcp<const R: u8>(x: u64) -> u64 {
    f64_div::<R>(1f64.to_bits(), x)
}
fn f64_fma<const R: u8>(x: u64, y: u64, z: u64) -> u64 {
    let (a, b, c) = (f64b(x), f64b(y), f64b(z));
    let hi = a.mul_add(b, c);
    if R == 0 || !hi.is_finite() {
        return hi.to_bits();
    }
    // exact = p + ep + c; the sign of (exact - hi) picks the directed neighbour.
    let p = a * b;
    if !p.is_finite() {
        return hi.to_bits();
    }
    let ep = a.mul_add(b, -p);
    let (s, e1) = two_sum(p, c);
    let d = s - hi;
    let (t, t_err) = two_sum(e1, ep);
    let lo = if d + t != 0.0 { d + t } else { t_err };
    rnd64(hi, lo, rnd(R)).to_bits()
}

const fn rnd(r: u8) -> Rnd {
    match r {
        1 => Rnd::Z,
        2 => Rnd::M,
        3 => Rnd::P,
        _ => Rnd::N,
    }
}

macro_rules! sel4 {
    ($f:ident, $m:expr, $t:ty) => {
        match $m {
            Rnd::N => $f::<0> as $t,
            Rnd::Z => $f::<1> as $t,
            Rnd::M => $f::<2> as $t,
            Rnd::P => $f::<3> as $t,
        }
    };
}

/// Integer and bitwise two-operand operations. `op` includes a `mul`/`mad` mode: `mul.lo`, `mul.hi`,
/// `mul.wide`, `add.sat`.
pub fn int_bin(op: &str, ty: Ty) -> Option<F2> {
    match op {
        "add" => int2!(ty, |a, b| a.wrapping_add(b)),
        "sub" => int2!(ty, |a, b| a.wrapping_sub(b)),
        "mul.lo" | "mul" => int2!(ty, |a, b| a.wrapping_mul(b)),
        "min" => int2!(ty, |a, b| a.min(b)),
        "max" => int2!(ty, |a, b| a.max(b)),
        // Division by zero is undefined in PTX; hardware gives all ones, and it must not panic here.
        "div" => int2!(ty, |a, b| if b == 0 { !0 } else { a.wrapping_div(b) }),
        "rem" => int2!(ty, |a, b| if b == 0 { a } else { a.wrapping_rem(b) }),
        "and" => int2!(ty, |a, b| a & b),
        "or" => int2!(ty, |a, b| a | b),
        "xor" => int2!(ty, |a, b| a ^ b),
        "add.sat" if ty == Ty::S32 => {
            Some(|x, y| u64::from((x as i32).saturating_add(y as i32) as u32))
        }
        "sub.sat" if ty == Ty::S32 => {
            Some(|x, y| u64::from((x as i32).saturating_sub(y as i32) as u32))
        }
        "mul.hi" => match ty {
            Ty::U16 => Some(|x, y| u64::from((u32::from(x as u16) * u32::from(y as u16)) >> 16)),
            Ty::S16 => {
                Some(|x, y| u64::from(((i32::from(x as i16) * i32::from(y as i16)) >> 16) as u16))
            }
            Ty::U32 => Some(|x, y| (u64::from(x as u32) * u64::from(y as u32)) >> 32),
            Ty::S32 => {
                Some(|x, y| u64::from(((i64::from(x as i32) * i64::from(y as i32)) >> 32) as u32))
            }
            Ty::U64 => Some(|x, y| ((u128::from(x) * u128::from(y)) >> 64) as u64),
            Ty::S64 => Some(|x, y| ((i128::from(x as i64) * i128::from(y as i64)) >> 64) as u64),
            _ => None,
        },
        "mul.wide" => match ty {
            Ty::U16 => Some(|x, y| u64::from(u32::from(x as u16) * u32::from(y as u16))),
            Ty::S16 => Some(|x, y| u64::from((i32::from(x as i16) * i32::from(y as i16)) as u32)),
            Ty::U32 => Some(|x, y| u64::from(x as u32) * u64::from(y as u32)),
            Ty::S32 => Some(|x, y| (i64::from(x as i32) * i64::from(y as i32)) as u64),
            _ => None,
        },
        "mul24.lo" => match ty {
            Ty::U32 => {
                Some(|x, y| u64::from((x as u32 & 0xff_ffff).wrapping_mul(y as u32 & 0xff_ffff)))
            }
            Ty::S32 => Some(|x, y| {
                let a = ((x as i32) << 8) >> 8;
                let b = ((y as i32) << 8) >> 8;
                u64::from(a.wrapping_mul(b) as u32)
            }),
            _ => None,
        },
        "shl" => match ty.size() {
            2 => Some(|x, y| {
                if (y as u32) >= 16 {
                    0
                } else {
                    u64::from((x as u16) << (y as u32))
                }
            }),
            4 => Some(|x, y| {
                if (y as u32) >= 32 {
                    0
                } else {
                    u64::from((x as u32) << (y as u32))
                }
            }),
            8 => Some(|x, y| if (y as u32) >= 64 { 0 } else { x << (y as u32) }),
            _ => None,
        },
        "shr" => match ty {
            Ty::U16 | Ty::B16 => Some(|x, y| {
                if (y as u32) >= 16 {
                    0
                } else {
                    u64::from((x as u16) >> (y as u32))
                }
            }),
            Ty::S16 => Some(|x, y| u64::from(((x as i16) >> (y as u32).min(15)) as u16)),
            Ty::U32 | Ty::B32 => Some(|x, y| {
                if (y as u32) >= 32 {
                    0
                } else {
                    u64::from((x as u32) >> (y as u32))
                }
            }),
            Ty::S32 => Some(|x, y| u64::from(((x as i32) >> (y as u32).min(31)) as u32)),
            Ty::U64 | Ty::B64 => Some(|x, y| if (y as u32) >= 64 { 0 } else { x >> (y as u32) }),
            Ty::S64 => Some(|x, y| ((x as i64) >> (y as u32).min(63)) as u64),
            _ => None,
        },
        "bmsk" if ty == Ty::B32 => Some(|x, y| {
            let pos = (x as u32).min(32);
            let w = (y as u32).min(32);
            let m = if pos + w >= 32 {
                u32::MAX
            } else {
                (1u32 << (pos + w)) - 1
            };
            let lo = if pos >= 32 {
                u32::MAX
            } else {
                (1u32 << pos) - 1
            };
            u64::from(m & !lo)
        }),
        _ => None,
    }
}

pub fn int_un(op: &str, ty: Ty) -> Option<F1> {
    match op {
        "neg" => int1!(ty, |a| a.wrapping_neg()),
        "abs" => match ty {
            Ty::S16 => Some(|x| u64::from((x as i16).wrapping_abs() as u16)),
            Ty::S32 => Some(|x| u64::from((x as i32).wrapping_abs() as u32)),
            Ty::S64 => Some(|x| (x as i64).wrapping_abs() as u64),
            _ => None,
        },
        "not" => int1!(ty, |a| !a),
        "cnot" => int1!(ty, |a| u8::from(a == 0)),
        "popc" => match ty {
            Ty::B32 | Ty::U32 => Some(|x| u64::from((x as u32).count_ones())),
            Ty::B64 | Ty::U64 => Some(|x| u64::from(x.count_ones())),
            _ => None,
        },
        "clz" => match ty {
            Ty::B32 | Ty::U32 => Some(|x| u64::from((x as u32).leading_zeros())),
            Ty::B64 | Ty::U64 => Some(|x| u64::from(x.leading_zeros())),
            _ => None,
        },
        "brev" => match ty {
            Ty::B32 | Ty::U32 => Some(|x| u64::from((x as u32).reverse_bits())),
            Ty::B64 | Ty::U64 => Some(u64::reverse_bits),
            _ => None,
        },
        "bfind" => match ty {
            Ty::U32 => Some(bfind::<32, false, false>),
            Ty::U64 => Some(bfind::<64, false, false>),
            Ty::S32 => Some(bfind::<32, true, false>),
            Ty::S64 => Some(bfind::<64, true, false>),
            _ => None,
        },
        "bfind.shiftamt" => match ty {
            Ty::U32 => Some(bfind::<32, false, true>),
            Ty::U64 => Some(bfind::<64, false, true>),
            Ty::S32 => Some(bfind::<32, true, true>),
            Ty::S64 => Some(bfind::<64, true, true>),
            _ => None,
        },
        _ => None,
    }
}

/// `bfind`: the position of the most significant bit that is set (for signed types: that differs from the
/// sign bit), counted from bit 0, or with `.shiftamt` as a left shift amount; `0xffffffff` when there is none.
fn bfind<const BITS: u32, const SIGNED: bool, const SHIFTAMT: bool>(x: u64) -> u64 {
    let x = if BITS == 32 { x & 0xffff_ffff } else { x };
    let sign = x >> (BITS - 1) & 1 == 1;
    let v = if SIGNED && sign {
        !x & (u64::MAX >> (64 - BITS))
    } else {
        x
    };
    if v == 0 {
        return u64::from(u32::MAX);
    }
    let leading = v.leading_zeros() - (64 - BITS);
    u64::from(if SHIFTAMT {
        leading
    } else {
        BITS - 1 - leading
    })
}

pub fn int_tern(op: &str, ty: Ty) -> Option<F3> {
    match (op, ty) {
        ("mad.lo" | "mad", Ty::U16 | Ty::S16) => {
            Some(|a, b, c| u64::from((a as u16).wrapping_mul(b as u16).wrapping_add(c as u16)))
        }
        ("mad.lo" | "mad", Ty::U32 | Ty::S32) => {
            Some(|a, b, c| u64::from((a as u32).wrapping_mul(b as u32).wrapping_add(c as u32)))
        }
        ("mad.lo" | "mad", Ty::U64 | Ty::S64) => Some(|a, b, c| a.wrapping_mul(b).wrapping_add(c)),
        ("mad.hi", Ty::U32) => Some(|a, b, c| {
            u64::from(
                (((u64::from(a as u32) * u64::from(b as u32)) >> 32) as u32).wrapping_add(c as u32),
            )
        }),
        ("mad.hi", Ty::S32) => Some(|a, b, c| {
            u64::from(
                (((i64::from(a as i32) * i64::from(b as i32)) >> 32) as u32).wrapping_add(c as u32),
            )
        }),
        ("mad.hi", Ty::U64) => {
            Some(|a, b, c| (((u128::from(a) * u128::from(b)) >> 64) as u64).wrapping_add(c))
        }
        ("mad.hi", Ty::S64) => Some(|a, b, c| {
            (((i128::from(a as i64) * i128::from(b as i64)) >> 64) as u64).wrapping_add(c)
        }),
        ("mad.wide", Ty::U32) => {
            Some(|a, b, c| (u64::from(a as u32) * u64::from(b as u32)).wrapping_add(c))
        }
        ("mad.wide", Ty::S32) => {
            Some(|a, b, c| ((i64::from(a as i32) * i64::from(b as i32)) as u64).wrapping_add(c))
        }
        ("mad.wide", Ty::U16) => Some(|a, b, c| {
            u64::from((u32::from(a as u16) * u32::from(b as u16)).wrapping_add(c as u32))
        }),
        ("mad.wide", Ty::S16) => Some(|a, b, c| {
            u64::from((i32::from(a as i16) * i32::from(b as i16)).wrapping_add(c as i32) as u32)
        }),
        ("mad24.lo", Ty::U32) => Some(|a, b, c| {
            u64::from(
                (a as u32 & 0xff_ffff)
                    .wrapping_mul(b as u32 & 0xff_ffff)
                    .wrapping_add(c as u32),
            )
        }),
        ("mad24.lo", Ty::S32) => Some(|a, b, c| {
            let x = ((a as i32) << 8) >> 8;
            let y = ((b as i32) << 8) >> 8;
            u64::from(x.wrapping_mul(y).wrapping_add(c as i32) as u32)
        }),
        // Funnel shifts: b:a as a 64-bit value.
        ("shf.l.wrap", Ty::B32) => Some(|a, b, c| {
            u64::from(
                (((u64::from(b as u32) << 32 | u64::from(a as u32)) << (c as u32 & 31)) >> 32)
                    as u32,
            )
        }),
        ("shf.l.clamp", Ty::B32) => Some(|a, b, c| {
            let v = u64::from(b as u32) << 32 | u64::from(a as u32);
            let n = (c as u32).min(32);
            u64::from(((v << n) >> 32) as u32)
        }),
        ("shf.r.wrap", Ty::B32) => Some(|a, b, c| {
            u64::from(((u64::from(b as u32) << 32 | u64::from(a as u32)) >> (c as u32 & 31)) as u32)
        }),
        ("shf.r.clamp", Ty::B32) => Some(|a, b, c| {
            let v = u64::from(b as u32) << 32 | u64::from(a as u32);
            let n = (c as u32).min(32);
            u64::from((v >> n) as u32)
        }),
        // SIMD byte absolute difference (`__vabsdiffu4`/`__vabsdiffs4`); `.add` sums the bytes onto c.
        ("vabsdiff4", Ty::U32) => Some(|a, b, _c| {
            let mut d = 0u32;
            for i in 0..4 {
                let (x, y) = ((a >> (8 * i)) as u8, (b >> (8 * i)) as u8);
                d |= u32::from(x.abs_diff(y)) << (8 * i);
            }
            u64::from(d)
        }),
        ("vabsdiff4", Ty::S32) => Some(|a, b, _c| {
            let mut d = 0u32;
            for i in 0..4 {
                let (x, y) = ((a >> (8 * i)) as u8 as i8, (b >> (8 * i)) as u8 as i8);
                d |= u32::from(x.abs_diff(y)) << (8 * i);
            }
            u64::from(d)
        }),
        ("vabsdiff4.add", Ty::U32) => Some(|a, b, c| {
            let mut s = c as u32;
            for i in 0..4 {
                let (x, y) = ((a >> (8 * i)) as u8, (b >> (8 * i)) as u8);
                s = s.wrapping_add(u32::from(x.abs_diff(y)));
            }
            u64::from(s)
        }),
        ("vabsdiff4.add", Ty::S32) => Some(|a, b, c| {
            let mut s = c as u32;
            for i in 0..4 {
                let (x, y) = ((a >> (8 * i)) as u8 as i8, (b >> (8 * i)) as u8 as i8);
                s = s.wrapping_add(u32::from(x.abs_diff(y)));
            }
            u64::from(s)
        }),
        ("sad", Ty::U32) => {
            Some(|a, b, c| u64::from((a as u32).abs_diff(b as u32).wrapping_add(c as u32)))
        }
        ("sad", Ty::S32) => {
            Some(|a, b, c| u64::from((a as i32).abs_diff(b as i32).wrapping_add(c as u32)))
        }
        ("bfe", Ty::U32) => Some(|a, b, c| {
            let (pos, len) = (u32::from(b as u8), u32::from(c as u8));
            let v = a as u32;
            let mut d = 0u32;
            for i in 0..len.min(32) {
                let bit = if pos + i < 32 {
                    (v >> (pos + i)) & 1
                } else {
                    0
                };
                d |= bit << i;
            }
            u64::from(d)
        }),
        ("bfe", Ty::S32) => Some(|a, b, c| {
            let (pos, len) = (u32::from(b as u8), u32::from(c as u8));
            let v = a as u32;
            let sbit = if len == 0 {
                0
            } else {
                (v >> (pos + len - 1).min(31)) & 1
            };
            let mut d = 0u32;
            for i in 0..32 {
                let bit = if i < len && pos + i < 32 {
                    (v >> (pos + i)) & 1
                } else {
                    sbit
                };
                d |= bit << i;
            }
            u64::from(d)
        }),
        ("bfe", Ty::U64) => Some(|a, b, c| {
            let (pos, len) = (u32::from(b as u8), u32::from(c as u8));
            let mut d = 0u64;
            for i in 0..len.min(64) {
                let bit = if pos + i < 64 {
                    (a >> (pos + i)) & 1
                } else {
                    0
                };
                d |= bit << i;
            }
            d
        }),
        ("bfe", Ty::S64) => Some(|a, b, c| {
            let (pos, len) = (u32::from(b as u8), u32::from(c as u8));
            let sbit = if len == 0 {
                0
            } else {
                (a >> (pos + len - 1).min(63)) & 1
            };
            let mut d = 0u64;
            for i in 0..64 {
                let bit = if i < len && pos + i < 64 {
                    (a >> (pos + i)) & 1
                } else {
                    sbit
                };
                d |= bit << i;
            }
            d
        }),
        ("prmt", Ty::B32) => Some(|a, b, c| {
            let bytes = u64::from(a as u32) | (u64::from(b as u32) << 32);
            let sel = c as u32;
            let mut d = 0u32;
            for i in 0..4 {
                let s = (sel >> (4 * i)) & 0xf;
                let byte = ((bytes >> (8 * (s & 7))) & 0xff) as u32;
                let byte = if s & 8 != 0 {
                    if byte & 0x80 != 0 { 0xff } else { 0 }
                } else {
                    byte
                };
                d |= byte << (8 * i);
            }
            u64::from(d)
        }),
        _ => None,
    }
}

pub fn int_quad(op: &str, ty: Ty) -> Option<F4> {
    match (op, ty) {
        // bfi d, a, b, pos, len: insert a's low bits into b.
        ("bfi", Ty::B32) => Some(|a, b, pos, len| {
            let (pos, len) = (u32::from(pos as u8), u32::from(len as u8));
            let mut d = b as u32;
            for i in 0..len {
                if pos + i < 32 {
                    d = (d & !(1 << (pos + i))) | ((((a as u32) >> i) & 1) << (pos + i));
                }
            }
            u64::from(d)
        }),
        ("bfi", Ty::B64) => Some(|a, b, pos, len| {
            let (pos, len) = (u32::from(pos as u8), u32::from(len as u8));
            let mut d = b;
            for i in 0..len {
                if pos + i < 64 {
                    d = (d & !(1 << (pos + i))) | (((a >> i) & 1) << (pos + i));
                }
            }
            d
        }),
        ("lop3", Ty::B32) => Some(|a, b, c, lut| {
            let (a, b, c, lut) = (a as u32, b as u32, c as u32, lut as u8);
            let mut d = 0u32;
            for k in 0..8u32 {
                if lut & (1 << k) != 0 {
                    let ma = if k & 4 != 0 { a } else { !a };
                    let mb = if k & 2 != 0 { b } else { !b };
                    let mc = if k & 1 != 0 { c } else { !c };
                    d |= ma & mb & mc;
                }
            }
            u64::from(d)
        }),
        _ => None,
    }
}

/// PTX `min`/`max`: a NaN operand yields the other operand, and -0 orders below +0.
trait MinMax: Copy {
    fn pmin(self, b: Self) -> Self;
    fn pmax(self, b: Self) -> Self;
}

macro_rules! minmax {
    ($t:ty) => {
        impl MinMax for $t {
            fn pmin(self, b: Self) -> Self {
                if self == b {
                    if self.is_sign_negative() { self } else { b }
                } else {
                    self.min(b)
                }
            }
            fn pmax(self, b: Self) -> Self {
                if self == b {
                    if self.is_sign_positive() { self } else { b }
                } else {
                    self.max(b)
                }
            }
        }
    };
}
minmax!(f32);
minmax!(f64);

/// Float two-operand operations with a rounding mode.
pub fn flt_bin(op: &str, ty: Ty, m: Rnd) -> Option<F2> {
    match (op, ty) {
        ("add", Ty::F32) => Some(sel4!(f32_add, m, F2)),
        ("sub", Ty::F32) => Some(sel4!(f32_sub, m, F2)),
        ("mul", Ty::F32) => Some(sel4!(f32_mul, m, F2)),
        ("div", Ty::F32) => Some(sel4!(f32_div, m, F2)),
        ("add", Ty::F64) => Some(sel4!(f64_add, m, F2)),
        ("sub", Ty::F64) => Some(sel4!(f64_sub, m, F2)),
        ("mul", Ty::F64) => Some(sel4!(f64_mul, m, F2)),
        ("div", Ty::F64) => Some(sel4!(f64_div, m, F2)),
        _ if m != Rnd::N => None,
        ("add", _) => flt2!(ty, |a, b| a + b),
        ("sub", _) => flt2!(ty, |a, b| a - b),
        ("mul", _) => flt2!(ty, |a, b| a * b),
        ("div", _) => flt2!(ty, |a, b| a / b),
        ("min", _) => flt2!(ty, |a, b| a.pmin(b)),
        ("max", _) => flt2!(ty, |a, b| a.pmax(b)),
        ("min.NaN", _) => flt2!(ty, |a, b| if a.is_nan() || b.is_nan() {
            a + b
        } else {
            a.pmin(b)
        }),
        ("max.NaN", _) => flt2!(ty, |a, b| if a.is_nan() || b.is_nan() {
            a + b
        } else {
            a.pmax(b)
        }),
        // copysign d, a, b: b's magnitude with a's sign.
        ("copysign", _) => flt2!(ty, |a, b| b.copysign(a)),
        _ => None,
    }
}

pub fn flt_tern(op: &str, ty: Ty, m: Rnd) -> Option<F3> {
    match (op, ty) {
        ("fma" | "mad", Ty::F32) => Some(sel4!(f32_fma, m, F3)),
        ("fma" | "mad", Ty::F64) => Some(sel4!(f64_fma, m, F3)),
        ("fma" | "mad", Ty::F16) if m == Rnd::N => {
            Some(|a, b, c| f2h64(f64::from(h2f(a)).mul_add(f64::from(h2f(b)), f64::from(h2f(c)))))
        }
        ("fma" | "mad", Ty::Bf16) if m == Rnd::N => {
            Some(|a, b, c| f2b64(f64::from(b2f(a)).mul_add(f64::from(b2f(b)), f64::from(b2f(c)))))
        }
        ("fma" | "mad", Ty::F16x2) if m == Rnd::N => Some(|a, b, c| {
            let lo = f2h64(f64::from(h2f(a)).mul_add(f64::from(h2f(b)), f64::from(h2f(c))));
            let hi = f2h64(
                f64::from(h2f(a >> 16)).mul_add(f64::from(h2f(b >> 16)), f64::from(h2f(c >> 16))),
            );
            lo | hi << 16
        }),
        ("fma" | "mad", Ty::Bf16x2) if m == Rnd::N => Some(|a, b, c| {
            let lo = f2b64(f64::from(b2f(a)).mul_add(f64::from(b2f(b)), f64::from(b2f(c))));
            let hi = f2b64(
                f64::from(b2f(a >> 16)).mul_add(f64::from(b2f(b >> 16)), f64::from(b2f(c >> 16))),
            );
            lo | hi << 16
        }),
        _ => None,
    }
}

/// Unary float operations. `approx` ops are computed in f64 and rounded: well within PTX's error bounds.
pub fn flt_un(op: &str, ty: Ty, m: Rnd) -> Option<F1> {
    match (op, ty) {
        ("sqrt", Ty::F32) => Some(sel4!(f32_sqrt, m, F1)),
        ("sqrt", Ty::F64) => Some(sel4!(f64_sqrt, m, F1)),
        ("rcp", Ty::F32) => Some(sel4!(f32_rcp, m, F1)),
        ("rcp", Ty::F64) => Some(sel4!(f64_rcp, m, F1)),
        _ if m != Rnd::N => None,
        ("neg", _) => flt1!(ty, |a| -a),
        ("abs", _) => flt1!(ty, |a| a.abs()),
        ("rsqrt", Ty::F32) => Some(|x| r32((1.0 / f64::from(f32b(x)).sqrt()) as f32)),
        ("rsqrt", Ty::F64) => Some(|x| (1.0 / f64b(x).sqrt()).to_bits()),
        ("sin", Ty::F32) => Some(|x| r32(f64::from(f32b(x)).sin() as f32)),
        ("cos", Ty::F32) => Some(|x| r32(f64::from(f32b(x)).cos() as f32)),
        ("ex2", Ty::F32) => Some(|x| r32(f64::from(f32b(x)).exp2() as f32)),
        ("lg2", Ty::F32) => Some(|x| r32(f64::from(f32b(x)).log2() as f32)),
        ("tanh", Ty::F32) => Some(|x| r32(f64::from(f32b(x)).tanh() as f32)),
        ("ex2", Ty::F16) => Some(|x| f2h64(f64::from(h2f(x)).exp2())),
        ("tanh", Ty::F16) => Some(|x| f2h64(f64::from(h2f(x)).tanh())),
        ("ex2", Ty::F16x2) => {
            Some(|x| f2h64(f64::from(h2f(x)).exp2()) | f2h64(f64::from(h2f(x >> 16)).exp2()) << 16)
        }
        ("tanh", Ty::F16x2) => {
            Some(|x| f2h64(f64::from(h2f(x)).tanh()) | f2h64(f64::from(h2f(x >> 16)).tanh()) << 16)
        }
        ("ex2", Ty::Bf16) => Some(|x| f2b64(f64::from(b2f(x)).exp2())),
        ("tanh", Ty::Bf16) => Some(|x| f2b64(f64::from(b2f(x)).tanh())),
        _ => None,
    }
}

/// Float comparison for `setp`/`set`: returns 0 or 1. The unordered forms are spelled as negated ordered
/// comparisons on purpose: they are true when either side is NaN.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub fn flt_cmp(op: &str, ty: Ty) -> Option<F2> {
    macro_rules! fc {
        (|$a:ident, $b:ident| $e:expr) => {
            match ty {
                Ty::F32 => Some(
                    (|x: u64, y: u64| {
                        let $a = f32b(x) as f64;
                        let $b = f32b(y) as f64;
                        ($e) as u64
                    }) as F2,
                ),
                Ty::F64 => Some(
                    (|x: u64, y: u64| {
                        let $a = f64b(x);
                        let $b = f64b(y);
                        ($e) as u64
                    }) as F2,
                ),
                Ty::F16 => Some(
                    (|x: u64, y: u64| {
                        let $a = h2f(x) as f64;
                        let $b = h2f(y) as f64;
                        ($e) as u64
                    }) as F2,
                ),
                Ty::Bf16 => Some(
                    (|x: u64, y: u64| {
                        let $a = b2f(x) as f64;
                        let $b = b2f(y) as f64;
                        ($e) as u64
                    }) as F2,
                ),
                _ => None,
            }
        };
    }
    match op {
        "eq" => fc!(|a, b| a == b),
        "ne" => fc!(|a, b| a != b && !a.is_nan() && !b.is_nan()),
        "lt" => fc!(|a, b| a < b),
        "le" => fc!(|a, b| a <= b),
        "gt" => fc!(|a, b| a > b),
        "ge" => fc!(|a, b| a >= b),
        "equ" => fc!(|a, b| a == b || a.is_nan() || b.is_nan()),
        "neu" => fc!(|a, b| a != b),
        "ltu" => fc!(|a, b| !(a >= b)),
        "leu" => fc!(|a, b| !(a > b)),
        "gtu" => fc!(|a, b| !(a <= b)),
        "geu" => fc!(|a, b| !(a < b)),
        "num" => fc!(|a, b| !a.is_nan() && !b.is_nan()),
        "nan" => fc!(|a, b| a.is_nan() || b.is_nan()),
        _ => None,
    }
}

pub fn int_cmp(op: &str, ty: Ty) -> Option<F2> {
    // lo/ls/hi/hs compare unsigned whatever the type says.
    let uty = match ty {
        Ty::S8 => Ty::U8,
        Ty::S16 => Ty::U16,
        Ty::S32 => Ty::U32,
        Ty::S64 => Ty::U64,
        t => t,
    };
    match op {
        "eq" => intcmp!(ty, |a, b| a == b),
        "ne" => intcmp!(ty, |a, b| a != b),
        "lt" => intcmp!(ty, |a, b| a < b),
        "le" => intcmp!(ty, |a, b| a <= b),
        "gt" => intcmp!(ty, |a, b| a > b),
        "ge" => intcmp!(ty, |a, b| a >= b),
        "lo" => intcmp!(uty, |a, b| a < b),
        "ls" => intcmp!(uty, |a, b| a <= b),
        "hi" => intcmp!(uty, |a, b| a > b),
        "hs" => intcmp!(uty, |a, b| a >= b),
        _ => None,
    }
}

pub fn testp(op: &str, ty: Ty) -> Option<F1> {
    macro_rules! tp {
        (|$a:ident| $e:expr) => {
            match ty {
                Ty::F32 => Some(
                    (|x: u64| {
                        let $a = f32b(x);
                        ($e) as u64
                    }) as F1,
                ),
                Ty::F64 => Some(
                    (|x: u64| {
                        let $a = f64b(x);
                        ($e) as u64
                    }) as F1,
                ),
                _ => None,
            }
        };
    }
    match op {
        "finite" => tp!(|a| a.is_finite()),
        "infinite" => tp!(|a| a.is_infinite()),
        "number" => tp!(|a| !a.is_nan()),
        "notanumber" => tp!(|a| a.is_nan()),
        "normal" => tp!(|a| a.is_normal()),
        "subnormal" => tp!(|a| a.is_subnormal()),
        _ => None,
    }
}

/// `dp4a` (N = 4: bytes of a times bytes of b) and `dp2a` (N = 2: halves of a times bytes OFF.. of b),
/// accumulated onto c; SA/SB say whether a's and b's parts are signed.
pub fn dp<const SA: bool, const SB: bool, const N: u32, const OFF: u32>(
    a: u64,
    b: u64,
    c: u64,
) -> u64 {
    let mut acc = i64::from(c as u32);
    for i in 0..N {
        let x = if N == 4 {
            let v = (a >> (8 * i)) as u8;
            if SA { i64::from(v as i8) } else { i64::from(v) }
        } else {
            let v = (a >> (16 * i)) as u16;
            if SA {
                i64::from(v as i16)
            } else {
                i64::from(v)
            }
        };
        let v = (b >> (8 * (i + OFF))) as u8;
        let y = if SB { i64::from(v as i8) } else { i64::from(v) };
        acc += x * y;
    }
    u64::from(acc as u32)
}

/// Operand kinds for `cvt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CvtSpec {
    pub dst: Ty,
    pub src: Ty,
    pub rnd: Rnd,
    /// `.rni`-style integer rounding for float results (`cvt.rni.f32.f32`).
    pub int_round: bool,
    pub sat: bool,
    pub ftz: bool,
}

fn int_bits(t: Ty) -> Option<(u32, bool)> {
    Some(match t {
        Ty::U8 | Ty::B8 => (8, false),
        Ty::S8 => (8, true),
        Ty::U16 | Ty::B16 => (16, false),
        Ty::S16 => (16, true),
        Ty::U32 | Ty::B32 => (32, false),
        Ty::S32 => (32, true),
        Ty::U64 | Ty::B64 => (64, false),
        Ty::S64 => (64, true),
        _ => return None,
    })
}

pub fn cvt_supported(s: &CvtSpec) -> bool {
    let scalar_f = |t: Ty| matches!(t, Ty::F16 | Ty::Bf16 | Ty::F32 | Ty::F64);
    let src_ok = int_bits(s.src).is_some() || scalar_f(s.src);
    let dst_ok = int_bits(s.dst).is_some() || scalar_f(s.dst);
    src_ok && dst_ok
}

fn round_int(v: f64, m: Rnd) -> f64 {
    match m {
        Rnd::N => v.round_ties_even(),
        Rnd::Z => v.trunc(),
        Rnd::M => v.floor(),
        Rnd::P => v.ceil(),
    }
}

/// `cvt` of one value; `cvt_supported(s)` must hold.
pub fn cvt(x: u64, s: &CvtSpec) -> u64 {
    enum V {
        I(i128),
        F(f64),
    }
    let v = match s.src {
        Ty::F16 => V::F(f64::from(h2f(x))),
        Ty::Bf16 => V::F(f64::from(b2f(x))),
        Ty::F32 => V::F(f64::from(f32b(if s.ftz { ftz32(x) } else { x }))),
        Ty::F64 => V::F(f64b(x)),
        t => {
            let (bits, signed) = int_bits(t).unwrap_or((64, false));
            let sh = 64 - bits;
            V::I(if signed {
                i128::from(((x << sh) as i64) >> sh)
            } else {
                i128::from((x << sh) >> sh)
            })
        }
    };
    if let Some((bits, signed)) = int_bits(s.dst) {
        let (min, max): (i128, i128) = if signed {
            (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
        } else {
            (0, (1i128 << bits) - 1)
        };
        let i = match v {
            V::I(i) => {
                if s.sat {
                    i.clamp(min, max)
                } else {
                    i
                }
            }
            V::F(f) => {
                if f.is_nan() {
                    0
                } else {
                    // Float to integer always saturates.
                    let r = round_int(f, s.rnd);
                    if r <= min as f64 {
                        min
                    } else if r >= max as f64 {
                        max
                    } else {
                        r as i128
                    }
                }
            }
        };
        let u = i as u64;
        return if bits == 64 {
            u
        } else {
            u & ((1u64 << bits) - 1)
        };
    }
    // Float destination: the exact value as hi + lo.
    let (hi, lo) = match v {
        V::I(i) => {
            let hi = i as f64;
            (hi, (i - hi as i128) as f64)
        }
        V::F(f) => (if s.int_round { round_int(f, s.rnd) } else { f }, 0.0),
    };
    let m = if s.int_round { Rnd::N } else { s.rnd };
    let out = match s.dst {
        Ty::F64 => rnd64(hi, lo, m).to_bits(),
        Ty::F32 => {
            let r = r32(rnd32(hi, lo, m));
            if s.ftz { ftz32(r) } else { r }
        }
        Ty::F16 => rnd16(hi, lo, m, false),
        Ty::Bf16 => rnd16(hi, lo, m, true),
        _ => 0,
    };
    if s.sat {
        match s.dst {
            Ty::F32 => sat32(out),
            Ty::F64 => {
                let f = f64b(out);
                if f.is_nan() {
                    0
                } else {
                    f.clamp(0.0, 1.0).to_bits()
                }
            }
            Ty::F16 => {
                let f = h2f(out);
                if f.is_nan() {
                    0
                } else {
                    f2h(f.clamp(0.0, 1.0))
                }
            }
            _ => out,
        }
    } else {
        out
    }
}

/// Atomic operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomOp {
    Add,
    FAdd32,
    FAdd64,
    /// Packed `f16x2` / `bf16x2` additions (each half rounded to nearest).
    FAddH2,
    FAddB2,
    Min,
    Max,
    Exch,
    Cas,
    And,
    Or,
    Xor,
    Inc,
    Dec,
}

/// New value of an atomic `op` on `old` with operands `b` (and `c` for cas) at `size` bytes.
pub fn atom_apply(op: AtomOp, signed: bool, size: usize, old: u64, b: u64, c: u64) -> u64 {
    let mask = if size == 8 { u64::MAX } else { 0xffff_ffff };
    let (old, b, c) = (old & mask, b & mask, c & mask);
    let r = match op {
        AtomOp::Add => old.wrapping_add(b),
        AtomOp::FAdd32 => r32(f32b(old) + f32b(b)),
        AtomOp::FAdd64 => (f64b(old) + f64b(b)).to_bits(),
        AtomOp::FAddH2 => f2h(h2f(old) + h2f(b)) | f2h(h2f(old >> 16) + h2f(b >> 16)) << 16,
        AtomOp::FAddB2 => f2b(b2f(old) + b2f(b)) | f2b(b2f(old >> 16) + b2f(b >> 16)) << 16,
        AtomOp::Min | AtomOp::Max => {
            let less = if signed {
                if size == 8 {
                    (old as i64) < (b as i64)
                } else {
                    (old as u32 as i32) < (b as u32 as i32)
                }
            } else {
                old < b
            };
            if (op == AtomOp::Min) == less { old } else { b }
        }
        AtomOp::Exch => b,
        AtomOp::Cas => {
            if old == b {
                c
            } else {
                old
            }
        }
        AtomOp::And => old & b,
        AtomOp::Or => old | b,
        AtomOp::Xor => old ^ b,
        AtomOp::Inc => {
            if old >= b {
                0
            } else {
                old + 1
            }
        }
        AtomOp::Dec => {
            if old == 0 || old > b {
                b
            } else {
                old - 1
            }
        }
    };
    r & mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bfind_finds_the_highest_significant_bit() {
        let none = u64::from(u32::MAX);
        let b = |ty, x| int_un("bfind", ty).unwrap()(x);
        let s = |ty, x| int_un("bfind.shiftamt", ty).unwrap()(x);
        assert_eq!(b(Ty::U32, 0), none);
        assert_eq!(b(Ty::U32, 1), 0);
        assert_eq!(
            b(Ty::U32, 0xdead_0000_8000_0000),
            31,
            "only the low 32 bits count"
        );
        assert_eq!(s(Ty::U32, 1), 31);
        assert_eq!(b(Ty::U64, 1 << 40), 40);
        assert_eq!(s(Ty::U64, 1 << 40), 23);
        assert_eq!(b(Ty::S32, u64::from(-1i32 as u32)), none);
        assert_eq!(b(Ty::S32, u64::from(-2i32 as u32)), 0);
        assert_eq!(b(Ty::S32, 0x7fff_ffff), 30);
        assert_eq!(s(Ty::S32, 0x7fff_ffff), 1);
        assert_eq!(b(Ty::S64, (-1i64 << 40) as u64), 39);
        assert_eq!(b(Ty::S64, u64::MAX), none);
    }
}
